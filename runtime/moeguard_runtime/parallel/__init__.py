"""Expert parallelism: the group of ranks, its settings, its followers and its metrics. May import
model/, memory/, telemetry/, engine/ (ep_worker runs a Worker) and moeguard_core; model/ imports it
only for expert blocks; api/ never."""
