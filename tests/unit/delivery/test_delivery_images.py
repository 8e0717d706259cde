"""images/*.Dockerfile: structure checks (no container engine here: the images are not built; hadolint
runs in tests/integration/delivery/test_delivery_hadolint.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[3]
IMAGES = ROOT / "images"
DOCKERFILES = sorted(IMAGES.glob("*.Dockerfile"))
BUILD_TOOLS = re.compile(r"\b(apt-get|apk|gcc|g\+\+|make|build-essential|pip install|git)\b")


def _stages(path: Path) -> list[list[str]]:
    stages: list[list[str]] = []
    for line in path.read_text().replace("\\\n", " ").splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.upper().startswith("FROM "):
            stages.append([])
        if stages:
            stages[-1].append(line)
    return stages


def test_both_images_exist() -> None:
    assert [p.name for p in DOCKERFILES] == ["operator.Dockerfile", "worker.Dockerfile"]


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_multi_stage_non_root_pinned(path: Path) -> None:
    text = path.read_text()
    stages = _stages(path)
    assert len(stages) >= 2, "multi-stage"
    base = re.search(r"^ARG PYTHON_IMAGE=(\S+)$", text, re.M)
    assert base and re.fullmatch(r"python:\d+\.\d+\.\d+-slim-\w+(@sha256:[0-9a-f]{64})?", base.group(1)), \
        "base pinned to an exact version tag (or digest)"
    final = stages[-1]
    users = [line for line in final if line.upper().startswith("USER ")]
    assert users and users[-1].split()[1].split(":")[0] not in ("0", "root"), "final stage runs as non-root"
    assert not [line for line in final if line.upper().startswith("RUN ") and BUILD_TOOLS.search(line)], \
        "no build tools or package installs in the final stage"
    assert any("COPY --from=build" in line for line in final)


def test_worker_has_cpu_and_cuda_variants() -> None:
    text = (IMAGES / "worker.Dockerfile").read_text()
    assert 'if [ "$VARIANT" = "cpu" ]' in text and 'elif [ "$VARIANT" = "cuda" ]' in text


def test_both_images_copy_the_core_package_whole_and_the_operator_image_nothing_of_the_worker() -> None:
    """The operator imports of the worker only the torch-free layer moeguard_core (the import rules,
    tests/unit/test_import_rules.py); its image copies that package whole, and so does the worker's."""
    text = (IMAGES / "operator.Dockerfile").read_text()
    assert "COPY core/moeguard_core/ /opt/app/moeguard_core/" in text
    assert "runtime/moeguard_runtime" not in text
    assert "COPY core/moeguard_core/ /opt/app/moeguard_core/" in (IMAGES / "worker.Dockerfile").read_text()
    # that the package pulls no torch (and nothing of the worker) into the operator image is the import rule
    # tests/unit/test_import_rules.py::test_core_imports_no_torch_kopf_server_or_worker


def test_chart_and_crd_reference_images_by_repository_and_tag() -> None:
    values = yaml.safe_load((ROOT / "charts" / "moeguard" / "values.yaml").read_text())
    assert values["image"]["repository"] == "ghcr.io/moeguard/operator"
    from moeguard_operator.spec.models import DEFAULT_IMAGE
    repo, tag = DEFAULT_IMAGE.rsplit(":", 1)
    assert repo == "ghcr.io/moeguard/worker" and tag.endswith(("-cpu", "-cuda"))
