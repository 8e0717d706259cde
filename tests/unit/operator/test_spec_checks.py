"""Checks the API server cannot make (they need the model preset), done by the operator."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from moeguard_core.presets import get_preset, shape_problems
from moeguard_operator.spec.models import MoEInferenceServiceSpec
from moeguard_operator.spec.spec_checks import SpecError, check_prometheus_url, parse_spec

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(("spec", "reason", "message"), [
    ({"model": {"preset": "gpt-17"}}, "UnknownModelPreset", "spec.model.preset: unknown model preset 'gpt-17'; known presets:"),
    ({"model": {"overrides": {"dim": 66}}}, "InvalidSpec", "spec.model.overrides: dim (66) must be a multiple of nHead (4)"),
    ({"model": {"overrides": {"nKvHead": 3}}}, "InvalidSpec", "nHead (4) must be a multiple of nKvHead (3)"),
    ({"model": {"overrides": {"dim": 65536, "nLayer": 256, "numExperts": 1024, "intermediateSize": 262144}},
      "resources": {"softLimit": "3Gi", "hardLimit": "4Gi"}},
     "InvalidSpec", "spec.resources.hardLimit (4Gi) is below the model's weights alone"),
    ({"overload": {"maxContextTokens": 4096}}, "InvalidSpec", "spec.overload.maxContextTokens (4096) is above the model's context (1024)"),
])
def test_operator_reports_specs_it_cannot_serve(spec: dict, reason: str, message: str) -> None:
    with pytest.raises(SpecError) as info:
        parse_spec(spec)
    assert info.value.reason == reason and message in str(info.value)


def test_default_spec_is_servable() -> None:
    assert parse_spec({}).model.preset == "tiny"


def test_shape_rules() -> None:
    assert shape_problems(get_preset("tiny")) == []


@pytest.mark.parametrize(("spec", "message"), [
    ({"ucx": {"extraEnv": {"UCX_RCACHE_MAX_UNRELEASED": "inf"}}}, "ucx.extraEnv must not set UCX_RCACHE_MAX_UNRELEASED"),
    ({"template": {"extraEnv": [{"name": "A", "value": "1"}, {"name": "A", "value": "2"}]}}, "names must be unique (repeated: A)"),
    ({"template": {"volumeMounts": [{"name": "tmp", "mountPath": "/t"}, {"name": "nope", "mountPath": "/x"}]}},
     "template.volumeMounts[1].name: nope names no volume of template.volumes"),
    ({"ucx": {"extraEnv": {"UCX_A=B": "1"}}}, "ucx.extraEnv: UCX_A=B is not a variable name"),
    ({"template": {"extraEnv": [{"name": "A=B", "value": "1"}]}}, "template.extraEnv: A=B is not a variable name"),
    ({"image": "repo/img: tag"}, "image: repo/img: tag is not an image reference"),
    ({"resources": {"softLimit": "0"}}, "resources.softLimit must be above 0"),
    ({"resources": {"cpu": "0"}}, "resources.cpu must be above 0"),
    ({"resources": {"hardLimit": "99999Ti", "softLimit": "1Gi"}}, "resources.hardLimit must be below 64Ti"),
    ({"control": {"queryIntervalSeconds": 600, "windowSeconds": 5}}, "control.windowSeconds must be >= control.queryIntervalSeconds"),
])
def test_cross_field_rules(spec: dict, message: str) -> None:
    with pytest.raises(ValidationError) as info:
        MoEInferenceServiceSpec.model_validate(spec)
    assert message in str(info.value)


SECRET_SPEC = {"template": {
    "volumes": [{"name": "models", "persistentVolumeClaim": {"claimName": "m"}}, {"name": "cache", "emptyDir": {}},
                {"name": "hf-token", "secret": {"secretName": "hf"}}],
    "extraEnv": [{"name": "HF_HOME", "value": "/cache"},
                 {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}},
                 {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]}}


def test_secrets_are_refused_unless_the_operator_allows_them_naming_each_field() -> None:
    with pytest.raises(SpecError) as info:
        parse_spec(SECRET_SPEC)
    assert info.value.reason == "SecretsNotAllowed"
    assert str(info.value) == (
        "spec.template.volumes[2] (hf-token): Secret volumes are not allowed by this operator "
        "(chart value operator.allowSecrets); spec.template.extraEnv[1] (HF_TOKEN): valueFrom.secretKeyRef is not "
        "allowed by this operator (chart value operator.allowSecrets)")
    served = parse_spec(SECRET_SPEC, allow_secrets=True)
    assert served.template.volumes[2]["secret"] == {"secretName": "hf"}


def test_specs_without_secrets_are_served_either_way() -> None:
    spec = {"template": {"volumes": SECRET_SPEC["template"]["volumes"][:2],  # type: ignore[index]
                         "extraEnv": [SECRET_SPEC["template"]["extraEnv"][0]]}}  # type: ignore[index]
    assert parse_spec(spec).template.volumes == parse_spec(spec, allow_secrets=True).template.volumes


@pytest.mark.parametrize(("url", "allowed"), [
    (None, ()),
    (None, ("http://prom:9090",)),
    ("http://prom:9090", ("http://prom:9090",)),
    ("http://prom:9090/", ("http://prom:9090",)),
    ("http://prom:9090", ("http://own:9090", "http://prom:9090/")),
])
def test_a_prometheus_url_the_operator_allows_passes(url: str | None, allowed: tuple[str, ...]) -> None:
    spec = parse_spec({"model": {"preset": "tiny"}, "control": {"prometheusUrl": url} if url else {}})
    check_prometheus_url(spec, allowed)


@pytest.mark.parametrize(("url", "allowed"), [
    ("http://169.254.169.254/latest/meta-data", ("http://prom:9090",)),
    ("http://prom:9090.evil.example", ("http://prom:9090",)),
    ("http://prom:9090/other", ("http://prom:9090",)),
    ("https://prom:9090", ("http://prom:9090",)),
    ("http://prom:9090", ()),
])
def test_any_other_prometheus_url_is_stalled_naming_the_field_and_the_setting(
        url: str, allowed: tuple[str, ...]) -> None:
    spec = parse_spec({"model": {"preset": "tiny"}, "control": {"prometheusUrl": url}})
    with pytest.raises(SpecError) as info:
        check_prometheus_url(spec, allowed)
    assert info.value.reason == "PrometheusURLNotAllowed"
    message = str(info.value)
    assert message.startswith("spec.control.prometheusUrl: ")
    assert "operator.prometheus.allowedUrls" in message and "--allowed-prometheus-url" in message
