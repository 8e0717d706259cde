"""The worker's side of the UCX judgement (:mod:`moeguard_core.ucx`): read this process's
``/proc/self/maps`` and environment and judge them with the shared, pure rules."""

from __future__ import annotations

import os
from collections.abc import Mapping

from moeguard_core.ucx import UcxInfo, ucx_info


def read_maps(path: str = "/proc/self/maps") -> str:
    """The maps text of this process ("" where there is none: not Linux)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def current_info(env: Mapping[str, str] | None = None) -> UcxInfo:
    """:func:`ucx_info` of this process now (reads ``/proc/self/maps``)."""
    return ucx_info(read_maps(), os.environ if env is None else env)
