"""Prometheus metrics and logs of the worker, and the leak sampler that feeds them. May import
memory/, model/ (routing stats), engine.scheduler (priority names) and moeguard_core; model/ and
memory/ never import telemetry/."""
