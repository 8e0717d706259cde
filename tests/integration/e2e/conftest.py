"""Fixtures of the end-to-end tests."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from harness import stack
from tests.integration.conftest import Cluster
from tests.integration.e2e.helpers import OPERATOR_LIVENESS_PORT, OPERATOR_METRICS_PORT, wait

STARTUP_DEADLINE_SECONDS = 120
"""Generous: the wait ends as soon as the operator answers."""


@pytest.fixture(scope="module")
def operator(cluster: Cluster, request: pytest.FixtureRequest) -> Iterator[None]:
    """The operator for a test module; the module's ``OPERATOR_EXTRA_ARGS`` (a tuple of flags, e.g. a shorter
    ``--leak-warmup-seconds``) are added to its command line."""
    stack.apply_crds(run_dir=cluster.run_dir)
    log = cluster.run_dir / "logs" / "operator-e2e.log"
    liveness = f"http://127.0.0.1:{OPERATOR_LIVENESS_PORT}/healthz"
    extra = tuple(getattr(request.module, "OPERATOR_EXTRA_ARGS", ()))
    proc = stack.start_operator(log, run_dir=cluster.run_dir, args=(
        "-A", "--standalone", "--metrics-port", str(OPERATOR_METRICS_PORT), "--liveness", liveness, *extra))

    def started() -> bool:
        assert proc.poll() is None, f"operator exited: see {log}"
        try:  # kopf serves its liveness endpoint once the startup handlers have run
            return httpx.get(liveness, timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait(started, STARTUP_DEADLINE_SECONDS, "the operator's liveness endpoint")
        yield
    finally:
        stack.stop_process(proc)
