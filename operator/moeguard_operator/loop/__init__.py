"""The control loop: observe (Prometheus, pods) into an Observation, decide budgets (policy), tick,
report status and conditions, metrics. May import spec/, children/, diagnosis/ and moeguard_core."""
