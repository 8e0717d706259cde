"""Serving: the scheduler, the step loop, generation, the Worker service, the engine over the model,
budget watching, overload and the memory guard. May import model/, memory/, telemetry/, parallel/ and
moeguard_core (and api.tokenizer for EOS); model/ and memory/ never import engine/."""
