from __future__ import annotations

import pytest
from pydantic import ValidationError

from moeguard_operator.spec.models import MoEInferenceServiceSpec

pytestmark = pytest.mark.unit


def test_defaults_are_complete() -> None:
    spec = MoEInferenceServiceSpec.model_validate({})
    assert spec.model.preset == "tiny"
    assert spec.resources.soft_limit_bytes == 6 * 2**30
    assert spec.resources.hard_limit_bytes == 8 * 2**30
    assert spec.batching.floors.max_prefill_tokens == 256
    assert spec.ucx.mode is None and spec.ucx.rcache_max_unreleased == 1024
    assert spec.overload.mode == "Auto" and spec.control.leak_action == "Warn"


def test_soft_limit_must_be_below_hard_limit() -> None:
    with pytest.raises(ValidationError, match=r"resources.softLimit \(8Gi\) must be less than resources.hardLimit \(8192Mi\)"):
        MoEInferenceServiceSpec.model_validate({"resources": {"softLimit": "8Gi", "hardLimit": "8192Mi"}})


def test_negative_budget_names_the_field() -> None:
    with pytest.raises(ValidationError) as info:
        MoEInferenceServiceSpec.model_validate({"batching": {"maxPrefillTokens": -1}})
    err = info.value.errors()[0]
    assert err["loc"] == ("batching", "maxPrefillTokens")
    assert "greater than or equal to 1" in err["msg"]


def test_floor_above_initial_is_rejected() -> None:
    with pytest.raises(ValidationError, match=r"floors\.maxPrefillTokens must be <= batching\.maxPrefillTokens"):
        MoEInferenceServiceSpec.model_validate({"batching": {"maxPrefillTokens": 128, "floors": {"maxPrefillTokens": 256}}})


def test_unknown_field_is_rejected() -> None:
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        MoEInferenceServiceSpec.model_validate({"replica": 3})


def test_ceiling_below_initial_is_rejected() -> None:
    with pytest.raises(ValidationError, match=r"batching\.maxDecodeTokens must be <= batching\.ceilings\.maxDecodeTokens"):
        MoEInferenceServiceSpec.model_validate({"batching": {"maxDecodeTokens": 256, "ceilings": {"maxDecodeTokens": 128}}})


def test_reserved_env_names_are_rejected() -> None:
    with pytest.raises(ValidationError, match=r"ucx.extraEnv keys must start with UCX_ \(got LD_PRELOAD\)"):
        MoEInferenceServiceSpec.model_validate({"ucx": {"extraEnv": {"LD_PRELOAD": "x"}}})
    with pytest.raises(ValidationError, match=r"must not set MOEGUARD_\* or UCX_\* \(got MOEGUARD_PORT\)"):
        MoEInferenceServiceSpec.model_validate({"template": {"extraEnv": [{"name": "MOEGUARD_PORT", "value": "1"}]}})


def test_decrease_factor_must_be_below_one() -> None:
    with pytest.raises(ValidationError) as info:
        MoEInferenceServiceSpec.model_validate({"control": {"decreaseFactor": 1.0}})
    assert info.value.errors()[0]["loc"] == ("control", "decreaseFactor")


@pytest.mark.parametrize("horizon", [0, 59, 604_801])
def test_a_leak_horizon_outside_a_minute_to_a_week_is_refused_naming_the_field(horizon: int) -> None:
    with pytest.raises(ValidationError, match=r"control\.leakHorizonSeconds|leak_horizon_seconds"):
        MoEInferenceServiceSpec.model_validate({"control": {"leakHorizonSeconds": horizon}})
