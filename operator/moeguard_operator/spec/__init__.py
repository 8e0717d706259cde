"""The MoEInferenceService spec: the pydantic models, the CRD generator, the spec checks, the core
schemas (core_v1.json). Imports only moeguard_core (and itself): never children/, loop/, diagnosis/
or the top-level modules."""
