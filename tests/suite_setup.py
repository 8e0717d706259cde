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

import json
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
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


def file_of(nodeid: str) -> str:
    """The file of a test's node id (``tests/x/y.py::test_z`` -> ``tests/x/y.py``)."""
    return nodeid.split("::", 1)[0]


def part_of(nodeid: str) -> str:
    """The part of the suite a test belongs to, for the time-per-part table: ``unit``, ``node``, or
    ``integration/<folder>`` (``worker``, ``cluster``, ``e2e``, ...)."""
    parts = file_of(nodeid).split("/")
    if len(parts) < 3 or parts[0] != "tests":
        return "other"
    if parts[1] == "integration" and len(parts) > 3:
        return f"integration/{parts[2]}"
    return parts[1]


LONGEST_FIRST = ("integration/e2e", "integration/operator", "integration/worker", "integration/delivery",
                 "integration/cluster", "integration/bench", "integration", "node", "unit", "other")
"""The parts in the order the suite runs them when no file's time is known: longest tests first
(docs/testing.md), so that under pytest-xdist no worker is left with one long file at the end while the
others idle; the unit tests (under a second each) fill the gaps last."""

FILE_SECONDS_PATH = Path(__file__).with_name("file_seconds.json")
"""Each integration file's test seconds in a whole ``make test`` run (``pytest --store-file-seconds``):
the suite's order of its integration files (:func:`integration_order`)."""


def load_file_seconds(path: Path = FILE_SECONDS_PATH) -> dict[str, float]:
    """The ``{file: seconds}`` of :data:`FILE_SECONDS_PATH`, empty when the file is missing.

    Raises:
        ValueError: the file is not a JSON object of numbers.
    """
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    if not isinstance(data, dict) or not all(isinstance(v, (int, float)) for v in data.values()):
        raise ValueError(f"{path}: expected a JSON object of file -> seconds")
    return {str(k): float(v) for k, v in data.items()}


CPU_BOUND_PARTS = ("integration/worker",)
"""The parts whose files load the CPUs (worker processes under traffic, expert-parallel groups of 2 and 4 ranks);
the others mostly wait on clocks (query intervals, scrapes, windows, readiness)."""


def estimated_seconds(path: str, file_seconds: Mapping[str, float]) -> float:
    """A file's seconds in ``file_seconds``; a file not in it counts as the mean of its part's known files (0
    when none is known)."""
    if path in file_seconds:
        return file_seconds[path]
    known = [s for f, s in file_seconds.items() if part_of(f) == part_of(path)]
    return sum(known) / len(known) if known else 0.0


def integration_order(paths: Iterable[str], file_seconds: Mapping[str, float]) -> dict[str, int]:
    """The place of each integration file among ``paths`` in the suite's run (0 first).

    Longest first within each of two kinds, the files of :data:`CPU_BOUND_PARTS` and the clock-bound rest,
    merged so that both kinds advance through their total seconds at the same pace: the next file is of the
    kind with the smaller done fraction. Longest first is the LPT schedule (Graham 1969) on xdist's ``loadfile``
    queue (each worker takes the next file when it is free), so no worker ends on a long file; the merge keeps
    about as many CPU-bound files running as the machine has cores. Longest first alone ran three CPU-bound files
    at once in rehearsals V and W (the expert-parallel files at twice their time in U: docs/testing.md)."""
    files = sorted({p for p in paths if part_of(p).startswith("integration")})
    est = {p: estimated_seconds(p, file_seconds) for p in files}
    kinds = [sorted((p for p in files if (part_of(p) in CPU_BOUND_PARTS) == cpu), key=lambda p: (-est[p], p))
             for cpu in (True, False)]
    totals = [sum(est[p] for p in kind) or 1.0 for kind in kinds]
    done = [0.0, 0.0]
    order: list[str] = []
    while kinds[0] or kinds[1]:
        k = 0 if kinds[0] and (not kinds[1] or done[0] / totals[0] <= done[1] / totals[1]) else 1
        path = kinds[k].pop(0)
        done[k] += est[path]
        order.append(path)
    return {p: i for i, p in enumerate(order)}


def run_rank(nodeid: str, order: Mapping[str, int] | None = None) -> tuple[int, int]:
    """The sort key of a test (a stable sort keeps each file's own order): the integration files in ``order``
    (:func:`integration_order`) first, then the node and unit tests. With no order, the parts run in the
    order of :data:`LONGEST_FIRST`; an integration folder not listed there runs with ``integration``, before
    the unit tests."""
    part = part_of(nodeid)
    if part not in LONGEST_FIRST:
        part = "integration" if part.startswith("integration/") else "other"
    rank = LONGEST_FIRST.index(part)
    if not order or not part.startswith("integration"):
        return rank + len(LONGEST_FIRST) * bool(order), 0
    return 0, order.get(file_of(nodeid), len(order))


def file_seconds(durations: Iterable[tuple[str, float]]) -> dict[str, float]:
    """``{file: seconds}`` of the integration files, from ``(nodeid, seconds)`` pairs (one per test phase),
    rounded to 0.1 s and sorted longest first: what ``--store-file-seconds`` writes."""
    total: dict[str, float] = {}
    for nodeid, s in durations:
        if part_of(nodeid).startswith("integration"):
            path = file_of(nodeid)
            total[path] = total.get(path, 0.0) + s
    return {f: round(s, 1) for f, s in sorted(total.items(), key=lambda kv: (-kv[1], kv[0]))}


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
        path = file_of(nodeid)
        old = spans.get(path)
        spans[path] = FileSpan(path, worker, start - origin, stop - origin, stop - start) if old is None else \
            FileSpan(path, old.worker, min(old.start, start - origin), max(old.stop, stop - origin),
                     old.seconds + stop - start)
    return sorted(spans.values(), key=lambda f: (f.start, f.path))
