"""C6 at full length: steady traffic against a real worker, and its RSS slope.

``python -m bench.soak --minutes 10`` (``make bench-soak``) starts a worker
(``tiny`` preset, :func:`harness.worker_process.start_worker_process`), sends unique ~450-token
prompts with ``max_tokens=1`` from 4 concurrent clients, samples the worker's
``/metrics`` every 2 s, and writes ``bench/results/soak.md`` and ``soak.json``:
the least-squares slope in MB/min of RSS, anonymous RSS and the Python heap's
block count over the run after a 1-minute warm-up, with the worker's own leak
verdict (``moeguard_memory_leak_suspected``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from harness.loadgen.text import prompt_of_length
from harness.metrics_text import samples as metric_samples
from harness.worker_process import start_worker_process

from moeguard_core import contract
from moeguard_runtime.memory.leak import slope

RESULTS = Path(__file__).resolve().parent / "results"
SERIES = {"rss": contract.METRIC_PROCESS_RSS_BYTES,
          "rss_anonymous": contract.METRIC_PROCESS_RSS_ANONYMOUS_BYTES,
          "python_blocks": contract.METRIC_PYTHON_ALLOCATED_BLOCKS,
          "mappings": contract.METRIC_PROCESS_MEMORY_MAPPINGS}


def sample_row(text: str, t: float) -> dict[str, float]:
    """One soak sample from the worker's ``/metrics``: the SERIES and the native leak verdict."""
    keys = {name: key for key, name in SERIES.items()}
    row = {"t": t}
    for name, labels, value in metric_samples(text):
        if name in keys:
            row[keys[name]] = value
        elif name == contract.METRIC_MEMORY_LEAK_SUSPECTED and labels.get("kind") == "native":
            row["leak_native"] = value
    return row


async def run(url: str, seconds: float, clients: int) -> tuple[int, list[dict[str, float]]]:
    stop = time.monotonic() + seconds
    t0 = time.monotonic()
    sent = [0]
    samples: list[dict[str, float]] = []
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        async def load() -> None:
            while time.monotonic() < stop:
                sent[0] += 1
                r = await client.post("/v1/completions", json={
                    "prompt": prompt_of_length(449, sent[0] * 7919), "max_tokens": 1})
                r.raise_for_status()

        async def sample() -> None:
            while time.monotonic() < stop:
                samples.append(sample_row((await client.get("/metrics")).text, time.monotonic() - t0))
                await asyncio.sleep(2.0)

        await asyncio.gather(sample(), *(load() for _ in range(clients)))
    return sent[0], samples


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="C6 soak: RSS slope under steady traffic")
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--warmup-minutes", type=float, default=1.0)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--out", default=str(RESULTS / "soak"))
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        worker = start_worker_process(Path(tmp), {})
        try:
            sent, samples = asyncio.run(run(worker.base_url, a.minutes * 60, a.clients))
        finally:
            worker.stop()
    tail = [s for s in samples if s["t"] >= a.warmup_minutes * 60]
    slopes = {k: slope([(s["t"], s[k]) for s in tail if k in s]) * 60 for k in SERIES}
    result: dict[str, Any] = {"minutes": a.minutes, "requests": sent, "samples": samples,
                              "slope_per_min": slopes,
                              "leak_native_seen": any(s.get("leak_native") for s in samples)}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    md = "\n".join([
        "# C6 soak: RSS under steady traffic", "",
        f"`make bench-soak`: {a.minutes:g} minutes, {a.clients} clients, unique 450-token prompts, "
        f"max_tokens=1, {sent} requests; slopes fitted after a {a.warmup_minutes:g}-minute warm-up.",
        "",
        "| series | slope per minute |", "|---|---|",
        f"| RSS | {slopes['rss'] / 1e6:.2f} MB/min |",
        f"| anonymous RSS | {slopes['rss_anonymous'] / 1e6:.2f} MB/min |",
        f"| Python heap blocks | {slopes['python_blocks']:.0f} blocks/min |",
        f"| memory mappings | {slopes['mappings']:.2f} /min |", "",
        f"Native leak suspected by the worker at any sample: {result['leak_native_seen']}.", ""])
    out.with_suffix(".md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
