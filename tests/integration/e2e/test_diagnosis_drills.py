"""Issue 14: an incident drill per finding kind, injected into a running service with traffic; the right
finding must appear in ``status.diagnosis`` within 2 minutes of the onset and no other finding may appear.

The shortened version of ``bench/diagnosis.py`` (``make bench-diagnosis``, three drills per kind and a calm
trace run): one drill per kind, all six at once, each in its own namespace (:func:`bench.diagnosis_drills.run_round`).
Running them together loads the machine more than one at a time would, so the times here are upper bounds.
Marked ``alone``: ``make test`` runs it after the xdist part, with no other cluster beside it. Beside two other
xdist workers' e2e tests (the load average past 11) the memory-gated findings came late or not at all and a
leak read as BurstOverlap (CI of stops 38 and 39), which says the machine was three times oversubscribed, not
that a rule was wrong; alone, as ``make bench-diagnosis`` runs them, 18 of 18 drills passed.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from bench import diagnosis_drills as drills
from tests.integration.conftest import Cluster, PodWorkers

DRILL_LEAK_WARMUP_SECONDS = 30
"""The operator's ``--leak-warmup-seconds`` here, and the drills' warm-up with it (:func:`bench.diagnosis_drills.warmup_seconds`):
160 s of traffic before each onset with the default 90, 100 s with 30. Under traffic a worker's RSS climbs fast only
in its first seconds (``observation.LEAK_WARMUP_SECONDS``); ``make bench-diagnosis`` keeps the default."""
OPERATOR_EXTRA_ARGS = ("--leak-warmup-seconds", str(DRILL_LEAK_WARMUP_SECONDS))


def operator_log_of(cluster: Cluster, namespace: str, lines: int = 40) -> str:
    """The last ``lines`` lines of the e2e operator's log that name ``namespace`` (the evidence of a failed drill:
    the run dir and its logs go with the cluster at the end of the session)."""
    log = cluster.run_dir / "logs" / "operator-e2e.log"
    try:
        mine = [line[:400] for line in log.read_text(errors="replace").splitlines() if namespace in line]
    except OSError as exc:
        return f"    (no operator log: {exc})"
    return "\n".join(f"    {line}" for line in mine[-lines:]) or "    (no line names it)"


@pytest.mark.alone
@pytest.mark.skipif(drills.ucx_library() is None, reason="libucx0 is not installed (hack/install-deps.sh installs it)")
def test_each_drill_gets_its_finding_within_two_minutes_and_no_other(
        cluster: Cluster, operator: None, pod_workers: PodWorkers, tmp_path: Path) -> None:
    prefix = f"mg-drill-{uuid.uuid4().hex[:6]}"
    results = drills.run_round(drills.KINDS, prefix, grace_s=10.0, scratch=tmp_path,
                               leak_warmup_s=DRILL_LEAK_WARMUP_SECONDS)
    table = "\n".join(f"{r.kind:18} onset->finding {r.seconds_to_finding} s, wrong {r.wrong}, error {r.error}, "
                      f"seen {r.seen}" + ("" if r.passed else f"\n  last status: {r.last_status}"
                                          f"\n  operator log:\n{operator_log_of(cluster, r.namespace)}")
                      for r in results)
    print(f"\n{table}")
    for r in results:
        assert r.error is None, table
        assert r.seconds_to_finding is not None and r.seconds_to_finding <= drills.DEADLINE_S, table
        assert r.wrong == [], table
        finding = r.finding or {}
        assert finding.get("kind") == r.kind and finding.get("remedy") and finding.get("evidence"), finding
        assert all(isinstance(e.get("value"), (int, float)) for e in finding["evidence"]), finding
