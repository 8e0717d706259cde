"""Parsing the worker's environment variables: the one error type and the number readers shared by
:mod:`moeguard_runtime.config` (the worker's settings) and :mod:`moeguard_runtime.parallel.ep_config` (the
expert-parallel group), which cannot import each other (config imports the model modules)."""

from __future__ import annotations

from collections.abc import Mapping


class ConfigError(ValueError):
    """A malformed environment variable; the message names it."""


def env_int(env: Mapping[str, str], name: str, default: int | None, minimum: int = 0) -> int | None:
    """``env[name]`` as an integer ≥ ``minimum``; ``default`` when unset or blank.

    Raises:
        ConfigError: not an integer, or below ``minimum``.
    """
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not an integer") from None
    if value < minimum:
        raise ConfigError(f"{name}={value} must be >= {minimum}")
    return value


def env_float(env: Mapping[str, str], name: str, default: float) -> float:
    """``env[name]`` as a float; ``default`` when unset or blank.

    Raises:
        ConfigError: not a number.
    """
    raw = env.get(name, "").strip()
    try:
        return float(raw) if raw else default
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a number") from None
