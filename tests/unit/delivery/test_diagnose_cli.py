"""`moeguard diagnose` as a command: its error paths (one line, exit 1, no traceback), its JSON and text
output and --plot, with the fetch layer replaced by a fake (the real one is exercised in
tests/integration/delivery/test_diagnose_e2e.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from tests.unit.delivery.diagnose_inputs import BURST, EVENTS, NOW, answers, service
from typer.testing import CliRunner

from moeguard_cli import __main__ as cli
from moeguard_cli import diagnose_fetch
from moeguard_cli.diagnose_fetch import (
    DiagnoseError,
    Fetched,
    prometheus_url_for,
    read_range_answer,
)
from moeguard_cli.diagnose_report import RangeAnswer

pytestmark = pytest.mark.unit
runner = CliRunner(env={"COLUMNS": "400"})  # no wrapping inside long tmp paths (pytest-xdist makes them longer)


def fake_fetch(result: Fetched | Exception, calls: list[dict[str, Any]]) -> Any:
    def fetch(name: str, namespace: str | None, **kw: Any) -> Fetched:
        calls.append({"name": name, "namespace": namespace, **kw})
        kw["progress"]("asking")
        if isinstance(result, Exception):
            raise result
        return result
    return fetch


def test_api_server_unreachable_is_one_line_and_exit_1(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[dict[str, Any]] = []
    error = DiagnoseError("cannot reach the API server at https://127.0.0.1:6443 ([Errno 111] Connection refused)")
    monkeypatch.setattr(diagnose_fetch, "fetch", fake_fetch(error, calls))
    res = runner.invoke(cli.app, ["diagnose", "mixtral", "-n", "serving", "--minutes", "5", "--context", "c"])
    assert res.exit_code == 1
    assert res.output.strip() == ("error: cannot reach the API server at https://127.0.0.1:6443 ([Errno 111] "
                                  "Connection refused)")
    assert "Traceback" not in res.output
    assert calls[0]["name"] == "mixtral" and calls[0]["namespace"] == "serving" and calls[0]["minutes"] == 5
    assert calls[0]["context"] == "c" and calls[0]["prometheus_url"] is None


def test_absent_service_is_one_line_and_exit_1(monkeypatch: pytest.MonkeyPatch) -> None:
    error = DiagnoseError("MoEInferenceService serving/nope not found (or the moeguard.dev CRD is not installed) "
                          "at https://k:6443")
    monkeypatch.setattr(diagnose_fetch, "fetch", fake_fetch(error, []))
    res = runner.invoke(cli.app, ["diagnose", "nope", "-n", "serving"])
    assert res.exit_code == 1 and len(res.output.strip().splitlines()) == 1
    assert "serving/nope not found" in res.output


def test_bad_options_are_usage_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(diagnose_fetch, "fetch", fake_fetch(DiagnoseError("unused"), []))
    assert runner.invoke(cli.app, ["diagnose", "m", "--output", "yaml"]).exit_code == 2
    assert runner.invoke(cli.app, ["diagnose", "m", "--minutes", "0"]).exit_code == 2


def fetched(**kw: Any) -> Fetched:
    base: dict[str, Any] = {"service": service(BURST), "events": EVENTS, "answers": answers(),
                            "prometheus_url": "http://prom:9090", "now": NOW}
    return Fetched(**{**base, **kw})


def test_json_output_is_the_whole_report(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(diagnose_fetch, "fetch", fake_fetch(fetched(), []))
    res = runner.invoke(cli.app, ["diagnose", "mixtral", "-n", "serving", "-o", "json", "--prometheus-url", "http://p"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    assert doc["findings"][0]["kind"] == "BurstOverlap"
    assert doc["findings"][0]["patch_command"].startswith("kubectl -n serving patch moeis mixtral --type merge -p '")
    assert doc["timeline"]["missing"] == {"kv_cache_bytes": "no data"}
    assert len(doc["timeline"]["times"]) == 21


def test_prometheus_down_still_prints_what_the_api_server_gave(monkeypatch: pytest.MonkeyPatch,
                                                               tmp_path: Path) -> None:
    down = {key: RangeAnswer(problem="PrometheusUnreachable") for key in answers()}
    monkeypatch.setattr(diagnose_fetch, "fetch", fake_fetch(fetched(answers=down), []))
    png = tmp_path / "t.png"
    res = runner.invoke(cli.app, ["diagnose", "mixtral", "-n", "serving", "--plot", str(png)],
                        env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    assert "BurstOverlap since 13:55:00" in res.output
    assert "kubectl -n serving patch moeis mixtral --type merge -p" in res.output
    assert "memory (memory_bytes): PrometheusUnreachable" in res.output
    assert "refusals/s (refusals_per_second): PrometheusUnreachable" in res.output
    assert f"timeline drawn into {png}" in res.output and png.stat().st_size > 0


def test_plot_into_a_missing_folder_is_one_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(diagnose_fetch, "fetch", fake_fetch(fetched(), []))
    res = runner.invoke(cli.app, ["diagnose", "mixtral", "-o", "json", "--plot", str(tmp_path / "no" / "t.png")])
    assert res.exit_code == 1 and "error: cannot write" in res.output and "Traceback" not in res.output


def test_prometheus_url_order() -> None:
    svc = service(None)
    assert prometheus_url_for(svc, None, {}) == "http://127.0.0.1:9090"
    assert prometheus_url_for(svc, None, {"MOEGUARD_PROMETHEUS_URL": "http://env:9090"}) == "http://env:9090"
    svc["spec"]["control"] = {"prometheusUrl": "http://spec:9090"}
    assert prometheus_url_for(svc, None, {"MOEGUARD_PROMETHEUS_URL": "http://env:9090"}) == "http://spec:9090"
    assert prometheus_url_for(svc, "http://flag:9090", {}) == "http://flag:9090"


def test_range_answer_http_judgement() -> None:
    assert read_range_answer(422, b"{}").problem == "PrometheusBadRequest"
    assert read_range_answer(502, b"<html>bad gateway</html>").problem == "PrometheusHTTPError 502"
    assert read_range_answer(200, b"not json").problem == "PrometheusMalformedAnswer"
    assert read_range_answer(200, b'{"status": "success"}').body == {"status": "success"}


def test_plot_without_matplotlib_is_one_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import sys

    monkeypatch.setattr(diagnose_fetch, "fetch", fake_fetch(fetched(), []))
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    res = runner.invoke(cli.app, ["diagnose", "mixtral", "-o", "json", "--plot", str(tmp_path / "t.png")])
    assert res.exit_code == 1
    assert res.output.rstrip().endswith("error: --plot needs matplotlib (pip install 'moeguard[plot]')")
    assert not (tmp_path / "t.png").exists()
