"""The diagnosis: why a worker is in trouble, from an observation and its signals. May import
spec/, loop.observation, loop.signals, loop.report and moeguard_core; never children/."""
