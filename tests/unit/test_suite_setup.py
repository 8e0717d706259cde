"""The suite's own set-up (tests/suite_setup.py): per-xdist-worker clusters and the marker check."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from tests.suite_setup import (
    APPLIED_ENV,
    LONGEST_FIRST,
    SUITE_MARKERS,
    FileSpan,
    estimated_seconds,
    file_of,
    file_seconds,
    file_spans,
    integration_order,
    load_file_seconds,
    part_of,
    run_rank,
    time_per_part,
    unmarked,
    worker_cluster_env,
)


def test_each_xdist_worker_but_the_first_gets_its_own_run_dir_and_ports() -> None:
    assert worker_cluster_env({}) == {}
    assert worker_cluster_env({"PYTEST_XDIST_WORKER": "gw0", "MOEGUARD_RUN_DIR": "/tmp/ci"}) == {}
    assert worker_cluster_env({"PYTEST_XDIST_WORKER": "gw1", "MOEGUARD_RUN_DIR": "/tmp/ci"}) == {
        "MOEGUARD_RUN_DIR": "/tmp/ci-gw1", "MOEGUARD_PORT_OFFSET": "100", APPLIED_ENV: "gw1"}
    env = {"PYTEST_XDIST_WORKER": "gw3", "MOEGUARD_PORT_OFFSET": "7"}
    env |= worker_cluster_env(env)
    assert env["MOEGUARD_RUN_DIR"] == "/tmp/moeguard-run-gw3" and env["MOEGUARD_PORT_OFFSET"] == "307"
    assert worker_cluster_env(env) == {}  # applied once: a second import of the conftest shifts nothing
    assert worker_cluster_env({"PYTEST_XDIST_WORKER": "master"}) == {}


class _Item:
    def __init__(self, nodeid: str, *markers: str) -> None:
        self.nodeid, self._markers = nodeid, markers

    def get_closest_marker(self, name: str) -> Any:
        return SimpleNamespace(name=name) if name in self._markers else None


def test_a_test_with_none_of_the_suite_markers_is_named() -> None:
    items = [_Item("a::t1", "unit"), _Item("b::t2"), _Item("c::t3", "integration", "slow"), _Item("d::t4", "node"),
             _Item("e::t5", "asyncio")]
    assert unmarked(items) == ["b::t2", "e::t5"]
    assert SUITE_MARKERS == ("unit", "integration", "node")


def test_this_module_is_marked_unit_by_its_folder(request: pytest.FixtureRequest) -> None:
    assert request.node.get_closest_marker("unit") is not None


def test_time_per_part_counts_each_test_once_and_sums_its_phases() -> None:
    assert part_of("tests/unit/operator/test_x.py::test_a") == "unit"
    assert part_of("tests/integration/e2e/test_y.py::test_b[1]") == "integration/e2e"
    assert part_of("tests/integration/test_z.py::t") == "integration"
    assert part_of("tests/node/test_node_worker.py::t") == "node"
    assert part_of("elsewhere.py::t") == "other"
    rows = time_per_part([("tests/unit/a.py::t", 0.5), ("tests/unit/a.py::t", 1.5), ("tests/unit/b.py::u", 1.0),
                          ("tests/integration/e2e/c.py::v", 10.0)])
    assert rows == [("integration/e2e", 1, 10.0), ("unit", 2, 3.0)]


def test_the_longest_parts_run_first_and_every_part_has_a_place() -> None:
    ids = ["tests/unit/a.py::t", "tests/integration/cluster/b.py::t", "tests/integration/e2e/c.py::t",
           "tests/integration/worker/d.py::t", "tests/integration/newpart/e.py::t", "x.py::t"]
    assert sorted(ids, key=run_rank) == ["tests/integration/e2e/c.py::t", "tests/integration/worker/d.py::t",
                                         "tests/integration/cluster/b.py::t", "tests/integration/newpart/e.py::t",
                                         "tests/unit/a.py::t", "x.py::t"]
    assert len(set(LONGEST_FIRST)) == len(LONGEST_FIRST)


def test_file_spans_merge_each_files_phases_and_order_the_files_by_start() -> None:
    spans = file_spans([("tests/a.py::t", "gw0", 100.0, 101.0), ("tests/b.py::u", "gw1", 100.5, 110.5),
                        ("tests/a.py::t", "gw0", 101.0, 104.0), ("tests/a.py::v", "gw0", 120.0, 121.0)])
    assert spans == [FileSpan("tests/a.py", "gw0", 0.0, 21.0, 5.0), FileSpan("tests/b.py", "gw1", 0.5, 10.5, 10.0)]
    assert file_spans([]) == []


def test_known_file_times_run_each_kind_longest_first_merged_at_one_pace_and_the_unit_tests_last() -> None:
    known = {"tests/integration/worker/d.py": 300.0, "tests/integration/worker/g.py": 100.0,
             "tests/integration/e2e/c.py": 100.0, "tests/integration/e2e/f.py": 200.0,
             "tests/integration/cluster/b.py": 100.0}
    ids = ["tests/unit/a.py::t", "tests/integration/cluster/b.py::t", "tests/integration/e2e/c.py::t",
           "tests/integration/e2e/c.py::u", "tests/integration/worker/d.py::t", "tests/integration/e2e/new.py::t",
           "tests/node/n.py::t", "tests/integration/e2e/f.py::t", "tests/integration/worker/g.py::t"]
    order = integration_order((file_of(i) for i in ids), known)
    # CPU-bound (worker) d 300, g 100: 400 s; clock-bound f 200, new 150 (the mean of the known e2e files),
    # b 100, c 100: 550 s. Each pick goes to the kind with the smaller done fraction (ties: CPU-bound).
    assert sorted(order, key=order.__getitem__) == [
        "tests/integration/worker/d.py", "tests/integration/e2e/f.py", "tests/integration/e2e/new.py",
        "tests/integration/cluster/b.py", "tests/integration/worker/g.py", "tests/integration/e2e/c.py"]
    assert sorted(ids, key=lambda i: run_rank(i, order)) == [
        "tests/integration/worker/d.py::t", "tests/integration/e2e/f.py::t", "tests/integration/e2e/new.py::t",
        "tests/integration/cluster/b.py::t", "tests/integration/worker/g.py::t", "tests/integration/e2e/c.py::t",
        "tests/integration/e2e/c.py::u", "tests/node/n.py::t", "tests/unit/a.py::t"]
    assert estimated_seconds("tests/integration/delivery/x.py", known) == 0.0  # no file of its part known


def test_file_seconds_sums_each_integration_files_phases_longest_first() -> None:
    assert file_seconds([("tests/integration/e2e/a.py::t", 1.25), ("tests/integration/e2e/a.py::t", 2.0),
                         ("tests/integration/worker/b.py::u", 9.0), ("tests/unit/c.py::v", 50.0)]) == {
        "tests/integration/worker/b.py": 9.0, "tests/integration/e2e/a.py": 3.2}


def test_file_times_load_from_json_and_a_missing_file_is_no_times(tmp_path: Path) -> None:
    path = tmp_path / "file_seconds.json"
    assert load_file_seconds(path) == {}
    path.write_text('{"tests/integration/e2e/a.py": 12.5}')
    assert load_file_seconds(path) == {"tests/integration/e2e/a.py": 12.5}
    path.write_text('{"tests/integration/e2e/a.py": "slow"}')
    with pytest.raises(ValueError, match="file -> seconds"):
        load_file_seconds(path)
