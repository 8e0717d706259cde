"""The leak fault's lock file: of several leakers given one file, one leaks at a time."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from moeguard_runtime.faults import FaultLeaker, Faults, load_faults

pytestmark = pytest.mark.unit


def test_no_claim_before_the_file_exists_then_one_owner_writes_its_pid(tmp_path: Path) -> None:
    path = tmp_path / "leak.lock"
    first, second = FaultLeaker(1 << 20, 0, str(path)), FaultLeaker(1 << 20, 0, str(path))
    assert not first.holds_lock() and not second.holds_lock()  # the test has not started the leak
    path.touch()
    assert first.holds_lock()
    assert not second.holds_lock()  # flock conflicts between open file descriptions
    assert first.holds_lock()  # kept
    assert path.read_text() == f"{os.getpid()}\n"


def test_a_freed_lock_is_claimed_by_the_next_leaker_and_a_removed_file_by_none(tmp_path: Path) -> None:
    path = tmp_path / "leak.lock"
    path.touch()
    first, second, third = (FaultLeaker(1 << 20, 0, str(path)) for _ in range(3))
    assert first.holds_lock() and first._lock_fd is not None
    os.close(first._lock_fd)  # the owner died: the kernel drops its lock
    assert second.holds_lock()
    path.unlink()
    assert not third.holds_lock()
    assert FaultLeaker(1 << 20, 0).holds_lock()  # no lock file asked for: always leaks


def test_the_lock_file_is_a_fault_variable_behind_the_switch() -> None:
    assert load_faults({"MOEGUARD_TEST_FAULTS": "1", "MOEGUARD_FAULT_LEAK_ANON_BYTES_PER_SECOND": "5",
                        "MOEGUARD_FAULT_LEAK_LOCK_FILE": "/tmp/x"}) == Faults(5, 0, 0.0, "/tmp/x")
    with pytest.raises(ValueError, match="MOEGUARD_FAULT_LEAK_LOCK_FILE set without MOEGUARD_TEST_FAULTS=1"):
        load_faults({"MOEGUARD_FAULT_LEAK_LOCK_FILE": "/tmp/x"})
