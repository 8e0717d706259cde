"""The test harness shared by hack/, bench/ and tests/: stack (kubectl, helm, Prometheus, the operator
process), the worker launcher, the metrics text parser, the control-plane helpers, the load generator.
Imports neither hack/ nor bench/ (it runs hack/ scripts by path); hack/ and bench/ import it."""
