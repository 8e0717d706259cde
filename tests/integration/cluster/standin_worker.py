"""Stand-in for ``python -m moeguard_runtime`` in the harness's own tests (not product).

Serves on 127.0.0.1:$MOEGUARD_PORT:

* ``/healthz``, ``/metrics`` (one gauge), ``/env`` (the MOEGUARD_* and LWS_* variables, KUBECONFIG and
  PYTHONPATH it was given, as JSON), ``/cgroup`` (its ``/proc/self/cgroup``);
* ``/readyz``: 200, or 503 after ``/unready`` (``/ready`` makes it 200 again);
* ``/alloc/<MiB>``: allocates and touches that much memory and keeps it (to be OOM-killed);

Environment: ``STANDIN_EXIT_AFTER_S`` / ``STANDIN_EXIT_CODE``: exit with that code after that many seconds
(a crash loop); ``STANDIN_IGNORE_SIGTERM=1``: SIGTERM is logged and ignored (the grace period must end in
SIGKILL), else logged and the process exits 0; ``STANDIN_STARTS_FILE``: append ``time.time()`` at start.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

READY = threading.Event()
READY.set()
HELD: list[bytearray] = []


class Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        status, body, ctype = 200, b"ok\n", "text/plain"
        if self.path == "/healthz":
            pass
        elif self.path == "/readyz":
            status = 200 if READY.is_set() else 503
        elif self.path in ("/ready", "/unready"):
            (READY.set if self.path == "/ready" else READY.clear)()
        elif self.path.startswith("/alloc/"):
            block = bytearray(int(self.path.rsplit("/", 1)[1]) << 20)
            for i in range(0, len(block), 4096):
                block[i] = 1
            HELD.append(block)
        elif self.path == "/metrics":
            body, ctype = b"# TYPE moeguard_standin_up gauge\nmoeguard_standin_up 1\n", "text/plain; version=0.0.4"
        elif self.path == "/env":
            env = {k: v for k, v in os.environ.items()
                   if k.startswith(("MOEGUARD_", "LWS_")) or k in ("KUBECONFIG", "PYTHONPATH")}
            body, ctype = json.dumps(env).encode(), "application/json"
        elif self.path == "/cgroup":
            body = Path("/proc/self/cgroup").read_bytes()
        else:
            self.send_error(404)
            return
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


def on_sigterm(signum: int, frame: object) -> None:
    print("standin: SIGTERM received", flush=True)
    if os.environ.get("STANDIN_IGNORE_SIGTERM") != "1":
        sys.exit(0)


if __name__ == "__main__":
    if starts := os.environ.get("STANDIN_STARTS_FILE"):
        with open(starts, "a") as f:
            f.write(f"{time.time()}\n")
    signal.signal(signal.SIGTERM, on_sigterm)
    if after := os.environ.get("STANDIN_EXIT_AFTER_S"):
        code = int(os.environ.get("STANDIN_EXIT_CODE", "1"))

        def crash() -> None:
            time.sleep(float(after))
            print(f"standin: exiting {code} on purpose", flush=True)
            os._exit(code)
        threading.Thread(target=crash, daemon=True).start()
    server = ThreadingHTTPServer(("127.0.0.1", int(os.environ["MOEGUARD_PORT"])), Handler)
    try:
        server.serve_forever()
    except SystemExit:
        server.server_close()
