"""spec.model.source, servedModelName and weightBytes: the spec models, the worker Deployment they build,
the weights-vs-hardLimit check, and the hostPath gate."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from pydantic import ValidationError

from moeguard_operator.children.builders import Owner, build_deployment, dropped_volumes
from moeguard_operator.spec.models import MoEInferenceServiceSpec
from moeguard_operator.spec.spec_checks import (
    SpecError,
    check_model_source,
    parse_spec,
    weight_bytes,
)

pytestmark = pytest.mark.unit

OWNER = Owner(name="qwen3", namespace="serving", uid="1234-abcd")
PVC = {"persistentVolumeClaim": {"claimName": "qwen3-30b-a3b"}, "subPath": "Qwen3-30B-A3B"}
BIG = {"resources": {"gpus": 1, "softLimit": "60Gi", "hardLimit": "72Gi"}}


def _pod(model: dict[str, Any], **spec: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    parsed = MoEInferenceServiceSpec.model_validate({"model": model, **spec})
    pod = build_deployment(OWNER, parsed)["spec"]["template"]["spec"]
    return pod, pod["containers"][0]


def _env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "<from>") for e in container["env"]}


def test_a_pvc_source_is_mounted_read_only_and_the_worker_reads_its_sub_path() -> None:
    pod, container = _pod({"source": PVC, "servedModelName": "Qwen/Qwen3-30B-A3B"})
    assert pod["volumes"][:2] == [
        {"name": "tmp", "emptyDir": {"sizeLimit": "1Gi"}},
        {"name": "moeguard-model", "persistentVolumeClaim": {"claimName": "qwen3-30b-a3b", "readOnly": True}},
    ]
    assert container["volumeMounts"] == [
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "moeguard-model", "mountPath": "/moeguard/model", "readOnly": True},
    ]
    env = _env(container)
    assert env["MOEGUARD_CHECKPOINT_PATH"] == "/moeguard/model/Qwen3-30B-A3B"
    assert env["MOEGUARD_SERVED_MODEL_NAME"] == "Qwen/Qwen3-30B-A3B"


def test_image_and_host_path_sources() -> None:
    pod, container = _pod({"source": {"image": {"reference": "registry.example.com/models/mixtral:8x7b",
                                                "pullPolicy": "Always"}}})
    assert pod["volumes"][1] == {"name": "moeguard-model", "image": {
        "reference": "registry.example.com/models/mixtral:8x7b", "pullPolicy": "Always"}}
    assert _env(container)["MOEGUARD_CHECKPOINT_PATH"] == "/moeguard/model"
    assert "MOEGUARD_SERVED_MODEL_NAME" not in _env(container)  # unset: the worker's default
    pod, _ = _pod({"source": {"hostPath": {"path": "/srv/models/mixtral"}}})
    assert pod["volumes"][1] == {"name": "moeguard-model", "hostPath": {"path": "/srv/models/mixtral",
                                                                        "type": "Directory"}}


def test_without_a_source_nothing_is_mounted_and_checkpoint_path_is_kept() -> None:
    pod, container = _pod({"checkpointPath": "/weights/model.safetensors"})
    assert [v["name"] for v in pod["volumes"]] == ["tmp"]
    assert _env(container)["MOEGUARD_CHECKPOINT_PATH"] == "/weights/model.safetensors"
    _, container = _pod({})
    assert "MOEGUARD_CHECKPOINT_PATH" not in _env(container)


def test_start_up_failures_reach_the_termination_message() -> None:
    _, container = _pod({})
    assert container["terminationMessagePath"] == "/dev/termination-log"
    assert container["terminationMessagePolicy"] == "FallbackToLogsOnError"


@pytest.mark.parametrize(("model", "message"), [
    ({"source": {}}, "model.source must set exactly one of persistentVolumeClaim, hostPath, image"),
    ({"source": {"persistentVolumeClaim": {"claimName": "a"}, "image": {"reference": "r:1"}}},
     "model.source must set exactly one of"),
    ({"source": PVC, "checkpointPath": "/x"}, "model.source and model.checkpointPath are exclusive"),
    ({"source": {**PVC, "subPath": "../etc"}}, "subPath"),
    ({"source": {**PVC, "subPath": "/abs"}}, "subPath"),
    ({"source": {**PVC, "subPath": "a/../../b"}}, "subPath"),
    ({"source": {"hostPath": {"path": "/"}}}, "hostPath.path"),
    ({"source": {"hostPath": {"path": "relative"}}}, "hostPath.path"),
    ({"source": {"persistentVolumeClaim": {"claimName": "Bad_Name"}}}, "claimName"),
    ({"servedModelName": "has space"}, "servedModelName"),
    ({"weightBytes": "lots"}, "weightBytes"),
])
def test_bad_sources_are_refused_naming_the_field(model: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError) as info:
        MoEInferenceServiceSpec.model_validate({"model": model})
    assert message in str(info.value)


def test_weights_check_uses_the_hint_then_the_preset_and_nothing_for_a_source() -> None:
    hinted = MoEInferenceServiceSpec.model_validate({"model": {"source": PVC, "weightBytes": "57Gi"}, **BIG})
    assert weight_bytes(hinted, 10**9) == (57 * 2**30, "spec.model.weightBytes")
    source = MoEInferenceServiceSpec.model_validate({"model": {"source": PVC}, **BIG})
    assert weight_bytes(source, 10**9) is None
    preset = MoEInferenceServiceSpec.model_validate({})
    assert weight_bytes(preset, 1000) == (2000, "the preset at 2 bytes per parameter")


def test_a_hint_above_hard_limit_is_refused_and_a_source_without_one_passes() -> None:
    with pytest.raises(SpecError) as info:
        parse_spec({"model": {"source": PVC, "weightBytes": "90Gi"}, **BIG})
    assert info.value.reason == "InvalidSpec"
    assert str(info.value) == ("spec.resources.hardLimit (72Gi) is below the model's weights alone "
                               "(90.00 GiB, spec.model.weightBytes)")
    assert parse_spec({"model": {"source": PVC}, **BIG}).model.source is not None
    # the context cap is the checkpoint's config.json's business, not the preset's (1024 for tiny)
    assert parse_spec({"model": {"source": PVC}, "overload": {"maxContextTokens": 32768}, **BIG})


def test_host_path_only_where_the_operator_allows_it() -> None:
    spec = parse_spec({"model": {"source": {"hostPath": {"path": "/srv/models/q"}}}})
    with pytest.raises(SpecError) as info:
        check_model_source(spec, allow_host_path=False)
    assert info.value.reason == "HostPathNotAllowed"
    assert "spec.model.source.hostPath (/srv/models/q)" in str(info.value)
    assert "--allow-host-path-models" in str(info.value)
    check_model_source(spec, allow_host_path=True)
    check_model_source(parse_spec({"model": {"source": PVC}}), allow_host_path=False)


def test_volumes_the_api_server_dropped_are_named() -> None:
    parsed = MoEInferenceServiceSpec.model_validate({"model": {"source": {"image": {"reference": "r.example/m:1"}}}})
    sent = build_deployment(OWNER, parsed)
    stored = copy.deepcopy(sent)
    assert dropped_volumes(sent, stored) == []
    stored["spec"]["template"]["spec"]["volumes"] = [{"name": "tmp", "emptyDir": {"sizeLimit": "1Gi"}}]
    assert dropped_volumes(sent, stored) == ["moeguard-model"]
