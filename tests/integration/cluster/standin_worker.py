"""Stand-in for ``python -m moeguard_runtime`` in the harness's own tests (not product).

Serves on 127.0.0.1:$MOEGUARD_PORT: ``/healthz``, ``/metrics`` (one gauge) and
``/env`` (the MOEGUARD_* variables, KUBECONFIG and PYTHONPATH it was given, as JSON).
"""

from __future__ import annotations

import json
import os
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if self.path == "/healthz":
            body, ctype = b"ok\n", "text/plain"
        elif self.path == "/metrics":
            body, ctype = b"# TYPE moeguard_standin_up gauge\nmoeguard_standin_up 1\n", "text/plain; version=0.0.4"
        elif self.path == "/env":
            env = {k: v for k, v in os.environ.items()
                   if k.startswith("MOEGUARD_") or k in ("KUBECONFIG", "PYTHONPATH")}
            body, ctype = json.dumps(env).encode(), "application/json"
        else:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


if __name__ == "__main__":
    ThreadingHTTPServer(("127.0.0.1", int(os.environ["MOEGUARD_PORT"])), Handler).serve_forever()
