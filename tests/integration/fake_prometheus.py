"""The base of the tests' fake Prometheus servers (hostile answers, a hung server)."""
from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
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


def serve(handler: type[BaseHTTPRequestHandler]) -> ThreadingHTTPServer:
    """A threaded HTTP server for ``handler`` on a free loopback port, serving from a daemon thread (stop it
    with ``shutdown()`` and ``server_close()``). Its listen backlog is 128: a look's queries arrive at once,
    and the default backlog of 5 refused some."""

    class Server(ThreadingHTTPServer):
        daemon_threads = True
        request_queue_size = 128

    server = Server(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server
