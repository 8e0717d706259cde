"""The load runner's URL guard: loopback only, refused before anything is sent."""

from __future__ import annotations

import pytest
from harness.loadgen.client import burst, check_loopback_url, check_urls, replay
from harness.loadgen.trace import ScheduledRequest

pytestmark = pytest.mark.unit


# --- URL guard -------------------------------------------------------------------
@pytest.mark.parametrize("url", [
    "http://10.0.0.1:8000", "http://example.com", "https://example.com/v1",
    "http://127.0.0.1@example.com:8000", "http://[::2]:8000", "http://0.0.0.0:8000",
    "ftp://127.0.0.1", "http://localhost.example.com", "http://128.0.0.1",
    "http://[::ffff:127.0.0.1]:8000", "not a url",
])
def test_url_guard_refuses_non_loopback(url: str) -> None:
    with pytest.raises(ValueError):
        check_loopback_url(url)


@pytest.mark.parametrize("url", [
    "http://127.0.0.1:8000", "http://127.1.2.3:9", "http://localhost:8000/",
    "http://LOCALHOST", "http://[::1]:8000", "https://127.0.0.1",
])
def test_url_guard_accepts_loopback(url: str) -> None:
    assert check_loopback_url(url) == url.rstrip("/")


async def test_replay_and_burst_refuse_before_sending() -> None:
    with pytest.raises(ValueError, match="loopback"):
        await replay("http://10.0.0.1:8000", [ScheduledRequest(0, 0.0, 5, 5, 5, 5)])
    with pytest.raises(ValueError, match="loopback"):
        await burst(["http://127.0.0.1:1", "http://example.com"], ["hi"])
    with pytest.raises(ValueError):
        check_urls([])
