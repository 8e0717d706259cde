"""One run of the UCX leak trial (issue 33 §3): two NIXL agents, in two processes, move KV-sized blocks
over NIXL's UCX backend as a disaggregated prefill/decode pair would, and both processes' RSS is sampled.

``python -m bench.ucx_leak_trial --transfers 1000 --mib 4`` prints one JSON object. It needs a NIXL build
on ``sys.path`` (:mod:`bench.ucx_leak` installs one and runs this with the UCX settings under trial in
the environment); the UCX variables are read by UCX when the agent is created, so they must be set
before this process starts.

The pattern (the one vLLM issue 24264 reports leaking with NIXL's UCX):

* the decode process registers one receive buffer at start (as a KV cache is registered once) and
  sends its agent metadata to the prefill process over a pipe;
* the prefill process, for each transfer: maps a fresh anonymous block of ``--mib`` MiB (a staging
  buffer at a new address), fills it, registers it, ``WRITE``s it into the decode buffer, waits for
  ``DONE``, deregisters it and unmaps it; then allocates and frees a tensor of the same size (the
  activations a step frees: one more ``munmap`` for UCX's memory hooks to see);
* both sample their RSS (bytes, ``psutil``) every ``--every`` transfers; the slope is the least-squares
  fit (:func:`moeguard_runtime.memory.leak.slope`) over the second half, MiB per minute.

Each process also reports ``moeguard_ucx_info``'s labels as the worker would compute them
(:func:`moeguard_runtime.memory.ucx_scan.current_info`) and :func:`moeguard_core.ucx.risky`.
"""

from __future__ import annotations

import argparse
import json
import mmap
import multiprocessing as mp
import re
import time
from multiprocessing.connection import Connection
from typing import Any

import psutil
import torch

from moeguard_core.ucx import risky
from moeguard_runtime.disagg.nixl_kv import load_api
from moeguard_runtime.memory.leak import slope
from moeguard_runtime.memory.ucx_scan import current_info

MiB = 2**20
MAPPING = re.compile(r"^[0-9a-f]+-[0-9a-f]+ ")
"""The first line of a mapping's entry in ``/proc/<pid>/smaps`` (``start-end perms offset dev inode [path]``)."""


def agent(name: str) -> Any:
    """A NIXL agent of the wheel on ``sys.path`` (:func:`load_api`, the worker's own import of it)."""
    api = load_api()
    return api.nixl_agent(name, api.nixl_agent_config(backends=["UCX"]))


def rss_mib(proc: psutil.Process) -> float:
    return proc.memory_info().rss / MiB


def heap_rss_mib(smaps: str) -> float:
    """Resident MiB of the ``[heap]`` mapping (malloc's ``brk`` arena) in ``/proc/<pid>/smaps`` text, or 0: where
    growth is malloc's rather than a mapping's (UCX's registration cache holds mappings, not heap)."""
    current = ""
    for line in smaps.splitlines():
        if MAPPING.match(line):
            current = line
        elif line.startswith("Rss:") and current.rstrip().endswith("[heap]"):
            return int(line.split()[1]) / 1024
    return 0.0


def summary(points: list[tuple[float, float]]) -> dict[str, Any]:
    """Growth (MiB, last minus first sample) and the second half's slope (MiB/min) of ``(seconds, MiB)``, the
    ``[heap]``'s resident MiB at the end, and the UCX judgement of this process."""
    half = points[len(points) // 2:]
    info = current_info()
    with open("/proc/self/smaps", encoding="utf-8") as f:
        heap = heap_rss_mib(f.read())
    return {"rss_start_mib": round(points[0][1], 2), "rss_end_mib": round(points[-1][1], 2),
            "growth_mib": round(points[-1][1] - points[0][1], 2),
            "slope_mib_per_min": round(slope(half) * 60, 2), "seconds": round(points[-1][0], 2),
            "heap_rss_end_mib": round(heap, 1), "ucx_info": info.labels(), "risky": risky(info)}


def decode_side(conn: Connection, size: int) -> None:
    """The receiving process: one registered buffer; samples its RSS when the prefill side asks."""
    proc = psutil.Process()
    me = agent("decode")
    buf = torch.zeros(size // 4, dtype=torch.float32)
    me.register_memory(buf)
    conn.send((me.get_agent_metadata(), me.get_serialized_descs(me.get_xfer_descs(buf))))
    me.add_remote_agent(conn.recv())
    t0, points = time.monotonic(), []
    while (msg := conn.recv()) != "done":
        points.append((time.monotonic() - t0, rss_mib(proc)))
        conn.send(float(buf[msg]))  # the value the prefill side wrote at that index: the data arrived
    conn.send(summary(points))


def run(transfers: int, size: int, every: int) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    mine, theirs = ctx.Pipe()
    child = ctx.Process(target=decode_side, args=(theirs, size), daemon=True)
    child.start()
    try:
        proc = psutil.Process()
        me = agent("prefill")
        metadata, descs = mine.recv()
        peer = me.add_remote_agent(metadata)
        mine.send(me.get_agent_metadata())
        remote = me.deserialize_descs(descs)
        t0, points, checked = time.monotonic(), [], 0
        for i in range(transfers):
            block = mmap.mmap(-1, size)
            view = torch.frombuffer(block, dtype=torch.float32)
            view.fill_(float(i))
            reg = me.register_memory(view)
            handle = me.initialize_xfer("WRITE", me.get_xfer_descs(view), remote, peer, b"kv")
            me.transfer(handle)
            while (state := me.check_xfer_state(handle)) != "DONE":
                if state == "ERR":
                    raise RuntimeError(f"transfer {i} failed")
            me.release_xfer_handle(handle)
            me.deregister_memory(reg)
            del view
            block.close()
            scratch = torch.empty(size // 4, dtype=torch.float32).fill_(1.0)
            del scratch
            if i % every == 0 or i == transfers - 1:
                points.append((time.monotonic() - t0, rss_mib(proc)))
                mine.send(i % (size // 4))
                if mine.recv() != float(i):
                    raise RuntimeError(f"transfer {i}: the decode buffer does not hold what was written")
                checked += 1
        mine.send("done")
        decode = mine.recv()
        child.join(30)
        return {"transfers": transfers, "block_mib": size / MiB, "checked": checked,
                "prefill": summary(points), "decode": decode}
    finally:
        if child.is_alive():
            child.kill()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--transfers", type=int, default=1000)
    parser.add_argument("--mib", type=float, default=4.0, help="block size, MiB")
    parser.add_argument("--every", type=int, default=25, help="sample RSS every this many transfers")
    args = parser.parse_args(argv)
    print(json.dumps(run(args.transfers, int(args.mib * MiB), args.every)))


if __name__ == "__main__":
    main()
