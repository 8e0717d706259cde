"""Unit tests start no process, no thread and never sleep (pyproject: "unit: pure logic"): each is
refused here, so a test that needs one fails and is re-marked ``integration``."""

from __future__ import annotations

import subprocess
import threading
import time
from typing import Any

import pytest
import torch  # noqa: F401 - imported before any guard: its first import runs ldconfig (cuda.pathfinder's find_library)


@pytest.fixture(autouse=True)
def _pure(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    if request.node.get_closest_marker("unit") is None:
        return

    def refuse(what: str) -> Any:
        def fail(*a: Any, **k: Any) -> Any:
            raise AssertionError(f"a unit test must not {what}: mark it integration or make it pure")
        return fail

    monkeypatch.setattr(time, "sleep", refuse("sleep"))
    monkeypatch.setattr(threading.Thread, "start", refuse("start a thread"))
    monkeypatch.setattr(subprocess.Popen, "__init__", refuse("start a process"))
    real_wait = threading.Condition.wait

    def wait(self: threading.Condition, timeout: float | None = None) -> bool:
        if timeout is None or timeout > 0:
            raise AssertionError("a unit test must not block on a condition")
        return real_wait(self, timeout)

    monkeypatch.setattr(threading.Condition, "wait", wait)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test under tests/unit/ is a unit test (a module's own ``pytestmark`` is then redundant)."""
    from pathlib import Path

    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.path)).parents:
            item.add_marker(pytest.mark.unit)
