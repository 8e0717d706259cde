"""Refusal cost: a normal client's goodput alone, and beside abusive clients whose requests are
refused at about 100 per second and who ignore Retry-After (issue 13 §4, target: the refusals cost
at most 10 % of goodput).

``python -m bench.refusal_cost`` (``make bench-refusal``) starts one worker
(:func:`harness.worker_process.start_worker_process`, preset :data:`PRESET`, one torch thread) with
``max_concurrent_requests`` equal to the normal client's lanes and overload mode On. The normal
client: :data:`LANES` closed-loop lanes, each sending ``/v1/completions`` (a
:data:`PROMPT_TOKENS`-token prompt, ``max_tokens`` :data:`MAX_TOKENS`, seeded sampling) as soon as
its last one ended, so the worker is full whenever it runs. The abusive clients:
:data:`ABUSE_CONNECTIONS` keep-alive connections, raw HTTP/1.1 from prebuilt bytes (the load
generator's own cost kept small), together sending :data:`ABUSE_RATE` requests a second on a fixed
schedule, whatever the answer or its Retry-After. Each abusive request is a real one (a prompt of a
quarter of the context, ``max_tokens`` half of it) that can never take a slot: while the worker is
full it gets 429 ``concurrency_limit`` before its body is read; in the moment a slot is free, its
body is parsed and tokenized and it gets 503 ``overload_context_limit`` (prompt + max_tokens over
overload mode's cap, half the context). Both paths are refusals, counted apart; no abusive request
is ever served, so what the normal client loses is what refusing costs.

The run interleaves windows of :data:`WINDOW_S` seconds, alone (A) and with abuse (B), in pairs
ordered AB, BA, AB, ... (drift cancels). Goodput of a window: completion tokens per second of the
normal requests that ended 200 within it, after a settle time of :data:`SETTLE_S` (a request ending
early in a window ran mostly in the one before); requests per second beside it. The report gives
each arm's median, the ratio of the medians (B / A), the abusive requests' answers, the worker's
CPU seconds per window (``/proc/<pid>/stat``) and from them the CPU cost of one refusal.

The JSON is the record; the markdown is rendered from it (``--report`` renders again), never
edited by hand.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from harness.loadgen.text import prompt_of_length
from harness.worker_process import start_worker_process

from bench.headline import machine
from moeguard_core.presets import get_preset

RESULTS = Path(__file__).resolve().parent / "results"
PRESET = "small"
LANES = 4
PROMPT_TOKENS = 128
MAX_TOKENS = 32
ABUSE_RATE = 100.0
ABUSE_CONNECTIONS = 4
WINDOW_S = 24.0
SETTLE_S = 4.0
PAIRS = 5
WARMUP_S = 15.0
TARGET_RATIO = 0.90
"""Goodput beside abuse over goodput alone: at least this (refusals cost at most 10 %)."""


@dataclass
class Window:
    arm: str
    start: float
    end: float
    tokens: int = 0
    requests: int = 0
    abuse: Counter[str] = field(default_factory=Counter)
    cpu_s: float = 0.0

    def row(self) -> dict[str, Any]:
        span = self.end - self.start - SETTLE_S
        return {"arm": self.arm, "tokens_per_s": self.tokens / span, "requests_per_s": self.requests / span,
                "abuse": dict(self.abuse),
                "worker_cpu_s": round(self.cpu_s, 3), "seconds": round(self.end - self.start, 3)}


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (``/proc/<pid>/stat`` fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def abuse_request(port: int, max_seq_len: int) -> bytes:
    """An abusive request's bytes: a prompt of a quarter of the context and ``max_tokens`` half of it
    (within the context, over overload mode's cap of half of it)."""
    body = json.dumps({"prompt": prompt_of_length(max_seq_len // 4, 4242),
                       "max_tokens": max_seq_len // 2}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")
    return head.encode() + body


async def read_status(reader: asyncio.StreamReader) -> int:
    """One HTTP/1.1 response off ``reader`` (Content-Length framed): its status code."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    length = next((int(line.split(":", 1)[1]) for line in lines if line.lower().startswith("content-length:")), 0)
    await reader.readexactly(length)
    return int(lines[0].split()[1])


class Bench:
    def __init__(self, base_url: str, port: int, pid: int, max_seq_len: int, window_s: float,
                 warmup_s: float) -> None:
        self.base_url, self.port, self.pid = base_url, port, pid
        self.window_s, self.warmup_s = window_s, warmup_s
        self.window: Window | None = None
        self.abusing = False
        self.stop = False
        self.request = abuse_request(port, max_seq_len)

    async def lane(self, index: int, client: httpx.AsyncClient) -> None:
        n = 0
        while not self.stop:
            n += 1
            body = {"prompt": prompt_of_length(PROMPT_TOKENS, 7919 * (index * 1000 + n)),
                    "max_tokens": MAX_TOKENS, "temperature": 1.0, "seed": n}
            r = await client.post("/v1/completions", json=body)
            w, now = self.window, time.monotonic()
            if r.status_code != 200:
                raise RuntimeError(f"normal request answered {r.status_code}: {r.text[:300]}")
            if w is not None and now >= w.start + SETTLE_S:
                w.tokens += r.json()["usage"]["completion_tokens"]
                w.requests += 1

    async def abuser(self, index: int) -> None:
        interval = ABUSE_CONNECTIONS / ABUSE_RATE
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        next_t = time.monotonic() + index * interval / ABUSE_CONNECTIONS
        while not self.stop:
            await asyncio.sleep(max(0.0, next_t - time.monotonic()))
            next_t = max(next_t + interval, time.monotonic())
            if not self.abusing:
                continue
            try:
                writer.write(self.request)
                status = str(await read_status(reader))
            except (asyncio.IncompleteReadError, ConnectionError):  # the server closed an idle connection
                writer.close()
                reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
                writer.write(self.request)
                status = str(await read_status(reader))
            if self.window is not None and self.window.arm == "abuse":
                self.window.abuse[status] += 1
        writer.close()

    async def run(self, order: list[str]) -> list[Window]:
        windows: list[Window] = []
        async with httpx.AsyncClient(base_url=self.base_url, timeout=120) as client:
            tasks = [asyncio.create_task(self.lane(i, client)) for i in range(LANES)]
            tasks += [asyncio.create_task(self.abuser(i)) for i in range(ABUSE_CONNECTIONS)]
            await asyncio.sleep(self.warmup_s)
            for arm in order:
                self.abusing = arm == "abuse"
                cpu0, t0 = cpu_seconds(self.pid), time.monotonic()
                self.window = Window(arm, t0, t0 + self.window_s)
                await asyncio.sleep(self.window_s)
                self.window.end, self.window.cpu_s = time.monotonic(), cpu_seconds(self.pid) - cpu0
                windows.append(self.window)
                print(json.dumps(self.window.row()), flush=True)
            self.window, self.stop, self.abusing = None, True, False
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        return windows


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians per arm, the ratio, the abusive answers, the CPU cost of one refusal."""
    def arm(name: str) -> list[dict[str, Any]]:
        return [r for r in rows if r["arm"] == name]

    alone, abuse = arm("alone"), arm("abuse")
    med = {name: {key: statistics.median(r[key] for r in rs) for key in ("tokens_per_s", "requests_per_s",
                                                                           "worker_cpu_s")}
           for name, rs in (("alone", alone), ("abuse", abuse))}
    answers: Counter[str] = Counter()
    for r in abuse:
        answers.update(r["abuse"])
    refused = sum(v for k, v in answers.items() if k in ("429", "503"))
    abuse_s = sum(r["seconds"] for r in abuse)
    cpu_extra = med["abuse"]["worker_cpu_s"] - med["alone"]["worker_cpu_s"]
    per_window_refusals = refused / len(abuse) if abuse else 0
    ratio = med["abuse"]["tokens_per_s"] / med["alone"]["tokens_per_s"]
    return {"medians": med, "ratio_tokens": ratio,
            "ratio_requests": med["abuse"]["requests_per_s"] / med["alone"]["requests_per_s"],
            "abuse_answers": dict(answers), "refusals_per_s": refused / abuse_s if abuse_s else 0.0,
            "worker_cpu_us_per_refusal": (cpu_extra / per_window_refusals * 1e6 if per_window_refusals
                                          else None),
            "target_ratio": TARGET_RATIO, "met": ratio >= TARGET_RATIO}


def render(record: dict[str, Any]) -> str:
    s, p = record["summary"], record["params"]
    m = record["machine"]
    med = s["medians"]
    verdict = "met" if s["met"] else "**missed**"
    cost = s["worker_cpu_us_per_refusal"]
    lines = [
        "<!-- Generated by `python -m bench.refusal_cost` (make bench-refusal) from refusal_cost.json. "
        "Do not edit. -->",
        "# Refusal cost: goodput beside clients that ignore Retry-After",
        "",
        f"`make bench-refusal` on {m['cpu']}, {m['cores']} cores, torch {m['torch']}; run {record['started']}.",
        "",
        f"One worker (preset `{p['preset']}`, one torch thread, `max_concurrent_requests` {p['lanes']}, "
        f"overload mode On). "
        f"Normal client: {p['lanes']} closed-loop lanes, {p['prompt_tokens']}-token prompts, max_tokens "
        f"{p['max_tokens']}. Abusive clients: {p['abuse_connections']} keep-alive connections sending "
        f"{p['abuse_rate']:g} requests/s on a fixed schedule ({p['abuse_prompt_tokens']}-token prompts, "
        f"max_tokens {p['abuse_max_tokens']}: never admissible while overload mode is on), ignoring "
        f"Retry-After. {2 * p['pairs']} windows of {p['window_s']:g} s interleaved "
        f"({' '.join('A' if a == 'alone' else 'B' for a in record['order'])}; A alone, B with abuse), "
        f"the first {p['settle_s']:g} s of each not counted.",
        "",
        "Goodput: completion tokens per second of the normal client's requests that ended 200 "
        "(requests per second beside it).",
        "",
        "| arm | median goodput (tokens/s) | median requests/s | median worker CPU s per window |",
        "|---|---|---|---|",
        *(f"| {name} | {med[name]['tokens_per_s']:.1f} | {med[name]['requests_per_s']:.2f} | "
          f"{med[name]['worker_cpu_s']:.1f} |" for name in ("alone", "abuse")),
        "",
        f"**Ratio of the medians (with abuse / alone): {s['ratio_tokens']:.3f} in tokens/s "
        f"({s['ratio_requests']:.3f} in requests/s); target >= {s['target_ratio']:.2f} "
        f"(refusals cost <= 10 % of goodput): {verdict}.**",
        "",
        f"Abusive requests answered (B windows): "
        f"{', '.join(f'{k}: {v}' for k, v in sorted(s['abuse_answers'].items()))}; "
        f"refused {s['refusals_per_s']:.1f}/s (429: refused before the body was read, the worker full; "
        f"503: parsed and tokenized, then refused by overload mode's context cap).",
        "",
        ("Worker CPU per refusal (median extra CPU per B window / refusals per window): "
         f"{cost:.0f} us." if cost is not None else "Worker CPU per refusal: no refusals."),
        "",
        "| window | arm | tokens/s | requests/s | worker CPU s | abusive answers |",
        "|---|---|---|---|---|---|",
        *(f"| {i + 1} | {r['arm']} | {r['tokens_per_s']:.1f} | {r['requests_per_s']:.2f} | "
          f"{r['worker_cpu_s']:.1f} | "
          f"{', '.join(f'{k}: {v}' for k, v in sorted(r['abuse'].items())) or '-'} |"
          for i, r in enumerate(record["windows"])),
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=PAIRS)
    ap.add_argument("--preset", default=PRESET)
    ap.add_argument("--window", type=float, default=WINDOW_S, help="seconds per window")
    ap.add_argument("--warmup", type=float, default=WARMUP_S, help="seconds of traffic before the first window")
    ap.add_argument("--out", type=Path, default=RESULTS / "refusal_cost.json")
    ap.add_argument("--report", action="store_true", help="render the markdown from the JSON only")
    args = ap.parse_args(argv)
    md = args.out.with_suffix(".md")
    if args.report:
        md.write_text(render(json.loads(args.out.read_text())))
        return 0
    max_seq_len = get_preset(args.preset).max_seq_len
    order = [arm for i in range(args.pairs) for arm in (("alone", "abuse") if i % 2 == 0 else ("abuse", "alone"))]
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    with tempfile.TemporaryDirectory() as tmp:
        w = start_worker_process(Path(tmp), {"MOEGUARD_MODEL_PRESET": args.preset, "MOEGUARD_OVERLOAD_MODE": "On",
                                             "MOEGUARD_MAX_CONCURRENT_REQUESTS": str(LANES)}, timeout_s=180)
        try:
            port = int(w.base_url.rsplit(":", 1)[1])
            windows = asyncio.run(Bench(w.base_url, port, w.proc.pid, max_seq_len, args.window,
                                         args.warmup).run(order))
        finally:
            w.stop()
    rows = [win.row() for win in windows]
    record = {"started": started, "machine": machine(), "order": order,
              "params": {"preset": args.preset, "lanes": LANES, "prompt_tokens": PROMPT_TOKENS,
                         "max_tokens": MAX_TOKENS, "abuse_rate": ABUSE_RATE,
                         "abuse_connections": ABUSE_CONNECTIONS, "abuse_prompt_tokens": max_seq_len // 4,
                         "abuse_max_tokens": max_seq_len // 2, "window_s": args.window, "settle_s": SETTLE_S,
                         "pairs": args.pairs, "warmup_s": args.warmup},
              "windows": rows, "summary": summarize(rows)}
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    md.write_text(render(record))
    print(render(record))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
