"""The ``stream`` kernel's build with the machine's compiler (``python -m moeguard_runtime.model.stream_kernel``,
run by ``make deps``): a fresh folder gets a library that loads and computes ``F.linear``'s product; a compiler
that fails is a :class:`stream_kernel.BuildError` with its message, and the worker leaves the kernel out."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from harness.stack import ROOT

from moeguard_runtime.model import stream_kernel

pytestmark = pytest.mark.skipif(stream_kernel.compiler() is None, reason="no C++ compiler here")

PROBE = """
import json, torch
import torch.nn.functional as F
from pathlib import Path
from moeguard_runtime.model import kernel_select, stream_kernel
stream_kernel.PREBUILT = Path("/nonexistent/stream_linear.so")  # the build, not a library prebuilt in the tree
why = stream_kernel.unavailable()
out = {"why": why, "files": sorted(p.name for p in stream_kernel.native_dir().iterdir())
       if stream_kernel.native_dir().exists() else [], "candidates": list(kernel_select.candidates(torch.float32))}
if why is None:
    x, w = torch.randn(4, 300), torch.randn(70, 300)
    out["error"] = (stream_kernel.linear(x, w) - F.linear(x, w)).abs().max().item()
print(json.dumps(out))
"""


def _probe(env: dict[str, str]) -> dict[str, object]:
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=180, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": f"{ROOT / 'runtime'}:{ROOT / 'core'}", **env})
    assert done.returncode == 0, done.stderr[-2000:]
    result: dict[str, object] = json.loads(done.stdout.splitlines()[-1])
    return result


def test_a_fresh_folder_gets_a_library_that_computes_the_product(tmp_path: Path) -> None:
    if stream_kernel.unavailable() is not None and "AVX2" in (stream_kernel.unavailable() or ""):
        pytest.skip(stream_kernel.unavailable() or "")
    got = _probe({stream_kernel.ENV_NATIVE_DIR: str(tmp_path)})
    assert got["why"] is None
    files = got["files"]
    assert isinstance(files, list) and len(files) == 1 and str(files[0]).startswith("stream_linear-")
    assert isinstance(got["error"], float) and got["error"] < 1e-3
    assert "stream" in got["candidates"]  # type: ignore[operator]
    again = _probe({stream_kernel.ENV_NATIVE_DIR: str(tmp_path)})  # the second process loads, builds nothing
    assert again["files"] == files


def test_a_failing_compiler_is_reported_and_the_kernel_left_out(tmp_path: Path) -> None:
    cxx = tmp_path / "cxx"
    cxx.write_text("#!/bin/sh\necho 'cc1plus: fatal error: no space left on device' >&2\nexit 4\n")
    cxx.chmod(0o755)
    with pytest.raises(stream_kernel.BuildError, match=r"exited 4: cc1plus: fatal error: no space left on device"):
        stream_kernel.build(str(cxx), tmp_path / "out" / "lib.so")
    assert not list((tmp_path / "out").iterdir())  # no half-written library left behind
    got = _probe({stream_kernel.ENV_NATIVE_DIR: str(tmp_path / "native"), "CXX": str(cxx)})
    assert "exited 4: cc1plus: fatal error" in str(got["why"])
    assert "stream" not in got["candidates"]  # type: ignore[operator]


def test_a_prebuilt_library_loads_only_when_built_from_this_source(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker image's library (``--prebuild`` in its build stage): world-readable for the image user, and
    ignored where the source has changed since (its embedded digest differs)."""
    cxx = stream_kernel.compiler()
    assert cxx is not None
    good = stream_kernel.build(cxx, tmp_path / "good.so")
    assert good.stat().st_mode & 0o444 == 0o444
    monkeypatch.setattr(stream_kernel, "PREBUILT", good)
    lib = stream_kernel._prebuilt()
    assert lib is not None and lib.moeguard_stream_source() == stream_kernel.source_digest().encode()
    stale = tmp_path / "stale.so"
    done = subprocess.run([cxx, *stream_kernel.FLAGS, '-DMOEGUARD_STREAM_SOURCE="0123456789ab"', "-o", str(stale),
                           str(stream_kernel.SOURCE)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    monkeypatch.setattr(stream_kernel, "PREBUILT", stale)
    assert stream_kernel._prebuilt() is None
    monkeypatch.setattr(stream_kernel, "PREBUILT", tmp_path / "missing.so")
    assert stream_kernel._prebuilt() is None


def test_prebuild_writes_into_the_package_and_fails_loudly_without_a_compiler(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'runtime'}:{ROOT / 'core'}", "PATH": str(tmp_path), "CXX": ""}
    done = subprocess.run([sys.executable, "-m", "moeguard_runtime.model.stream_kernel", "--prebuild"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert done.returncode == 1 and "stream kernel: no C++ compiler (g++ or $CXX)" in done.stderr, done.stderr
