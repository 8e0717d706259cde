"""moeguard's torch MoE worker.

Importing this package imports no torch: the pure modules (``contract``,
``presets``) are shared with the operator, which must stay light.
"""
