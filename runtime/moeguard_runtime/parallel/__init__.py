"""Expert parallelism: the group of ranks, its settings, its followers and its metrics. May import
model/, memory/, telemetry/, the top-level config and env_values and moeguard_core (engine/ for types
only); model/ imports it only for expert blocks; api/ never."""
