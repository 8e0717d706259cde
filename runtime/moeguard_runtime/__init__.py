"""moeguard's torch MoE worker, by concept (docs/architecture.md has the map and the rules).

Top level: ``__main__`` (the entry point), ``config``, ``env_values``, ``faults``. The torch-free
rules the operator shares (contract, presets, memory model, UCX judgement) live in :mod:`moeguard_core`.
Importing this package imports no torch: package ``__init__`` files re-export nothing.
"""
