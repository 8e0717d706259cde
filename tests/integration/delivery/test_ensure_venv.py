"""hack/ensure-venv.sh on a copied checkout and a temporary cache: the keyed venv linked, the
one in use marked, and only venvs unused for longer than MOEGUARD_VENV_KEEP_DAYS removed.

The venv of the copied requirements is pre-made (``.complete``), so nothing is installed."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from harness.stack import ROOT

pytestmark = pytest.mark.integration
DAY = 86400


def venv_key() -> str:
    """The script's key for this checkout's requirements.txt and python3."""
    out = subprocess.run(
        ["bash", "-c", "(cat requirements.txt; python3 --version) | sha256sum | cut -c1-16"],
        cwd=ROOT, capture_output=True, text=True, check=True)
    return out.stdout.strip()


def test_links_the_keyed_venv_and_removes_only_long_unused_ones(tmp_path: Path) -> None:
    checkout, cache = tmp_path / "checkout", tmp_path / "cache"
    (checkout / "hack").mkdir(parents=True)
    shutil.copy(ROOT / "hack" / "ensure-venv.sh", checkout / "hack")
    shutil.copy(ROOT / "requirements.txt", checkout)
    venvs = cache / "venvs"
    current = venvs / venv_key()
    current.mkdir(parents=True)
    (current / ".complete").touch()
    now = time.time()

    def venv(name: str, age_days: float, marker: bool) -> Path:
        d = venvs / name
        d.mkdir()
        t = d / ".last-used" if marker else d
        t.touch()
        os.utime(t, (now - age_days * DAY, now - age_days * DAY))
        return d

    stale, stale_old_style = venv("stale", 20, True), venv("stale-old-style", 20, False)
    recent, recent_old_style = venv("recent", 3, True), venv("recent-old-style", 3, False)
    touched_old_folder = venv("old-folder-recent-use", 3, True)
    os.utime(touched_old_folder, (now - 30 * DAY, now - 30 * DAY))

    out = subprocess.run(["bash", str(checkout / "hack" / "ensure-venv.sh")], capture_output=True,
                         text=True, timeout=60, env={**os.environ, "MOEGUARD_CACHE": str(cache)})
    assert out.returncode == 0, out.stderr
    assert (checkout / ".venv").resolve() == current.resolve()
    assert (current / ".last-used").stat().st_mtime >= now - 5
    assert sorted(p.name for p in venvs.iterdir()) == sorted(
        p.name for p in (current, recent, recent_old_style, touched_old_folder))
    assert not stale.exists() and not stale_old_style.exists()
    assert out.stderr.count("unused for more than 14 days") == 2

    # A shorter keep: the 3-day-old ones go too, the one in use never.
    out = subprocess.run(["bash", str(checkout / "hack" / "ensure-venv.sh")], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "MOEGUARD_CACHE": str(cache), "MOEGUARD_VENV_KEEP_DAYS": "1"})
    assert out.returncode == 0, out.stderr
    assert [p.name for p in venvs.iterdir()] == [current.name]
