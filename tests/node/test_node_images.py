"""The structure checks of tests/unit/delivery/test_delivery_images.py, against the built images
(hack/build-images.sh, ``<run dir>/node/images.env``): user, entrypoint, no build tools in the final
stage, the files and their permissions, and what imports as the image's own user; and that loading
into the node's containerd leaves no untagged image behind."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness.stack import RUN_DIR

pytestmark = pytest.mark.node

IMAGES_ENV = RUN_DIR / "node" / "images.env"
NODE_ENV = RUN_DIR / "node" / "node.env"
ROOT = Path(__file__).resolve().parents[2]
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
    pkgs = {"operator": ["moeguard_operator", "moeguard_core"], "worker": ["moeguard_runtime", "moeguard_core"]}[name]
    if name == "operator":  # the operator imports of the worker only the torch-free moeguard_core (import rules)
        assert not (app / "moeguard_runtime").exists(), "the worker's package is in the operator image"
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
            "worker": "import torch, moeguard_runtime.api.server; print(torch.__version__)"}[name]
    out = subprocess.run(["buildah", "run", "--network", "none", ctr, "--", "python", "-c", code],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]


def test_the_worker_image_carries_its_stream_kernel_built_from_its_source() -> None:
    """Built in the build stage (``--prebuild``): the final image has no compiler, yet on this AVX2 node the
    worker's few-row kernel loads from the package, as the image user, with no network."""
    ctr = buildah("from", "--pull=false", images()["worker"])
    try:
        code = ("import shutil; from moeguard_runtime.model import stream_kernel as s; "
                "print(s.unavailable(), s.PREBUILT.exists(), shutil.which('g++'), s.compiler())")
        out = subprocess.run(["buildah", "run", "--network", "none", ctr, "--", "python", "-c", code],
                             capture_output=True, text=True, timeout=300)
    finally:
        subprocess.run(["buildah", "rm", ctr], capture_output=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["None", "True", "None", "None"], out.stdout


# --- loading into the node's containerd -----------------------------------------------------------
def containerd_address() -> str:
    if not NODE_ENV.exists():
        pytest.fail(f"{NODE_ENV} is missing: run `make test-node`")
    pairs = (line.split("=", 1) for line in NODE_ENV.read_text().splitlines() if "=" in line)
    return {k: v for k, v in pairs}["CONTAINERD_ADDRESS"]


def ctr(*args: str) -> str:
    out = subprocess.run(["ctr", "--address", containerd_address(), "-n", "k8s.io", *args],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"ctr {' '.join(args)}: {out.stderr}"
    return out.stdout


def containerd_images() -> dict[str, str]:
    """name -> manifest digest of every image name in the node's k8s.io namespace."""
    rows = [line.split() for line in ctr("images", "ls").splitlines()[1:]]
    return {row[0]: row[2] for row in rows if len(row) > 2}


def build_images(*args: str) -> dict[str, str]:
    out = subprocess.run([str(ROOT / "hack" / "build-images.sh"), *args], capture_output=True, text=True,
                         timeout=600, env={**os.environ, "CONTAINERD_ADDRESS": containerd_address()})
    assert out.returncode == 0, out.stderr[-3000:]
    return dict(line.split("=", 1) for line in out.stdout.splitlines() if "=" in line)


def test_load_drops_image_ids_no_tag_points_to(tmp_path: Path) -> None:
    """The CRI plugin names each image by its id (``sha256:<config digest>``) as well; when the
    tag went and that name stayed, the old image's layers (~6 GB for a worker) stayed with it:
    37 GB of one machine's store were such images before build-images.sh --load dropped them."""
    pause = build_images("pause")["pause"]
    tag = f"localhost/moeguard/orphan-test:{uuid.uuid4().hex[:12]}"
    work = buildah("from", "--pull=false", pause)
    try:
        buildah("config", "--label", f"moeguard.dev/test={tag}", work)  # a new config: a new id
        buildah("commit", "-q", work, tag)
    finally:
        subprocess.run(["buildah", "rm", work], capture_output=True, timeout=120)
    image_id = "sha256:" + buildah("inspect", "--type", "image", "--format", "{{.FromImageID}}", tag)
    try:
        archive = tmp_path / "image.tar"
        buildah("push", "-q", "--disable-compression", tag, f"oci-archive:{archive}:{tag}")
        ctr("images", "import", str(archive))
        ctr("images", "tag", "--force", tag, image_id)  # the name the CRI plugin gives it
        digest = containerd_images()[tag]
        ctr("images", "rm", tag)
        assert containerd_images().get(image_id) == digest  # untagged, still holding its layers

        build_images("--load", "pause")
        after = containerd_images()
        assert image_id not in after and digest not in after.values()
        kept = [pause, *images().values()]  # the images in use are not touched
        assert [after.get(ref) is not None for ref in kept] == [True] * len(kept), sorted(after)
    finally:
        subprocess.run(["buildah", "rmi", tag], capture_output=True, timeout=120)
        for name in set(containerd_images()) & {tag, image_id}:
            ctr("images", "rm", name)
