"""The torch-free layer that the operator, the CLI and the worker share: the contract (env names,
budgets, the budget document), model presets and family shapes, the memory model and memory-aware
admission, the UCX rules. Imports no torch, no kopf, no fastapi/uvicorn, nothing of moeguard_runtime
or moeguard_operator (tests/unit/test_import_rules.py)."""
