"""The operator's configuration: one OperatorConfig from the command line, read from kopf's memo."""

from __future__ import annotations

from pathlib import Path

import pytest

from moeguard_operator.__main__ import parse_args
from moeguard_operator.config import MEMO_KEY, OperatorConfig, from_memo
from moeguard_operator.loop.observation import LEAK_WARMUP_SECONDS

pytestmark = pytest.mark.unit


def test_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MOEGUARD_PROMETHEUS_URL", raising=False)
    monkeypatch.delenv("MOEGUARD_TEST_PAUSE_AT", raising=False)
    args, config = parse_args(["-A", "--standalone"])
    assert config == OperatorConfig(prometheus_url=None, timer_interval_seconds=1.0, peering_lifetime_seconds=60,
                                    look_deadline_seconds=10.0, test_pause_at=None)
    assert config.allow_host_path_models is False
    assert config.leak_warmup_seconds == LEAK_WARMUP_SECONDS == 90
    assert args.all_namespaces and args.standalone


def test_the_leak_warm_up_is_a_flag_and_may_not_be_negative(capsys: pytest.CaptureFixture[str]) -> None:
    assert parse_args(["--leak-warmup-seconds", "5"])[1].leak_warmup_seconds == 5.0
    assert parse_args(["--leak-warmup-seconds", "0"])[1].leak_warmup_seconds == 0.0
    with pytest.raises(SystemExit):
        parse_args(["--leak-warmup-seconds", "-1"])
    assert "leak_warmup_seconds must be 0 or above (got -1.0)" in capsys.readouterr().err


def test_flags_set_the_config() -> None:
    _, config = parse_args(["--prometheus-url", "http://prom:9090", "--timer-interval-seconds", "2",
                            "--peering-lifetime-seconds", "6", "--allow-host-path-models"])
    assert config == OperatorConfig(prometheus_url="http://prom:9090", timer_interval_seconds=2.0,
                                    peering_lifetime_seconds=6, allow_host_path_models=True)


def test_the_prometheus_url_flag_defaults_to_its_documented_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOEGUARD_PROMETHEUS_URL", "http://from-env:9090")
    assert parse_args([])[1].prometheus_url == "http://from-env:9090"


@pytest.mark.parametrize("argv", [["--timer-interval-seconds", "0"], ["--peering-lifetime-seconds", "-1"],
                                  ["--look-deadline-seconds", "0"]])
def test_invalid_values_are_refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert "must be above 0" in capsys.readouterr().err


def test_the_test_pause_point_comes_from_its_variable_and_must_be_known(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("MOEGUARD_TEST_PAUSE_AT", "after-configmap")
    assert parse_args([])[1].test_pause_at == "after-configmap"
    monkeypatch.setenv("MOEGUARD_TEST_PAUSE_AT", "after-lunch")
    with pytest.raises(SystemExit):
        parse_args([])
    assert "test pause point must be one of after-configmap, after-status (got 'after-lunch')" in capsys.readouterr().err


def test_from_memo() -> None:
    config = OperatorConfig(timer_interval_seconds=1.0)
    assert from_memo({MEMO_KEY: config}) is config
    with pytest.raises(LookupError, match="register the handlers"):
        from_memo({})


def test_prometheus_security_flags_set_the_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MOEGUARD_PROMETHEUS_URL", raising=False)
    _, config = parse_args(["--prometheus-url", "http://prom:9090", "--prometheus-ca-file", "/etc/ca/ca.crt",
                            "--allowed-prometheus-url", "https://a:9090", "--allowed-prometheus-url", "https://b/"])
    assert config.prometheus_ca_file == "/etc/ca/ca.crt"
    assert config.allowed_prometheus_urls == ("https://a:9090", "https://b/")
    assert config.prometheus_urls == ("http://prom:9090", "https://a:9090", "https://b/")
    _, default = parse_args([])
    assert default.prometheus_ca_file is None and default.prometheus_urls == ()


def test_a_broken_prometheus_ca_file_stops_the_operator_at_start_naming_it(tmp_path: Path) -> None:
    import certifi

    from moeguard_operator.__main__ import check_ca_file, main

    assert check_ca_file(None) is None
    assert check_ca_file(certifi.where()) is None  # a real PEM bundle
    missing = tmp_path / "nope.pem"
    assert check_ca_file(str(missing)) is not None and str(missing) in str(check_ca_file(str(missing)))
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("-----BEGIN CERTIFICATE-----\nnot base64 at all\n-----END CERTIFICATE-----\n")
    problem = check_ca_file(str(garbage))
    assert problem is not None and problem.startswith(f"--prometheus-ca-file {garbage}: ")
    with pytest.raises(SystemExit, match=r"moeguard operator: --prometheus-ca-file .*garbage\.pem"):
        main(["-A", "--standalone", "--prometheus-ca-file", str(garbage)])


def test_the_policy_is_a_flag_predictive_by_default(capsys: pytest.CaptureFixture[str]) -> None:
    assert parse_args([])[1].policy == "predictive"
    assert parse_args(["--policy", "threshold"])[1].policy == "threshold"
    with pytest.raises(SystemExit):
        parse_args(["--policy", "aimd"])
    assert "invalid choice: 'aimd'" in capsys.readouterr().err
