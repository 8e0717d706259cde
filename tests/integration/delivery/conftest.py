"""Fixtures for the delivery tests: the pinned helm and kubectl against the local control plane."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from harness.stack import ROOT, run_tool

CHART = ROOT / "charts" / "moeguard"
KUBE_VERSION = "1.34.4"
"""Passed to `helm template`: this helm is built from Go modules and its compiled-in default is v1.20."""

Run = Callable[..., subprocess.CompletedProcess[str]]


def _runner(tool: str, run_dir: Path) -> Run:
    """``tool`` through harness.stack.run_tool (raises harness.stack.ToolError with its stderr when ``check``)."""
    def run(*args: str, check: bool = True, input: str | None = None, timeout: float = 180) -> subprocess.CompletedProcess[str]:
        return run_tool(tool, *args, check=check, stdin=input, timeout=timeout, run_dir=run_dir)
    return run


@pytest.fixture(scope="session")
def helm_bin() -> Run:
    """helm without a cluster (lint, template): the kubeconfig path need not exist."""
    from harness.stack import RUN_DIR
    run = _runner("helm", RUN_DIR)
    if run("version", "--short", check=False).returncode != 0:
        pytest.skip("the pinned helm is missing: run hack/build-binaries.sh")
    return run


@pytest.fixture(scope="session")
def helm(cluster: object, helm_bin: Run) -> Run:
    """helm against the local control plane."""
    return _runner("helm", cluster.run_dir)  # type: ignore[attr-defined]


Template = Callable[..., str]


@pytest.fixture(scope="session")
def template(helm_bin: Run) -> Template:
    """`helm template` of the chart: ``template(*sets, release=, namespace=, extra=())`` → YAML text."""
    def render(*sets: str, release: str = "mg", namespace: str = "default", extra: tuple[str, ...] = ()) -> str:
        args = ["template", release, str(CHART), "--namespace", namespace, "--kube-version", KUBE_VERSION, *extra]
        for s in sets:
            args += ["--set", s]
        return helm_bin(*args).stdout
    return render
