"""The model: the embedded transformer, MoE layers and their kernels, HF checkpoints and families/
(one module per ``model_type``), step timing marks. May import memory/, parallel/ (expert blocks)
and moeguard_core; never api/, engine/ or telemetry/."""
