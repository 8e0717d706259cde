"""Expert parallelism on local processes: the numerics harness and the per-step benchmark (issue 15).

:func:`run_group` starts ``ranks`` processes (``torch.multiprocessing``, spawn) that form a real gloo group
on the loopback (:class:`moeguard_runtime.parallel.expert_parallel.ExpertParallelGroup`); rank 0 runs a job on the
sharded model with its MoE layers dispatching through the group, the others follow it, exactly as the
worker's ranks do. ``ranks=1`` runs the unsharded single-process model. The numerics test
(``tests/integration/worker/test_ep_numerics.py``) and the benchmark share it.

``python -m bench.expert_parallel_bench`` (``make bench-ep``) writes ``bench/results/expert_parallel.md``
and ``expert_parallel.json``: for 1, 2 and 4 ranks and both dispatch modes (``routed``, the worker's, and
``broadcast``), on the ``small`` preset (D=512, E=8, k=2, I=1280, 6 layers, fp32, one torch thread per
rank), median per-step wall time of a prefill step (4 prompts x 128 tokens) and a decode step (16
sequences), split into the leader's compute and its time in the group's exchanges, with the bytes moved
per step; then, on paper, the same dispatch's bytes against DeepEP's published bandwidths on H200-class
nodes.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
from harness.worker_process import free_port
from torch import nn

from moeguard_runtime.model.model import KVCache, Segment
from moeguard_runtime.parallel.ep_config import EpSettings
from moeguard_runtime.parallel.expert_parallel import (
    OP_STOP,
    DispatchMode,
    ExpertParallelGroup,
    attach,
    expert_weights,
    shard_experts,
    strip_to_experts,
)

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass(frozen=True)
class ModelSpec:
    """The model every rank builds: a preset and seed, or an HF checkpoint folder (fp32 on the CPU)."""

    preset: str = "tiny"
    seed: int = 0
    checkpoint: str | None = None


def build(spec: ModelSpec, block: tuple[int, int] | None = None) -> nn.Module:
    """The model of ``spec`` (host dispatch, ``F.linear`` kernels on every rank): a checkpoint with only the
    experts ``block`` read, as the worker loads a rank's share (``BuildOptions.expert_block``), else whole."""
    if spec.checkpoint is not None:
        from moeguard_runtime.model.hf_checkpoint import load_hf_checkpoint
        from moeguard_runtime.model.hf_config import BuildOptions

        model = load_hf_checkpoint(spec.checkpoint, torch.float32, torch.device("cpu"),
                                   BuildOptions(2048, 0.0, "torch", "host", expert_block=block)).model
        assert isinstance(model, nn.Module)
        return model
    from moeguard_core.presets import get_preset
    from moeguard_runtime.model.model import build_model

    return build_model(get_preset(spec.preset), seed=spec.seed, matmul_backend="torch", dispatch="host")


Job = Callable[[nn.Module, ExpertParallelGroup | None, dict[str, Any]], Any]


def _new_cache(model: nn.Module, capacity: int) -> KVCache:
    cache: KVCache = model.new_cache(capacity, torch.float32, "cpu")  # type: ignore[operator]
    return cache


def logits_job(model: nn.Module, group: ExpertParallelGroup | None, a: dict[str, Any]) -> list[torch.Tensor]:
    """One packed prefill of ``a["prompts"]`` then ``a["decode_steps"]`` greedy decode steps of all of
    them together; returns each step's ``[S, V]`` float32 logits."""
    prompts: list[list[int]] = a["prompts"]
    steps: int = a["decode_steps"]
    caches = [_new_cache(model, len(p) + steps + 1) for p in prompts]
    out = []
    with torch.inference_mode():
        tokens = torch.tensor([t for p in prompts for t in p])
        positions = torch.tensor([i for p in prompts for i in range(len(p))])
        logits, _ = model(tokens, positions, [Segment(c, 0, len(p)) for c, p in zip(caches, prompts, strict=True)])
        out.append(logits.clone())
        for s in range(steps):
            nxt = logits.argmax(-1)  # [S]
            pos = torch.tensor([len(p) + s for p in prompts])
            logits, _ = model(nxt, pos, [Segment(c, len(p) + s, 1) for c, p in zip(caches, prompts, strict=True)])
            out.append(logits.clone())
    return out


def timing_job(model: nn.Module, group: ExpertParallelGroup | None, a: dict[str, Any]) -> dict[str, list[dict[str, float]]]:
    """Repeated prefill steps (``a["prefill_prompts"]`` prompts of ``a["prefill_len"]`` random tokens) and
    decode steps (``a["decode_batch"]`` sequences at position ``a["decode_pos"]``); per step: wall
    seconds, seconds in the group's exchanges (leader's view: not its own compute), bytes sent and received
    by the leader."""
    g = torch.Generator().manual_seed(0)
    vocab: int = getattr(model, "args").vocab_size  # noqa: B009 - a ServingModel's shape
    records: dict[str, list[dict[str, float]]] = {"prefill": [], "decode": []}

    def one(kind: str, tokens: torch.Tensor, positions: torch.Tensor, segments: list[Segment]) -> None:
        if group is not None:
            group.take_counters()
        t0 = time.perf_counter()
        with torch.inference_mode():
            model(tokens, positions, segments)
        wall = time.perf_counter() - t0
        c = group.take_counters() if group is not None else None
        records[kind].append({"wall_s": wall, "exchange_s": c.collective_s if c else 0.0,
                              "bytes_sent": c.bytes_sent if c else 0, "bytes_received": c.bytes_received if c else 0,
                              "slots_remote": sum(sum(r[1:]) for r in c.per_layer_ranks) if c else 0})

    n_p, plen = a["prefill_prompts"], a["prefill_len"]
    bsz, dpos = a["decode_batch"], a["decode_pos"]
    for _ in range(a["warmup"] + a["repeats"]):
        caches = [_new_cache(model, plen + 1) for _ in range(n_p)]
        toks = torch.randint(0, vocab, (n_p * plen,), generator=g)
        one("prefill", toks, torch.arange(plen).repeat(n_p), [Segment(c, 0, plen) for c in caches])
        dcaches = [_new_cache(model, dpos + 1) for _ in range(bsz)]
        one("decode", torch.randint(0, vocab, (bsz,), generator=g), torch.full((bsz,), dpos),
            [Segment(c, dpos, 1) for c in dcaches])
    w = a["warmup"]
    return {k: v[w:] for k, v in records.items()}


JOBS: dict[str, Job] = {"logits": logits_job, "timing": timing_job}


def _pack(value: Any) -> bytes:
    """A result as bytes (tensors by value: torch's shared-memory hand-over needs the sender alive)."""
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def _unpack(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=False)


def _rank_main(rank: int, ranks: int, port: int, spec: ModelSpec, job: str, job_args: dict[str, Any],
               mode: DispatchMode, timeout_s: float, queue: Any) -> None:
    torch.set_num_threads(1)
    ep = EpSettings(size=ranks, rank=rank, leader_address="127.0.0.1", port=port, timeout_s=timeout_s,
                    join_timeout_s=120.0, group_size=ranks)
    block = None
    if spec.checkpoint is not None and ranks > 1:  # a checkpoint is loaded sharded, as the worker loads it
        from moeguard_runtime.model.hf_checkpoint import read_checkpoint_info

        block = ep.expert_range(read_checkpoint_info(spec.checkpoint).num_experts)
    model = build(spec, block)
    if ranks == 1:
        queue.put((0, _pack(JOBS[job](model, None, job_args))))
        return
    if block is None:
        shard_experts(model, rank, ranks)
    dim = int(expert_weights(model)[0][0].shape[2])
    if rank > 0:
        strip_to_experts(model)
        weights = expert_weights(model)
        group = ExpertParallelGroup(ep, torch.device("cpu"), torch.float32, dim, mode=mode)
        compute_s, coll_s, slots = 0.0, 0.0, 0
        while True:
            served = group.follow_once(lambda layer: weights[layer], "torch", lambda: 0)
            if served.op == OP_STOP:
                break
            compute_s += served.compute_s
            coll_s += served.comm_s
            slots += served.slots
        queue.put((rank, {"compute_s": compute_s, "comm_s": coll_s, "slots": slots}))
        group.close()
        return
    group = ExpertParallelGroup(ep, torch.device("cpu"), torch.float32, dim, mode=mode)
    attach(model, group)
    result = JOBS[job](model, group, job_args)
    group.stop()
    queue.put((0, _pack(result)))


def run_group(ranks: int, spec: ModelSpec, job: str, job_args: dict[str, Any], mode: DispatchMode = "routed",
              timeout_s: float = 60.0, wall_timeout_s: float = 300.0) -> tuple[Any, dict[int, Any]]:
    """Run ``job`` on rank 0 of a fresh group of ``ranks`` local processes; returns (rank 0's result,
    the followers' totals by rank: compute and communication seconds, slots served).

    Raises:
        RuntimeError: a rank exited with an error or the whole run took over ``wall_timeout_s``.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, ranks, port, spec, job, job_args, mode, timeout_s, queue),
                         daemon=True) for r in range(ranks)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + wall_timeout_s
    try:
        while len(results) < ranks:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"{ranks}-rank run did not finish in {wall_timeout_s:g} s")
            try:
                rank, value = queue.get(timeout=min(left, 1.0))
                results[rank] = _unpack(value) if rank == 0 else value
            except Exception:  # queue.Empty: check for a dead rank
                dead = [(i, p.exitcode) for i, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"rank(s) exited with an error: {dead}") from None
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(5)
    return results[0], {r: v for r, v in results.items() if r != 0}


# --- the benchmark --------------------------------------------------------------------------------
BENCH_ARGS = {"prefill_prompts": 4, "prefill_len": 128, "decode_batch": 16, "decode_pos": 64, "warmup": 2,
              "repeats": 9}


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def summarize(records: list[dict[str, float]]) -> dict[str, float]:
    wall = _median([r["wall_s"] for r in records])
    exch = _median([r["exchange_s"] for r in records])
    return {"wall_ms": wall * 1e3, "exchange_ms": exch * 1e3, "compute_ms": (wall - exch) * 1e3,
            "bytes_per_step": _median([r["bytes_sent"] + r["bytes_received"] for r in records]),
            "remote_slots_per_step": _median([r["slots_remote"] for r in records])}


def rank_chosen_fraction(num_experts: int, top_k: int, ranks: int) -> float:
    """Probability that a token with ``k`` distinct uniformly-chosen experts picks at least one of a given
    rank's ``E / P`` experts: ``1 - C(E - E/P, k) / C(E, k)``."""
    per = num_experts // ranks
    return 1 - math.comb(num_experts - per, top_k) / math.comb(num_experts, top_k)


DEEPEP = {
    # deepseek-ai/DeepEP docs/legacy.md (V1, H800, CX7 400 Gb/s; 4096 tokens, 7168 hidden, top-8, FP8 dispatch,
    # BF16 combine): bottleneck bandwidths of the normal kernels.
    "v1_intranode_ep8_dispatch_GBps": 153.0, "v1_intranode_ep8_combine_GBps": 158.0,
    "v1_internode_ep16_GBps": 43.0, "v1_internode_ep32_dispatch_GBps": 58.0, "v1_internode_ep64_GBps": 51.0,
    # V1 low-latency kernels (128 tokens, pure RDMA): EP8 dispatch 77 us / combine 114 us; EP64 173 / 314 us.
    "v1_ll_ep8_dispatch_us": 77.0, "v1_ll_ep8_combine_us": 114.0,
    "v1_ll_ep64_dispatch_us": 173.0, "v1_ll_ep64_combine_us": 314.0,
    # README (V2, SM90 + CX7; 8K tokens, 7168 hidden, top-8, FP8 dispatch, BF16 combine): EP 8x2 90/81 GB/s,
    # EP 8x4 61/61 GB/s (RDMA, logical bandwidth).
    "v2_sm90_ep8x2_dispatch_GBps": 90.0, "v2_sm90_ep8x2_combine_GBps": 81.0, "v2_sm90_ep8x4_GBps": 61.0,
}


def paper_estimate() -> list[dict[str, Any]]:
    """The routed dispatch's bytes for DeepSeek-V3's shape (D=7168, E=256, k=8), per rank's share of a step's
    tokens, over DeepEP's published bottleneck bandwidths: what one MoE layer's dispatch + combine would
    take on H200 nodes (FP8 dispatch, 1 byte per value plus scales ignored; BF16 combine)."""
    dim, e, k = 7168, 256, 8
    rows = []
    for label, tokens, ranks, dispatch_bw, combine_bw in (
        ("prefill, intranode NVLink, EP8 (V1 H800 figures)", 4096, 8,
         DEEPEP["v1_intranode_ep8_dispatch_GBps"], DEEPEP["v1_intranode_ep8_combine_GBps"]),
        ("prefill, internode RDMA, EP16 (V2 SM90 EP 8x2)", 4096, 16,
         DEEPEP["v2_sm90_ep8x2_dispatch_GBps"], DEEPEP["v2_sm90_ep8x2_combine_GBps"]),
        ("prefill, internode RDMA, EP32 (V2 SM90 EP 8x4)", 4096, 32,
         DEEPEP["v2_sm90_ep8x4_GBps"], DEEPEP["v2_sm90_ep8x4_GBps"]),
    ):
        frac = rank_chosen_fraction(e, k, ranks)
        # each token goes to every rank it chose (at most k); bytes leaving one rank's share of tokens
        sends = tokens * frac * ranks  # token copies sent in the whole group
        dispatch_bytes = sends * dim * 1
        combine_bytes = sends * dim * 2
        rows.append({"case": label, "tokens": tokens, "ranks": ranks, "rank_fraction": frac,
                     "dispatch_MB": dispatch_bytes / 1e6, "combine_MB": combine_bytes / 1e6,
                     "dispatch_ms": dispatch_bytes / ranks / (dispatch_bw * 1e9) * 1e3,
                     "combine_ms": combine_bytes / ranks / (combine_bw * 1e9) * 1e3,
                     # this version: every token's copies leave (and come back to) the leader's links
                     "leader_only_ms": (dispatch_bytes / (dispatch_bw * 1e9)
                                        + combine_bytes / (combine_bw * 1e9)) * 1e3})
    return rows


def run_bench(ranks_list: tuple[int, ...] = (1, 2, 4), modes: tuple[DispatchMode, ...] = ("routed", "broadcast"),
              spec: ModelSpec = ModelSpec("small"), args: dict[str, Any] | None = None) -> dict[str, Any]:
    args = dict(BENCH_ARGS, **(args or {}))
    rows = []
    for ranks in ranks_list:
        for mode in (modes if ranks > 1 else ("routed",)):
            t0 = time.monotonic()
            res, followers = run_group(ranks, spec, "timing", args, mode=mode, timeout_s=120, wall_timeout_s=900)
            steps = len(res["prefill"]) + len(res["decode"])
            fol_compute = sum(v["compute_s"] for v in followers.values()) / max(1, len(followers)) / steps * 1e3
            fol_comm = sum(v["comm_s"] for v in followers.values()) / max(1, len(followers)) / steps * 1e3
            row = {"ranks": ranks, "mode": mode if ranks > 1 else "single process",
                   "prefill": summarize(res["prefill"]), "decode": summarize(res["decode"]),
                   "follower_compute_ms_per_step": fol_compute, "follower_comm_ms_per_step": fol_comm,
                   "seconds": round(time.monotonic() - t0, 1)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    return {"args": args, "spec": asdict(spec), "rows": rows, "paper": paper_estimate(), "deepep": DEEPEP,
            "cpu": _cpu(), "cores": os.cpu_count(), "when": datetime.now(UTC).isoformat(timespec="seconds"),
            "torch": torch.__version__}


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def _follower_rate(row: dict[str, Any]) -> float:
    """Bytes per second of one follower's own transfers: its share of a prefill + a decode step's bytes over
    its mean transfer time per step (x 2: the per-step mean is over prefill and decode steps)."""
    share = (row["prefill"]["bytes_per_step"] + row["decode"]["bytes_per_step"]) / (row["ranks"] - 1)
    return share / max(1e-9, 2 * row["follower_comm_ms_per_step"] / 1e3)


def render(data: dict[str, Any]) -> str:
    a = data["args"]
    lines = [
        "# Expert parallelism: per-step time and bytes on local processes",
        "",
        f"`make bench-ep` (`python -m bench.expert_parallel_bench`), {data['when']}, torch {data['torch']}.",
        f"Machine: {data['cpu']}, **{data['cores']} cores** shared by every rank (4 ranks oversubscribe them 2:1) and "
        "by other work on the machine; gloo over the loopback; one torch thread per rank. Figures here are about "
        "the protocol's costs, not a multi-node speed-up: the ranks' expert work cannot run in parallel beyond 2 "
        "cores.",
        "",
        f"Model: preset `{data['spec']['preset']}` (D=512, E=8, k=2, I=1280, 6 MoE layers, fp32, seed 0). "
        f"Prefill step: {a['prefill_prompts']} prompts x {a['prefill_len']} tokens "
        f"({a['prefill_prompts'] * a['prefill_len']} tokens). Decode step: {a['decode_batch']} sequences at "
        f"position {a['decode_pos']}. Medians of {a['repeats']} steps after {a['warmup']} warm-up steps.",
        "",
        "Columns: *wall* the leader's step; *exchange* the part of it spent in the group's exchanges (header "
        "broadcast, sends, waiting for and receiving the followers' results, i.e. including the followers' expert "
        "time it waits on); *compute* = wall - exchange (attention, routers, the leader's own experts, combine); "
        "*bytes* sent + received by the leader per step (all 6 layers); *follower compute / comm* a follower's "
        "expert time and transfer time, mean over all its steps (prefill and decode together).",
        "",
        "| ranks | dispatch | prefill wall ms | prefill compute ms | prefill exchange ms | prefill bytes/step | "
        "decode wall ms | decode compute ms | decode exchange ms | decode bytes/step | follower compute ms/step | "
        "follower comm ms/step |",
        "|--:|--|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for r in data["rows"]:
        p, d = r["prefill"], r["decode"]
        lines.append(f"| {r['ranks']} | {r['mode']} | {p['wall_ms']:.1f} | {p['compute_ms']:.1f} | "
                     f"{p['exchange_ms']:.1f} | {p['bytes_per_step'] / 1e6:.2f} MB | {d['wall_ms']:.1f} | "
                     f"{d['compute_ms']:.1f} | {d['exchange_ms']:.1f} | {d['bytes_per_step'] / 1e3:.0f} kB | "
                     f"{r['follower_compute_ms_per_step']:.1f} | {r['follower_comm_ms_per_step']:.1f} |")
    by = {(r["ranks"], r["mode"]): r for r in data["rows"]}
    lines += ["", "## The choice: routed dispatch", ""]
    for ranks in (2, 4):
        ro, br = by.get((ranks, "routed")), by.get((ranks, "broadcast"))
        if ro and br:
            lines.append(
                f"- {ranks} ranks: routed moves {ro['prefill']['bytes_per_step'] / br['prefill']['bytes_per_step']:.2f}x "
                f"the bytes of broadcast + reduce at prefill and "
                f"{ro['decode']['bytes_per_step'] / max(1, br['decode']['bytes_per_step']):.2f}x at decode; "
                f"its prefill step takes {ro['prefill']['wall_ms']:.0f} ms against {br['prefill']['wall_ms']:.0f} ms, "
                f"its decode step {ro['decode']['wall_ms']:.1f} ms against {br['decode']['wall_ms']:.1f} ms.")
    lines += [
        "",
        "With 4 ranks on 2 cores the ranks' expert work cannot overlap, so step times there say little about the "
        "dispatch; the bytes, which do not depend on the machine, are what the choice rests on.",
        "",
        "The worker uses the routed dispatch (`moeguard_runtime.parallel.expert_parallel`): a follower receives only the "
        "tokens that chose one of its experts, once per token, and returns their weighted sum; the bytes fall "
        "with the share of tokens that choose a rank, `1 - C(E - E/P, k) / C(E, k)` (0.46 for E=8, k=2, P=4; "
        "0.11 for DeepSeek-V3's E=256, k=8 at P=64), where broadcast + reduce always moves every token to and "
        "from every rank. It is also the shape of DeepEP's dispatch/combine, so the kernels can be swapped in "
        "later without changing the protocol's contract.",
        "",
        "## On paper: the same dispatch on H200 nodes with DeepEP's published figures",
        "",
        "DeepSeek-V3's shape (D=7168, E=256, k=8), FP8 dispatch (1 byte a value) and BF16 combine (2 bytes), "
        "4,096 tokens in the step spread over the ranks (data-parallel attention, as DeepEP's benchmarks assume), "
        "each token copied once to every rank it chose; time = one rank's bytes / DeepEP's bottleneck "
        "bandwidth for that topology. The leader-only attention of this first version would instead put all "
        "4,096 tokens' dispatch on one rank's links (multiply by the rank count).",
        "",
        "| case | ranks | share of tokens per rank | dispatch MB (group) | combine MB (group) | dispatch ms | "
        "combine ms | leader-only dispatch + combine ms |",
        "|--|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for r in data["paper"]:
        lines.append(f"| {r['case']} | {r['ranks']} | {r['rank_fraction']:.3f} | {r['dispatch_MB']:.0f} | "
                     f"{r['combine_MB']:.0f} | {r['dispatch_ms']:.2f} | {r['combine_ms']:.2f} | "
                     f"{r['leader_only_ms']:.1f} |")
    d = data["deepep"]
    lines += [
        "",
        f"Decode: DeepEP publishes latencies for its low-latency kernels directly (128 tokens per rank, D=7168, "
        f"top-8, FP8 dispatch, BF16 combine, pure RDMA on H800): EP8 dispatch {d['v1_ll_ep8_dispatch_us']:.0f} us "
        f"+ combine {d['v1_ll_ep8_combine_us']:.0f} us, EP64 {d['v1_ll_ep64_dispatch_us']:.0f} + "
        f"{d['v1_ll_ep64_combine_us']:.0f} us per MoE layer; over DeepSeek-V3's 58 MoE layers that is about "
        f"{(d['v1_ll_ep8_dispatch_us'] + d['v1_ll_ep8_combine_us']) * 58 / 1e3:.0f} ms (EP8) to "
        f"{(d['v1_ll_ep64_dispatch_us'] + d['v1_ll_ep64_combine_us']) * 58 / 1e3:.0f} ms (EP64) of a decode step "
        "unless overlapped (DeepEP's two-micro-batch overlap hides it behind compute).",
    ]
    ro = [r for r in data["rows"] if r["mode"] == "routed"]
    if ro:
        rates = ", ".join(
            f"{r['ranks']} ranks {_follower_rate(r) / 1e9:.2f} GB/s" for r in ro)
        lines += ["", f"This machine, for scale: a follower's transfers ran at about {rates} (its share of the "
                      "prefill and decode bytes over its own send + receive time per step; gloo over the loopback "
                      "on 2 shared cores), two to three orders of magnitude under NVLink or RDMA."]
    lines += [
        "",
        "Sources (deepseek-ai/DeepEP): `docs/legacy.md`, V1 on H800 (NVLink ~160 GB/s, CX7 400 Gb/s IB): intranode "
        "EP8 dispatch 153 GB/s, combine 158 GB/s (NVLink); internode EP16 43 GB/s, EP32 58/57 GB/s, EP64 51/50 GB/s "
        "(RDMA); low-latency kernels at 128 tokens: EP8 dispatch 77 us / combine 114 us, EP64 173 / 314 us. "
        "`README.md`, V2 on SM90 + CX7: EP 8x2 90 GB/s dispatch / 81 GB/s combine, EP 8x4 61 / 61 GB/s (RDMA, "
        "logical bandwidth including local traffic). H200's NVLink (900 GB/s) is faster than H800's (400 GB/s), "
        "so the intranode row is an upper bound on time; DeepEP publishes no H200 figure.",
        "",
        "What carries over from this machine is the protocol (one header broadcast, then per-rank point-to-point "
        "sends of only the routed tokens, results combined on the leader), not the times: on GPUs the transport "
        "is NCCL (untested here: no multi-GPU machine), and DeepEP's kernels are the natural next step.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=BENCH_ARGS["repeats"])
    parser.add_argument("--out", type=Path, default=RESULTS / "expert_parallel.md")
    ns = parser.parse_args()
    data = run_bench(args={"repeats": ns.repeats})
    ns.out.parent.mkdir(parents=True, exist_ok=True)
    ns.out.write_text(render(data))
    ns.out.with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {ns.out}")


if __name__ == "__main__":
    main()
