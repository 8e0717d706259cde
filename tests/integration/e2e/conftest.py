"""Fixtures of the end-to-end tests."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from hack import stack
from tests.integration.conftest import Cluster
from tests.integration.e2e.helpers import OPERATOR_METRICS_PORT


@pytest.fixture(scope="module")
def operator(cluster: Cluster) -> Iterator[None]:
    stack.apply_crds(run_dir=cluster.run_dir)
    proc = stack.start_operator(cluster.run_dir / "logs" / "operator-e2e.log", run_dir=cluster.run_dir,
                                args=("-A", "--standalone", "--metrics-port", str(OPERATOR_METRICS_PORT)))
    time.sleep(1)
    assert proc.poll() is None, f"operator exited: see {cluster.run_dir}/logs/operator-e2e.log"
    yield
    stack.stop_process(proc)
