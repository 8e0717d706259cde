"""One headline policy's worker process, confined like a pod's container and restarted like one.

The worker (``python -m moeguard_runtime``, the ``small`` preset) runs in its own cgroup-v1 memory
cgroup whose ``memory.limit_in_bytes`` is the pod's memory limit (= hardLimit): an over-limit
worker is really OOM-killed by the kernel. It starts in a private mount namespace where its cgroup
directory is bind-mounted over ``/sys/fs/cgroup/memory``, as a container sees it, so the worker's
own memory guard reads the cgroup the kernel enforces (its working set: ``memory.usage_in_bytes`` minus
inactive file pages).
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.worker_process import ROOT, stop_process, wait_ready

from bench.headline_policies import HARD_LIMIT, PRESET

CGROUP_BASE = Path("/sys/fs/cgroup/memory")


def cgroups_writable() -> bool:
    probe = CGROUP_BASE / f"moeguard-bench-probe-{os.getpid()}"
    try:
        probe.mkdir()
        probe.rmdir()
        return True
    except OSError:
        return False


def status_bytes(pid: int, key: str) -> int | None:
    """A ``kB`` field of ``/proc/<pid>/status`` (e.g. ``VmRSS``) in bytes, or None."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


@dataclass
class Worker:
    """One policy's worker process, restarted like a pod's container after an OOM kill."""

    name: str
    env: dict[str, str]
    port: int
    use_cgroup: bool
    log_path: Path
    cgroup: Path | None = None
    proc: subprocess.Popen[bytes] | None = None
    events: list[dict[str, Any]] = field(default_factory=list)
    t0: float = 0.0

    def start(self) -> None:
        env = {**os.environ, **self.env, "MOEGUARD_PORT": str(self.port), "MOEGUARD_MODEL_PRESET": PRESET,
               "MOEGUARD_TORCH_THREADS": "1", "PYTHONPATH": f"{ROOT / 'runtime'}{os.pathsep}{ROOT / 'core'}"}
        cmd = [sys.executable, "-m", "moeguard_runtime"]
        if self.use_cgroup:
            if self.cgroup is None:
                self.cgroup = CGROUP_BASE / f"moeguard-bench-{self.name}-{os.getpid()}"
                self.cgroup.mkdir(exist_ok=True)
                (self.cgroup / "memory.limit_in_bytes").write_text(str(HARD_LIMIT))
                with contextlib.suppress(OSError):  # no swap accounting on some kernels
                    (self.cgroup / "memory.memsw.limit_in_bytes").write_text(str(HARD_LIMIT))
            script = ('echo $$ > "$1/cgroup.procs" && exec unshare --mount --propagation private '
                      'sh -c \'mount --bind "$0" /sys/fs/cgroup/memory && shift && exec "$@"\' "$@"')
            cmd = ["sh", "-c", script, "_", str(self.cgroup), str(self.cgroup), *cmd]
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                         start_new_session=True)
        self.events.append({"t": time.monotonic() - self.t0, "event": "start", "pid": self.proc.pid})

    def ready(self, timeout: float = 60.0) -> bool:
        return self.proc is not None and wait_ready(f"http://127.0.0.1:{self.port}", self.proc, timeout) is None

    def pid(self) -> int | None:
        """The live python process (the launcher execs into it, so the Popen pid is the worker)."""
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else None

    def cgroup_value(self, name: str) -> int | None:
        """A cgroup counter (``memory.usage_in_bytes``, ``memory.failcnt``...), None without cgroup."""
        return int((self.cgroup / name).read_text()) if self.cgroup is not None else None

    def oom_kills(self) -> int:
        if self.cgroup is None:
            return 0
        text = (self.cgroup / "memory.oom_control").read_text()
        m = re.search(r"oom_kill (\d+)", text)
        return int(m.group(1)) if m else 0

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc, group=True)

    def remove_cgroup(self) -> None:
        if self.cgroup is not None and self.cgroup.exists():
            for _ in range(50):
                try:
                    self.cgroup.rmdir()
                    return
                except OSError:
                    time.sleep(0.1)
