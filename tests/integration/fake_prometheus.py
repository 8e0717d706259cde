"""The base of the tests' fake Prometheus servers (hostile answers, a hung server)."""
from __future__ import annotations

from http.server import BaseHTTPRequestHandler
from typing import Any


class FakePrometheusHandler(BaseHTTPRequestHandler):
    """Quiet, and answers a form-encoded POST as the GET of its path: the operator sends its queries as POSTs
    (``observe._fetch``: a grouped query for ~200 services passes httpx's 64 KiB URL bound). Subclasses
    override ``do_GET``."""

    def log_message(self, *_: Any) -> None:
        pass

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.do_GET()

    def do_GET(self) -> None:
        self.send_error(501, "the fake defines no answer")
