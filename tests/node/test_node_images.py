"""The structure checks of tests/unit/delivery/test_delivery_images.py, against the built images
(hack/build-images.sh, ``<run dir>/node/images.env``): user, entrypoint, no build tools in the final
stage, the files and their permissions, and what imports as the image's own user."""

from __future__ import annotations

import json
import os
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from hack.stack import RUN_DIR

pytestmark = pytest.mark.node

IMAGES_ENV = RUN_DIR / "node" / "images.env"
BUILD_TOOLS = ("gcc", "cc", "g++", "make", "git")


def images() -> dict[str, str]:
    if not IMAGES_ENV.exists():
        pytest.fail(f"{IMAGES_ENV} is missing: run `make test-node`")
    pairs = (line.split("=", 1) for line in IMAGES_ENV.read_text().splitlines() if "=" in line)
    return {k: v for k, v in pairs}


def buildah(*args: str, timeout: float = 300) -> str:
    out = subprocess.run(["buildah", *args], capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"buildah {' '.join(args)}: {out.stderr}"
    return out.stdout.strip()


@pytest.fixture(scope="module", params=["operator", "worker"])
def image(request: pytest.FixtureRequest) -> Iterator[tuple[str, str, Path]]:
    """(name, ref, mounted root filesystem) of a working container of the image."""
    name = str(request.param)
    ref = images()[name]
    ctr = buildah("from", "--pull=false", ref)
    try:
        yield name, ctr, Path(buildah("mount", ctr))
    finally:
        subprocess.run(["buildah", "rm", ctr], capture_output=True, timeout=120)


def config(ctr: str) -> dict[str, object]:
    return dict(json.loads(buildah("inspect", "--type=container", ctr))["OCIv1"]["config"])


def test_user_and_entrypoint(image: tuple[str, str, Path]) -> None:
    name, ctr, _ = image
    cfg = config(ctr)
    assert cfg["User"] == "65532:65532"
    assert cfg["Entrypoint"] == ["python", "-m", f"moeguard_{'runtime' if name == 'worker' else 'operator'}"]


def test_no_build_tools_or_caches(image: tuple[str, str, Path]) -> None:
    _, _, root = image
    present = [t for t in BUILD_TOOLS if (root / "usr" / "bin" / t).exists()]
    assert not present, f"build tools in the final image: {present}"
    assert not (root / "root" / ".cache" / "pip").exists()
    assert not (root / "src").exists(), "the build stage's work dir leaked into the final image"


def test_app_files_readable_not_writable_by_the_user(image: tuple[str, str, Path]) -> None:
    name, _, root = image
    app = root / "opt" / "app"
    pkgs = {"operator": ["moeguard_operator", "moeguard_runtime"], "worker": ["moeguard_runtime"]}[name]
    for pkg in pkgs:
        files = list((app / pkg).rglob("*.py"))
        assert files, f"{pkg} is missing from /opt/app"
        for f in [*files, app / pkg]:
            st = f.stat()
            assert st.st_mode & stat.S_IROTH, f"{f} is not world-readable (the user is 65532)"
            assert st.st_uid != 65532 and not st.st_mode & stat.S_IWOTH, f"{f} is writable by the user"
    venv_python = root / "opt" / "venv" / "bin" / "python"
    assert os.path.lexists(venv_python)


def test_imports_as_the_image_user(image: tuple[str, str, Path]) -> None:
    name, ctr, _ = image
    code = {"operator": "import moeguard_operator.__main__, sys; assert 'torch' not in sys.modules",
            "worker": "import torch, moeguard_runtime.server; print(torch.__version__)"}[name]
    out = subprocess.run(["buildah", "run", "--network", "none", ctr, "--", "python", "-c", code],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
