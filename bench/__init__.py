"""Benchmarks and load generation for moeguard (not part of the installed packages)."""
