"""Serving: the scheduler, the step loop, generation, the Worker service, the engine over the model,
budget watching, overload and the memory guard. May import model/, memory/, telemetry/, parallel/, the
top-level config and faults, api.tokenizer (EOS) and moeguard_core; model/ and memory/ never import engine/."""
