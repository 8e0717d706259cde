"""Test-only fault injectors: a leak outside the Python heap, a leak in it, a slow step, a step
whose allocations fail.

They exist so that the leak signal (:mod:`moeguard_runtime.memory.leak`) the queue
timeouts and the out-of-memory path can be tested end to end against a real worker process. Nothing here
runs in production: the fault variables are read only when
``MOEGUARD_TEST_FAULTS=1`` is set, and a fault variable set without it stops the
worker at start (a :class:`ValueError` naming both variables, turned into a
``config_error`` by :func:`config.load_settings`), so a fault can never be
switched on by a stray environment variable alone.

* ``MOEGUARD_FAULT_LEAK_ANON_BYTES_PER_SECOND``: map and touch anonymous memory
  at this rate (outside every Python and malloc counter: the shape of UCX's
  registration-cache leak).
* ``MOEGUARD_FAULT_LEAK_PYTHON_BYTES_PER_SECOND``: keep small Python objects at
  this rate (about 133 bytes of heap each).
* ``MOEGUARD_FAULT_STEP_DELAY_SECONDS``: sleep this long before every engine
  step (a slow model, for timeout tests).
* ``MOEGUARD_FAULT_ALLOC_FAIL_STEPS``: the first N engine steps (probe steps
  included) fail to allocate (:class:`AllocationFault`).
* ``MOEGUARD_FAULT_ALLOC_FAIL_FILE``: every engine step fails to allocate while
  this file exists (the test creates it, and removes it to clear the fault).
* ``MOEGUARD_FAULT_LEAK_LOCK_FILE``: the leaks above run only in the one process
  that holds an exclusive ``flock`` on this file. The file must exist (the test
  creates it when the leak should start); every leak tick a process that does
  not hold it tries once, without waiting, and the winner writes its pid into
  it. Of several workers given the same file, one leaks at a time; when it
  dies the lock is free again. Removing the file stops new claims.
* ``MOEGUARD_FAULT_LOAD_LIBRARY``: a shared library (a path) the worker loads with
  ``ctypes.CDLL`` before it serves, and keeps loaded (:func:`load_library`): a UCX
  library mapped into the process, as NIXL or UCX-enabled torch builds do, for the
  ``moeguard_ucx_info`` signal (issue 14).
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

ENV_TEST_FAULTS = "MOEGUARD_TEST_FAULTS"
"""``1`` enables the fault variables below (test-only)."""
ENV_FAULT_LEAK_ANON = "MOEGUARD_FAULT_LEAK_ANON_BYTES_PER_SECOND"
ENV_FAULT_LEAK_PYTHON = "MOEGUARD_FAULT_LEAK_PYTHON_BYTES_PER_SECOND"
ENV_FAULT_STEP_DELAY = "MOEGUARD_FAULT_STEP_DELAY_SECONDS"
ENV_FAULT_LEAK_LOCK_FILE = "MOEGUARD_FAULT_LEAK_LOCK_FILE"
ENV_FAULT_ALLOC_FAIL_STEPS = "MOEGUARD_FAULT_ALLOC_FAIL_STEPS"
ENV_FAULT_ALLOC_FAIL_FILE = "MOEGUARD_FAULT_ALLOC_FAIL_FILE"
ENV_FAULT_LOAD_LIBRARY = "MOEGUARD_FAULT_LOAD_LIBRARY"
FAULT_VARIABLES = (ENV_FAULT_LEAK_ANON, ENV_FAULT_LEAK_PYTHON, ENV_FAULT_STEP_DELAY, ENV_FAULT_LEAK_LOCK_FILE,
                   ENV_FAULT_ALLOC_FAIL_STEPS, ENV_FAULT_ALLOC_FAIL_FILE, ENV_FAULT_LOAD_LIBRARY)


@dataclass(frozen=True)
class Faults:
    """The faults switched on (all off by default). Rates in bytes per second, delay in seconds."""

    leak_anon_bps: int = 0
    leak_python_bps: int = 0
    step_delay_s: float = 0.0
    leak_lock_file: str = ""
    """Empty: the leaks always run; else only while this process holds the file's lock."""
    alloc_fail_steps: int = 0
    """The first this many engine steps fail to allocate."""
    alloc_fail_file: str = ""
    """Non-empty: every engine step fails to allocate while this file exists."""
    load_library: str = ""
    """Non-empty: the path of a shared library loaded at start (:func:`load_library`)."""

    @property
    def leaks(self) -> bool:
        return self.leak_anon_bps > 0 or self.leak_python_bps > 0


def load_faults(env: Mapping[str, str]) -> Faults:
    """The faults asked for in ``env``.

    Raises:
        ValueError: a fault variable set without ``MOEGUARD_TEST_FAULTS=1``, or a
            value that is not a number >= 0; the message names the variable.
    """
    given = [name for name in FAULT_VARIABLES if env.get(name, "").strip()]
    if env.get(ENV_TEST_FAULTS, "").strip() != "1":
        if given:
            raise ValueError(f"{', '.join(given)} set without {ENV_TEST_FAULTS}=1: the fault "
                             f"injectors are test-only")
        return Faults()

    def number(name: str) -> float:
        raw = env.get(name, "").strip() or "0"
        try:
            value = float(raw)
        except ValueError:
            raise ValueError(f"{name}={raw!r} is not a number") from None
        if value < 0:
            raise ValueError(f"{name}={raw} must be >= 0")
        return value

    return Faults(int(number(ENV_FAULT_LEAK_ANON)), int(number(ENV_FAULT_LEAK_PYTHON)),
                  number(ENV_FAULT_STEP_DELAY), env.get(ENV_FAULT_LEAK_LOCK_FILE, "").strip(),
                  int(number(ENV_FAULT_ALLOC_FAIL_STEPS)), env.get(ENV_FAULT_ALLOC_FAIL_FILE, "").strip(),
                  env.get(ENV_FAULT_LOAD_LIBRARY, "").strip())


_LOADED_LIBRARIES: list[ctypes.CDLL] = []
"""Libraries loaded by :func:`load_library`, referenced for the life of the process (never unloaded)."""


def load_library(faults: Faults) -> ctypes.CDLL | None:
    """The load-library fault: ``dlopen`` ``faults.load_library`` (``ctypes.CDLL``, default flags)
    and keep it loaded for the life of the process. Returns the handle, None when the fault is off.

    Raises:
        OSError: the library cannot be loaded (the loader's message, with the path).
    """
    if not faults.load_library:
        return None
    lib = ctypes.CDLL(faults.load_library)
    _LOADED_LIBRARIES.append(lib)
    return lib


def delay_step(faults: Faults, sleep: Callable[[float], None] = time.sleep) -> None:
    """The slow-step fault: sleep ``faults.step_delay_s`` (nothing when 0)."""
    if faults.step_delay_s > 0:
        sleep(faults.step_delay_s)


IMPOSSIBLE_ALLOCATION_BYTES = 1 << 62
"""What :class:`AllocationFault` asks the allocator for: more than any address space holds, so the
real allocator fails with its real error, at once and without touching memory."""


class AllocationFault:
    """The allocation fault of one worker: :meth:`check` before each engine step's forward pass.

    Not a mock: it asks the step's device allocator for :data:`IMPOSSIBLE_ALLOCATION_BYTES`, so
    the error is the allocator's own (on the CPU a ``RuntimeError`` "DefaultCPUAllocator: can't
    allocate memory", on CUDA ``torch.OutOfMemoryError``). Called by the engine thread only.
    """

    def __init__(self, faults: Faults) -> None:
        self._left = faults.alloc_fail_steps
        self._file = faults.alloc_fail_file

    def check(self, device: torch.device) -> None:
        """Fail this step's allocation when the fault is on (see the module docstring).

        Raises:
            RuntimeError, torch.OutOfMemoryError: the allocator's error.
        """
        if self._left > 0:
            self._left -= 1
        elif not (self._file and os.path.exists(self._file)):
            return
        torch.empty(IMPOSSIBLE_ALLOCATION_BYTES, dtype=torch.uint8, device=device)


class FaultLeaker:
    """Leak memory at a set rate: :meth:`tick` once per :data:`TICK_S`, from a daemon
    thread after :meth:`start`.

    ``anon_bps``: anonymous private mappings, each touched page by page so it
    is resident; they are kept, never unmapped. ``python_bps``: 100-byte
    ``bytes`` objects kept in a list (about 133 bytes of heap each).
    """

    TICK_S = 0.1

    def __init__(self, anon_bps: int, python_bps: int, lock_file: str = "") -> None:
        self.anon_bps, self.python_bps, self.lock_file = anon_bps, python_bps, lock_file
        self._lock_fd: int | None = None
        self._maps: list[mmap.mmap] = []
        self._objects: list[bytes] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fault-leaker", daemon=True)

    @classmethod
    def from_faults(cls, faults: Faults) -> FaultLeaker:
        return cls(faults.leak_anon_bps, faults.leak_python_bps, faults.leak_lock_file)

    @property
    def enabled(self) -> bool:
        return self.anon_bps > 0 or self.python_bps > 0

    def start(self) -> None:
        if self.enabled:
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def tick(self) -> None:
        """Leak one tick's worth: ``anon_bps * TICK_S`` bytes of mappings (whole
        pages) and ``python_bps * TICK_S / 133`` objects."""
        anon_chunk = int(self.anon_bps * self.TICK_S)
        if anon_chunk > 0:
            size = -(-anon_chunk // mmap.PAGESIZE) * mmap.PAGESIZE
            region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            for off in range(0, size, mmap.PAGESIZE):
                region[off] = 1
            self._maps.append(region)
        for i in range(int(self.python_bps * self.TICK_S / 133)):
            self._objects.append(i.to_bytes(8, "little") * 12 + b"leak")

    def holds_lock(self) -> bool:
        """Whether this process may leak: no lock file asked for, or it holds the file's
        ``flock`` (tried once, without waiting, when not held yet; the winner writes its pid)."""
        if not self.lock_file or self._lock_fd is not None:
            return True
        try:
            fd = os.open(self.lock_file, os.O_RDWR)
        except OSError:  # not created yet, or removed: no claim
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # another process leaks
            os.close(fd)
            return False
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._lock_fd = fd
        return True

    def _run(self) -> None:
        while not self._stop.wait(self.TICK_S):
            if self.holds_lock():
                self.tick()
