"""The suite's own set-up rules (applied by tests/conftest.py): pure, so that unit tests can hold them.

* Each pytest-xdist worker its own local cluster. ``make test`` runs the suite under pytest-xdist (``-n``):
  most integration tests wait on clocks (the operator's intervals, Prometheus scrapes, readiness), not on the
  2 CPUs. Worker ``gwN`` (N >= 1) gets its own run dir (``$MOEGUARD_RUN_DIR-gwN``) and port offset
  (``MOEGUARD_PORT_OFFSET`` + 100 N): a control plane, Prometheus and pod-worker harness of its own
  (``hack/cluster-up.sh`` shifts every port by the offset), so no test shares an operator, a CRD or a port
  with a test of another worker. ``gw0`` and a run without xdist use ``$MOEGUARD_RUN_DIR`` itself.
* Every collected test carries one of :data:`SUITE_MARKERS`: ``make test`` selects by marker
  (``-m "unit or integration"``, then ``-m node``), and a test with none of them would be deselected
  without a word (issue 27: the 12 tests of ``tests/unit/operator/test_parallelism.py`` never ran).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import NamedTuple, Protocol

SUITE_MARKERS = ("unit", "integration", "node")
XDIST_PORT_STRIDE = 100
"""Port offset between two xdist workers' clusters (hack/cluster-up.sh's ports span 12379-19444, a few each)."""
APPLIED_ENV = "MOEGUARD_XDIST_CLUSTER"
"""Set once the worker's cluster environment is applied (a second application would shift it again)."""


def worker_cluster_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The ``MOEGUARD_RUN_DIR`` and ``MOEGUARD_PORT_OFFSET`` of this xdist worker (``PYTEST_XDIST_WORKER`` =
    ``gwN``), with :data:`APPLIED_ENV`; empty outside xdist, for ``gw0``, and once applied."""
    match = re.fullmatch(r"gw(\d+)", environ.get("PYTEST_XDIST_WORKER", ""))
    if not match or match.group(1) == "0" or APPLIED_ENV in environ:
        return {}
    n = int(match.group(1))
    base = environ.get("MOEGUARD_RUN_DIR", "/tmp/moeguard-run")
    return {"MOEGUARD_RUN_DIR": f"{base}-gw{n}",
            "MOEGUARD_PORT_OFFSET": str(int(environ.get("MOEGUARD_PORT_OFFSET", "0")) + XDIST_PORT_STRIDE * n),
            APPLIED_ENV: f"gw{n}"}


class _Marked(Protocol):
    nodeid: str

    def get_closest_marker(self, name: str) -> object | None: ...


def unmarked(items: Iterable[_Marked]) -> list[str]:
    """The node ids of ``items`` that carry none of :data:`SUITE_MARKERS`."""
    return [item.nodeid for item in items if not any(item.get_closest_marker(m) for m in SUITE_MARKERS)]


def part_of(nodeid: str) -> str:
    """The part of the suite a test belongs to, for the time-per-part table: ``unit``, ``node``, or
    ``integration/<folder>`` (``worker``, ``cluster``, ``e2e``, ...)."""
    parts = nodeid.split("::", 1)[0].split("/")
    if len(parts) < 3 or parts[0] != "tests":
        return "other"
    if parts[1] == "integration" and len(parts) > 3:
        return f"integration/{parts[2]}"
    return parts[1]


LONGEST_FIRST = ("integration/e2e", "integration/operator", "integration/worker", "integration/delivery",
                 "integration/cluster", "integration/bench", "integration", "node", "unit", "other")
"""The parts in the order the suite runs them: longest tests first (docs/testing.md), so that under
pytest-xdist no worker is left with one long file at the end while the others idle; the unit tests
(under a second each) fill the gaps last."""


def run_rank(nodeid: str) -> int:
    """The sort key of a test: its part's place in :data:`LONGEST_FIRST` (the order within a part is kept); an
    integration folder not listed there runs with ``integration``, before the unit tests."""
    part = part_of(nodeid)
    if part not in LONGEST_FIRST:
        part = "integration" if part.startswith("integration/") else "other"
    return LONGEST_FIRST.index(part)


def time_per_part(durations: Iterable[tuple[str, float]]) -> list[tuple[str, int, float]]:
    """``(part, tests, seconds)`` rows, slowest part first, from ``(nodeid, seconds)`` pairs (a test's setup,
    call and teardown may come as three pairs: tests are counted once, seconds summed)."""
    seen: dict[str, set[str]] = {}
    seconds: dict[str, float] = {}
    for nodeid, s in durations:
        part = part_of(nodeid)
        seen.setdefault(part, set()).add(nodeid)
        seconds[part] = seconds.get(part, 0.0) + s
    return sorted(((p, len(seen[p]), seconds[p]) for p in seen), key=lambda r: -r[2])


class FileSpan(NamedTuple):
    """One test file's run in a session: the xdist worker that ran it (``-`` without xdist), when its first
    test's setup started and its last teardown ended (seconds since the session's first test started), and
    its test seconds (setup + call + teardown, summed)."""
    path: str
    worker: str
    start: float
    stop: float
    seconds: float


def file_spans(phases: Iterable[tuple[str, str, float, float]]) -> list[FileSpan]:
    """The :class:`FileSpan` of each file, in the order the files started, from one ``(nodeid, worker, start,
    stop)`` per test phase (epoch seconds): where the wall time of an xdist session went (docs/testing.md)."""
    rows = list(phases)
    if not rows:
        return []
    origin = min(start for _, _, start, _ in rows)
    spans: dict[str, FileSpan] = {}
    for nodeid, worker, start, stop in rows:
        path = nodeid.split("::", 1)[0]
        old = spans.get(path)
        spans[path] = FileSpan(path, worker, start - origin, stop - origin, stop - start) if old is None else \
            FileSpan(path, old.worker, min(old.start, start - origin), max(old.stop, stop - origin),
                     old.seconds + stop - start)
    return sorted(spans.values(), key=lambda f: (f.start, f.path))
