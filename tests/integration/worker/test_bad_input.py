"""Every bad input gets a 4xx in OpenAI's error shape, with a message naming the
field, the limit and the given value; the worker neither crashes nor keeps memory."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tests.integration.worker.conftest import WorkerProcess
from tests.integration.worker.test_worker_http import assert_openai_error, metrics, post

pytestmark = pytest.mark.integration


def rss(w: WorkerProcess) -> float:
    return next(v for _, v in metrics(w)["moeguard_process_resident_memory_bytes"])


@pytest.mark.parametrize(("body", "status", "needles", "param"), [
    ('{"prompt": "x", ', 400, ["request body is not valid JSON: Expecting"], None),
    ({"prompt": 5}, 400, ["invalid field 'prompt': Value error, Input should be a string, a list "
                          "of strings, a list of token ids or a list of token-id lists", "given: 5"],
     "prompt"),
    ({"prompt": "x", "max_tokens": "5"}, 400,
     ["invalid field 'max_tokens': Value error, Input should be a JSON number, not str",
      'given: "5"'], "max_tokens"),
    ({"prompt": "x", "max_tokens": 2.5}, 400,
     ["invalid field 'max_tokens': Input should be a valid integer, got a number with a "
      "fractional part", "given: 2.5"], "max_tokens"),
    ({"prompt": "x", "max_tokens": True}, 400, ["not bool", "given: true"], "max_tokens"),
    ({"prompt": "x", "stream": "yes"}, 400, ["invalid field 'stream'"], "stream"),
    ({"prompt": "x", "max_tokens": 0}, 400,
     ["invalid field 'max_tokens'", "limit: ge 1", "given: 0"], "max_tokens"),
    ({"prompt": "x", "max_tokens": -3}, 400, ["limit: ge 1", "given: -3"], "max_tokens"),
    ({"prompt": "x", "max_tokens": 10**12}, 400,
     ["limit: le 1048576", "given: 1000000000000"], "max_tokens"),
    ({"prompt": "x", "max_tokens": 1023}, 400,
     ["inputs tokens + max_new_tokens must be <= 1024. Given: 2 inputs tokens and 1023"], "prompt"),
    ({"prompt": ""}, 400, ["the prompt must not be empty"], "prompt"),
    ({"prompt": "x" * 1008, "max_tokens": 16}, 400,  # 1009 + 16 = 1025: one token over
     ["must be <= 1024. Given: 1009 inputs tokens and 16 max_new_tokens"], "prompt"),
    ({"prompt": "x", "frobnicate": True}, 400, ["unknown field 'frobnicate' (given: true)"],
     "frobnicate"),
    ({"prompt": "x", "temperature": -0.5}, 400,
     ["invalid field 'temperature'", "limit: ge 0.0", "given: -0.5"], "temperature"),
    ({"prompt": "x", "n": 2}, 400, ["limit: le 1", "given: 2"], "n"),
    ({"prompt": "x", "priority": "urgent"}, 400, ["invalid field 'priority'", '"urgent"'],
     "priority"),
    ({"prompt": "x", "priority": 2**63}, 400, ["invalid field 'priority'", "an integer as vLLM's priority"],
     "priority"),
    ({"prompt": "x", "priority": 1.5}, 400, ["invalid field 'priority'", "given: 1.5"], "priority"),
    ("[1, 2]", 400, ["request body must be a JSON object, given a list"], None),
    ('{"prompt": "hi", "x": ' + "[" * 50_000 + "]" * 50_000 + "}", 400,
     ["request body is not valid JSON for this API: nested too deeply"], None),
])
def test_bad_body_is_a_4xx_naming_field_limit_and_value(
        worker: WorkerProcess, body: object, status: int, needles: list[str],
        param: str | None) -> None:
    err = assert_openai_error(post(worker, body), status, *needles)
    assert err["type"] == "invalid_request_error" and err["param"] == param


def test_one_token_over_context_is_refused_and_exactly_at_it_is_served(
        worker: WorkerProcess) -> None:
    r = post(worker, {"prompt": "x" * 1007, "max_tokens": 16, "temperature": 0})  # 1008 + 16
    assert r.status_code == 200, r.text
    err = assert_openai_error(post(worker, {"prompt": "x" * 1008, "max_tokens": 16}), 400)
    assert err["code"] == "context_length_exceeded"


def test_bytes_that_are_not_utf8(worker: WorkerProcess) -> None:
    r = post(worker, b'{"prompt": "caf\xe9"}')
    assert_openai_error(r, 400, "request body is not valid UTF-8: invalid continuation byte at byte 15")


def test_bad_priority_header(worker: WorkerProcess) -> None:
    r = httpx.post(f"{worker.base_url}/v1/completions", json={"prompt": "x", "max_tokens": 1},
                   headers={"X-Priority": "now"})
    assert_openai_error(r, 400, "invalid header 'X-Priority': must be interactive or batch; a criticality "
                                "(Critical, Standard, Sheddable); or an integer as vLLM's priority",
                        "given: 'now'")
    r = httpx.post(f"{worker.base_url}/v1/completions", json={"prompt": "x", "max_tokens": 1},
                   headers={"X-Priority": "batch"}, timeout=30)
    assert r.status_code == 200


def test_ten_megabyte_bodies_are_413_and_leave_no_memory_behind(worker: WorkerProcess) -> None:
    big = json.dumps({"prompt": "x" * (10 << 20)})
    post(worker, big)  # warm-up
    before = rss(worker)
    for _ in range(10):
        r = post(worker, big)
        err = assert_openai_error(r, 413, "request body is larger than 1048576 bytes")
        assert err["code"] == "body_too_large"
    # the same without a content-length (chunked): read no further than the limit
    r = httpx.post(f"{worker.base_url}/v1/completions",
                   content=iter([big[i:i + 65536].encode() for i in range(0, len(big), 65536)]),
                   headers={"content-type": "application/json"}, timeout=60)
    assert_openai_error(r, 413, "larger than 1048576 bytes")
    growth = rss(worker) - before
    assert growth < 8e6, f"RSS grew by {growth / 1e6:.1f} MB over 11 refused 10 MB bodies"
    assert httpx.get(f"{worker.base_url}/healthz").status_code == 200
    assert post(worker, {"prompt": "still up", "max_tokens": 2}).status_code == 200
    invalid = [v for lab, v in metrics(worker)["moeguard_rejections_total"]
               if lab["reason"] == "invalid_request"]
    assert invalid and invalid[0] >= 11


@pytest.mark.parametrize(("method", "path", "status", "needle"), [
    ("GET", "/v1/completions", 405, "GET /v1/completions: Method Not Allowed"),
    ("POST", "/v1/chat/nothing", 404, "POST /v1/chat/nothing: Not Found"),
])
def test_wrong_method_or_path_is_an_openai_error(worker: WorkerProcess, method: str, path: str, status: int,
                                                 needle: str) -> None:
    r = httpx.request(method, f"{worker.base_url}{path}", timeout=10)
    assert r.status_code == status
    err = r.json()["error"]
    assert needle in err["message"] and set(err) == {"message", "type", "param", "code"}


BIG = "9" * 4301  # one digit over Python's integer-string conversion limit
"""A bare integer json.loads cannot convert (it raised a ValueError that became a 500 text/plain)."""


@pytest.mark.parametrize(("body", "needle"), [
    ('{"prompt": "x", "max_tokens": ' + BIG + "}", "an integer has more than 4300 digits"),
    ('{"prompt": "x", "seed": ' + BIG + "}", "an integer has more than 4300 digits"),
    ('{"prompt": [' + BIG + "]}", "an integer has more than 4300 digits"),
    ('{"prompt": "x", "temperature": NaN}', "NaN is not a JSON number"),
    ('{"prompt": "x", "temperature": Infinity}', "Infinity is not a JSON number"),
    ('{"prompt": "x", "seed": -Infinity}', "-Infinity is not a JSON number"),
    ('{"prompt": "x", "max_tokens": 1e999}', "the number 1e999 is out of range"),
    ('{"prompt": [1, 2, -1e400]}', "the number -1e400 is out of range"),
])
def test_numbers_json_cannot_hold_are_a_400(worker: WorkerProcess, body: str, needle: str) -> None:
    err = assert_openai_error(post(worker, body), 400, "request body is not valid JSON for this API",
                              needle)
    assert err["type"] == "invalid_request_error"


@pytest.mark.parametrize(("field", "value", "needles"), [
    ("max_tokens", "9" * 4300, ["invalid field 'max_tokens'", "limit: le 1048576"]),
    ("seed", "9" * 4300, ["invalid field 'seed'", "limit: le 9007199254740991"]),
    ("temperature", "9" * 4300, ["invalid field 'temperature'"]),
    ("seed", "1e300", ["invalid field 'seed'"]),
    ("max_tokens", "-1e300", ["invalid field 'max_tokens'"]),
])
def test_numbers_out_of_range_name_the_field(worker: WorkerProcess, field: str, value: str,
                                             needles: list[str]) -> None:
    err = assert_openai_error(post(worker, f'{{"prompt": "x", "{field}": {value}}}'), 400, *needles)
    assert err["param"] == field


def test_a_4300_digit_token_id_is_named_short(worker: WorkerProcess) -> None:
    err = assert_openai_error(post(worker, '{"prompt": [' + "9" * 4300 + "]}"), 400,
                              "token id 99999999999999999999...(4300 digits) is outside the vocabulary")
    assert len(str(err["message"])) < 300


_NUMBERS = st.one_of(
    st.integers(min_value=4200, max_value=4400).map(lambda n: "9" * n),
    st.integers().map(str),
    st.floats(allow_nan=False, allow_infinity=False).map(repr),
    st.sampled_from(["NaN", "Infinity", "-Infinity", "1e999", "-1e999", "1e-999", "0.0", "-0",
                     "5e0", "1.0", "2.5", "1e308", "1.8e308"]),
)


@given(prompt=st.one_of(_NUMBERS.map(lambda n: f"[{n}]"), st.just('"hi"')),
       max_tokens=_NUMBERS, seed=st.one_of(_NUMBERS, st.just("null")), temperature=_NUMBERS)
@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
def test_any_number_anywhere_is_a_200_or_a_400_in_openai_shape(
        worker: WorkerProcess, prompt: str, max_tokens: str, seed: str, temperature: str) -> None:
    body = (f'{{"prompt": {prompt}, "max_tokens": {max_tokens}, "seed": {seed}, '
            f'"temperature": {temperature}}}')
    r = post(worker, body)
    assert r.status_code in (200, 400), (body[:200], r.status_code, r.text[:300])
    if r.status_code == 400:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert err["type"] == "invalid_request_error"
