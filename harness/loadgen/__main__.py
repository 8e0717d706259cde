"""Command line: ``python -m harness.loadgen replay|burst --url URL [...]``.

Examples::

    python -m harness.loadgen replay --url http://127.0.0.1:8000 --limit 200 \\
        --time-compression 20 --length-scale 0.25 --max-context 1023 --json out.json
    python -m harness.loadgen burst --url http://127.0.0.1:8000 -n 32 --prompt-tokens 512 \\
        --repetitive

Prints a short summary table; ``--json`` also writes the run, its settings and
the summary. The exit status is 0 when the run finished, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from harness.loadgen.client import PROMPT_STRIDE, burst, check_urls, replay
from harness.loadgen.records import RunResult
from harness.loadgen.stats import format_summary, summarize
from harness.loadgen.text import prompt_of_length, repetitive_prompt
from harness.loadgen.trace import ScheduledRequest, load_schedule


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", action="append", required=True,
                   help="worker base URL (loopback only); repeat for round-robin")
    p.add_argument("--model", default="tiny")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0, help="request i carries seed + i")
    p.add_argument("--timeout", type=float, default=None,
                   help="global deadline, seconds (default: last arrival + request timeout + 5)")
    p.add_argument("--request-timeout", type=float, default=60.0, help="per request, seconds")
    p.add_argument("--max-in-flight", type=int, default=None, help="open requests at most")
    p.add_argument("--stream", action="store_true", help="use SSE; TTFT = first token chunk")
    p.add_argument("--repetitive", action="store_true",
                   help="skewed prompts ('aaaa', 'abab') instead of real text")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--json", type=Path, default=None, help="write run + summary here")
    p.add_argument("--include-text", action="store_true", help="keep completions in --json")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``python -m harness.loadgen``."""
    parser = argparse.ArgumentParser(prog="python -m harness.loadgen", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="mode", required=True)
    rp = sub.add_parser("replay", help="replay the Azure conversation trace")
    _common(rp)
    rp.add_argument("--trace", type=Path, default=None,
                    help="trace CSV (default: $MOEGUARD_TRACE_PATH or bench/traces/...)")
    rp.add_argument("--limit", type=int, default=None, help="first N requests")
    rp.add_argument("--time-compression", type=float, default=1.0,
                    help="divide arrival times by this")
    rp.add_argument("--length-scale", type=float, default=1.0,
                    help="multiply token lengths by this")
    rp.add_argument("--max-context", type=int, default=1024,
                    help="prompt + max_tokens at most this many tokens")
    rp.add_argument("--max-new-tokens-cap", type=int, default=None)
    bp = sub.add_parser("burst", help="send N requests at once")
    _common(bp)
    bp.add_argument("-n", "--count", type=int, default=16, help="number of requests")
    bp.add_argument("--prompt-tokens", type=int, default=256, help="prompt length, tokens")
    bp.add_argument("--max-tokens", type=int, default=16)
    return parser


async def _run(args: argparse.Namespace) -> tuple[RunResult, dict[str, Any]]:
    common: dict[str, Any] = dict(
        model=args.model, temperature=args.temperature, seed=args.seed, timeout_s=args.timeout,
        request_timeout_s=args.request_timeout, stream=args.stream,
        progress=not args.no_progress)
    if args.mode == "replay":
        schedule = load_schedule(args.trace, time_compression=args.time_compression,
                                 length_scale=args.length_scale, max_context=args.max_context,
                                 max_new_tokens_cap=args.max_new_tokens_cap, limit=args.limit)

        def repetitive(r: ScheduledRequest) -> str:
            return repetitive_prompt(r.prompt_tokens, seed=args.seed + r.index)

        run = await replay(args.url, schedule, prompt_fn=repetitive if args.repetitive else None,
                           max_in_flight=args.max_in_flight or 64, **common)
        return run, (schedule.meta.to_dict() if schedule.meta else {})
    prompts = [repetitive_prompt(args.prompt_tokens, seed=args.seed + i) if args.repetitive
               else prompt_of_length(args.prompt_tokens, offset=i * PROMPT_STRIDE)
               for i in range(args.count)]
    run = await burst(args.url, prompts, max_tokens=args.max_tokens,
                      max_in_flight=args.max_in_flight, **common)
    return run, {"prompt_tokens": args.prompt_tokens, "repetitive": args.repetitive}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        check_urls(args.url)
    except ValueError as exc:
        parser.error(str(exc))
    try:
        run, extra = asyncio.run(_run(args))
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    summary = summarize(run)
    if extra.get("n_clamped") is not None:
        print(f"schedule      {extra['n_requests']} requests over {extra['duration_s']:.1f} s, "
              f"x{extra['time_compression']:g} time, x{extra['length_scale']:g} length, "
              f"{extra['n_clamped']} clamped to {extra['max_context']} tokens")
    for line in format_summary(summary):
        print(line)
    if run.timed_out:
        print("note          the global deadline stopped unfinished requests")
    if args.json is not None:
        doc = {"summary": summary.to_dict(), "run": run.to_dict(args.include_text)}
        args.json.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
