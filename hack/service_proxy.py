"""Test/demo harness, not product: a loopback stand-in for a ClusterIP Service (kube-proxy's part), for the
pods :mod:`hack.pod_workers` runs as processes.

A :class:`ServiceProxy` listens on a free loopback port and forwards each TCP connection to one of the ports
its ``backends`` callback names at that moment (round robin): the local ports of the running pods that the
Service's selector matches. No backend: the connection is closed at once, as a Service with no ready endpoint
refuses it. A pod whose env names a Service URL (a decode pod's ``MOEGUARD_PREFILL_URL``) gets the proxy's
address instead, which stays valid while the pods behind it restart or are replaced.
"""

from __future__ import annotations

import contextlib
import itertools
import socket
import threading
from collections.abc import Callable

CHUNK = 1 << 16


class ServiceProxy:
    """Forwards ``127.0.0.1:<port>`` to the ports ``backends()`` returns; threads are daemons."""

    def __init__(self, name: str, backends: Callable[[], list[int]], log: Callable[[str], None]) -> None:
        self.name, self._backends, self._log = name, backends, log
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self.port = int(self._sock.getsockname()[1])
        self._turn = itertools.count()
        threading.Thread(target=self._accept, name=f"service {name}", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._forward, args=(client,), daemon=True).start()

    def _forward(self, client: socket.socket) -> None:
        ports = self._backends()
        if not ports:
            client.close()
            return
        port = ports[next(self._turn) % len(ports)]
        try:
            upstream = socket.create_connection(("127.0.0.1", port), timeout=5)
        except OSError as exc:
            self._log(f"service {self.name}: backend 127.0.0.1:{port} refused ({exc})")
            client.close()
            return
        upstream.settimeout(None)
        threading.Thread(target=_pipe, args=(upstream, client), daemon=True).start()
        _pipe(client, upstream)

    def close(self) -> None:
        self._sock.close()


def _pipe(src: socket.socket, dst: socket.socket) -> None:
    """Copy ``src`` to ``dst`` until either side closes; then close both."""
    try:
        while data := src.recv(CHUNK):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()
