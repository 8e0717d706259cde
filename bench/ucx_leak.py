"""The UCX leak trial (issue 33 §3): does a real KV-transfer library's UCX grow a process's RSS under the
defaults, and stay flat with moeguard's settings?

``python -m bench.ucx_leak`` (``make bench-ucx-leak``, ~17 min) runs :mod:`bench.ucx_leak_trial` (two
processes, a prefill and a decode NIXL agent, ``--transfers`` KV-sized blocks over NIXL's UCX backend,
each from a fresh registered buffer) for every UCX build in :data:`BUILDS` and every setting in
:data:`SETTINGS`, ``--reps`` times each, and writes ``bench/results/ucx_leak.md`` and ``ucx_leak.json``:
RSS growth and slope (MiB/min) of both processes, the UCX version and transports UCX reports it used,
and ``moeguard_ucx_info``'s labels with the worker's ``risky`` verdict.

The builds are NIXL's own wheels from PyPI, installed with ``pip --target`` under
``$MOEGUARD_CACHE/nixl/<package>-<version>`` (``~/.cache/moeguard``; pip's cache is reused): NIXL bundles
its UCX, so each wheel is one UCX version. ``nixl-cu12`` 0.8.0 (UCX 1.20.0) predates NIXL's own bound on
the registration cache (ai-dynamo/nixl PR #1210); 1.5.1 (UCX 1.23.0) is current. The 0.8.0 plugin links the
CUDA driver library, so a host without one gets ``hack/cuda_stub.c`` (every call: no device), built with the
machine's C compiler into the same cache.

The field report: vLLM issue 24264 (host RSS growing ~400 MB/min under NIXL's UCX); the cures it led to:
vLLM PR #32181 (``UCX_MEM_MMAP_HOOK_MODE=none``) and ai-dynamo/nixl PR #1210 / vLLM PR #32570
(``UCX_RCACHE_MAX_UNRELEASED=1024``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moeguard_core import contract
from moeguard_runtime.model.kernel_select import cpu_model

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
STUB_SOURCE = ROOT / "hack" / "cuda_stub.c"


@dataclass(frozen=True)
class Build:
    """A NIXL wheel from PyPI and the UCX it bundles."""

    package: str
    version: str
    note: str
    needs_driver_stub: bool = False

    @property
    def name(self) -> str:
        return f"{self.package}=={self.version}"


BUILDS = (
    Build("nixl-cu12", "0.8.0", "before NIXL bounded UCX's registration cache itself (ai-dynamo/nixl PR #1210)",
          needs_driver_stub=True),
    Build("nixl-cu12", "1.5.1", "current; NIXL sets a finite UCX_RCACHE_MAX_UNRELEASED unless the variable is set"),
)
SETTINGS: dict[str, dict[str, str]] = {
    "UCX defaults": {},
    "UCX_RCACHE_MAX_UNRELEASED=inf": {contract.UCX_ENV_RCACHE_MAX_UNRELEASED: "inf"},
    f"UCX_MEM_MMAP_HOOK_MODE={contract.UCX_SAFE_MMAP_HOOK_MODE}": {
        contract.UCX_ENV_MMAP_HOOK_MODE: contract.UCX_SAFE_MMAP_HOOK_MODE},
    "UCX_RCACHE_MAX_UNRELEASED=1024": {contract.UCX_ENV_RCACHE_MAX_UNRELEASED: "1024"},
    "moeguard's default (both)": {contract.UCX_ENV_MMAP_HOOK_MODE: contract.UCX_SAFE_MMAP_HOOK_MODE,
                                  contract.UCX_ENV_RCACHE_MAX_UNRELEASED: str(contract.UCX_SAFE_RCACHE_MAX_UNRELEASED)},
}
"""The settings under trial: UCX's defaults, the unbounded cache spelled out (what NIXL 1.x's own bound is
overridden by), moeguard's two cures alone, and both together (what the operator sets by default:
``spec.ucx.mode`` ``none``; ``rcache`` on AMD GPUs is the 1024 row)."""
LEAK_MIB_PER_MIN = 10.0
"""A slope at or above this (MiB/min) in every repetition counts as growth; the field report's was ~380."""


def cache_dir() -> Path:
    return Path(os.environ.get("MOEGUARD_CACHE") or Path.home() / ".cache" / "moeguard") / "nixl"


def install(build: Build) -> Path:
    """The wheel installed (no dependencies: torch and numpy come from this environment) under the cache;
    returns the directory to put on ``sys.path``.

    Raises:
        subprocess.CalledProcessError: pip could not install it.
    """
    target = cache_dir() / f"{build.package}-{build.version}"
    if (target / ".complete").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(tmp), build.name],
                   check=True)
    (tmp / ".complete").touch()
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    return target


def driver_stub() -> Path:
    """The directory holding the no-device ``libcuda.so.1`` (built once per source hash).

    Raises:
        subprocess.CalledProcessError, FileNotFoundError: no C compiler, or it failed.
    """
    digest = hashlib.sha256(STUB_SOURCE.read_bytes()).hexdigest()[:12]
    out = cache_dir() / f"cuda-stub-{digest}"
    lib = out / "libcuda.so.1"
    if not lib.exists():
        out.mkdir(parents=True, exist_ok=True)
        subprocess.run([os.environ.get("CC", "cc"), "-shared", "-fPIC", "-O2", "-o", str(lib) + ".tmp",
                        str(STUB_SOURCE)], check=True)
        os.replace(str(lib) + ".tmp", lib)
    return out


VERSION = re.compile(r"UCX\s+INFO\s+Version (\S+)")
TRANSPORTS = re.compile(r"UCX\s+INFO\s+(\S+) (?:self|intra-node) cfg#\d+ (.*)$")


def trial(build: Build, site: Path, stub: Path | None, env_extra: dict[str, str], transfers: int,
          mib: float) -> dict[str, Any]:
    """One run of :mod:`bench.ucx_leak_trial` in a fresh process with ``env_extra``; its JSON, plus the UCX
    version and transports from UCX's own log, the exit code and the wall time.

    Raises:
        RuntimeError: the run printed no result.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")} | env_extra
    paths = [str(site), str(ROOT / "operator"), str(ROOT / "runtime"), str(ROOT / "core"), str(ROOT)]
    env["PYTHONPATH"] = os.pathsep.join(paths + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["UCX_LOG_LEVEL"] = "info"  # the version and the transports chosen (UCX logs to stdout)
    env["NIXL_LOG_LEVEL"] = "WARN"
    if stub is not None:
        env["LD_LIBRARY_PATH"] = os.pathsep.join([str(stub)] + ([env["LD_LIBRARY_PATH"]] if env.get(
            "LD_LIBRARY_PATH") else []))
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "bench.ucx_leak_trial", "--transfers", str(transfers),
                           "--mib", str(mib)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if not lines:
        raise RuntimeError(f"{build.name} {env_extra}: no result (exit {done.returncode}):\n{done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(lines[-1])
    log = done.stdout + "\n" + done.stderr  # UCX logs to stdout unless UCX_LOG_FILE says otherwise
    versions = sorted(set(VERSION.findall(log)))
    transports = sorted({f"{m.group(1)}: {' '.join(m.group(2).split())}" for m in
                         map(TRANSPORTS.search, log.splitlines()) if m})
    return result | {"ucx_version": ",".join(versions), "transports": transports, "exit_code": done.returncode,
                     "crash_frame": crash_frame(log), "wall_seconds": round(time.monotonic() - start, 1)}


def crash_frame(log: str) -> str | None:
    """The first frame of a backtrace UCX's signal handler printed that is neither UCX's handler nor libc
    (``library(function+offset)``), or None."""
    frames = log.split("==== backtrace", 1)[1].splitlines() if "==== backtrace" in log else []
    for line in frames:
        m = re.search(r"/([^/\s]+\.so[.\d]*)\(([^)+]*)", line)
        if m and not m.group(1).startswith(("libucs", "libc.")):
            return f"{m.group(1)}({m.group(2)})"
    return None


SIDES = ("prefill", "decode")


def grew_run(run: dict[str, Any], side: str) -> bool:
    """Whether ``side`` of one run grew: its slope at or above :data:`LEAK_MIB_PER_MIN`."""
    return bool(run[side]["slope_mib_per_min"] >= LEAK_MIB_PER_MIN)


def verdict(runs: list[dict[str, Any]], side: str) -> bool:
    """Whether ``side`` grew in every repetition."""
    return bool(runs) and all(grew_run(r, side) for r in runs)


def grown(runs: list[dict[str, Any]]) -> int:
    """How many runs grew on either side."""
    return sum(any(grew_run(r, side) for side in SIDES) for r in runs)


def median(runs: list[dict[str, Any]], side: str, key: str) -> float:
    return statistics.median(r[side][key] for r in runs)


def per_run(runs: list[dict[str, Any]], side: str) -> str:
    return " / ".join(f"{r[side]['slope_mib_per_min']:.1f}" for r in runs)


def render(data: dict[str, Any]) -> str:
    """``ucx_leak.md`` from the JSON (pure)."""
    out = ["# UCX leak trial (issue 33 §3)", "",
           f"Generated by `make bench-ucx-leak` (`python -m bench.ucx_leak`) on {data['cpu']}, "
           f"{data['date']}; {data['transfers']} transfers of {data['block_mib']:g} MiB blocks per run, "
           f"{data['reps']} repetitions per setting, every run a fresh pair of processes.", "",
           "Each run: a decode process registers one receive buffer (a KV cache registered once) and a prefill "
           "process, per transfer, maps a fresh block, registers it with NIXL, `WRITE`s it into the decode "
           "buffer over NIXL's UCX backend, deregisters and unmaps it, then allocates and frees a tensor of the "
           "same size (`bench/ucx_leak_trial.py`). RSS is sampled in both processes; the slope is the "
           "least-squares fit over the second half of the run. The decode buffer is checked against what was "
           "written at every sample.", ""]
    for build in data["builds"]:
        out += [f"## {build['name']}: UCX {build['ucx_version']}", "", build["note"] + ".", "",
                "UCX's transports (its own log, `UCX_LOG_LEVEL=info`):", ""]
        out += [f"- `{t}`" for t in build["transports"]] + [""]
        out += ["| setting | prefill RSS slope MiB/min (median; per run) | prefill growth MiB (median) | "
                "prefill `[heap]` MiB at the end (per run) | decode RSS slope MiB/min (median; per run) | "
                "decode growth MiB (median) | moeguard_ucx_info risky | runs that grew (≥ "
                f"{LEAK_MIB_PER_MIN:g} MiB/min) |", "|---|---|---|---|---|---|---|---|"]
        for name, runs in build["settings"].items():
            heaps = " / ".join(f"{r['prefill'].get('heap_rss_end_mib', 0.0):.0f}" for r in runs)
            out.append(f"| {name} | {median(runs, 'prefill', 'slope_mib_per_min'):.1f} ({per_run(runs, 'prefill')}) | "
                       f"{median(runs, 'prefill', 'growth_mib'):.1f} | {heaps} | "
                       f"{median(runs, 'decode', 'slope_mib_per_min'):.1f} ({per_run(runs, 'decode')}) | "
                       f"{median(runs, 'decode', 'growth_mib'):.1f} | "
                       f"{'yes' if all(r['prefill']['risky'] for r in runs) else 'no'} | "
                       f"{grown(runs)} of {len(runs)} |")
        exits = sorted({r["exit_code"] for runs in build["settings"].values() for r in runs})
        frames = sorted({r["crash_frame"] for runs in build["settings"].values() for r in runs if r["crash_frame"]})
        out += ["", f"Exit codes of the runs: {', '.join(map(str, exits))}; every run printed its result "
                "before it exited" + (" (-11: a segmentation fault at interpreter exit, after the transfers"
                                      + (f"; UCX's handler put it in {', '.join(frames)}" if frames else "")
                                      + ")" if -11 in exits else "") + ".", ""]
    out += ["## Reading", "", reading(data["builds"]), ""]
    return "\n".join(out)


NON_PINNING = ("cma/", "tcp/", "sysv/", "posix/", "self/")
"""UCX transports whose memory domain registers without pinning pages (cross-memory attach, TCP, shared
memory, loopback): a registration cache holding their regions holds no memory."""
CURES = (f"UCX_MEM_MMAP_HOOK_MODE={contract.UCX_SAFE_MMAP_HOOK_MODE}", "UCX_RCACHE_MAX_UNRELEASED=1024",
         "moeguard's default (both)")
UNCURED = ("UCX defaults", "UCX_RCACHE_MAX_UNRELEASED=inf")


def pinning_free(transports: list[str]) -> bool:
    """Whether every transport UCX chose (``name: rma(...) am(...)`` lines) is one of :data:`NON_PINNING`."""
    chosen = {t for line in transports for t in re.findall(r"[(\s]([a-z_0-9]+/[A-Za-z_0-9.:-]+)", line)}
    return bool(chosen) and all(t.startswith(NON_PINNING) for t in chosen)


def reading(builds: list[dict[str, Any]]) -> str:
    """What the runs show, from their figures (pure): reproduced and cured, reproduced and not cured, or not
    reproduced (and whether UCX's transports could pin memory at all)."""
    def grew(build: dict[str, Any], names: tuple[str, ...]) -> bool:
        return any(verdict(build["settings"][n], side) for n in names if n in build["settings"] for side in SIDES)

    lines = []
    for b in builds:
        uncured, cured = grew(b, UNCURED), grew(b, CURES)
        if uncured and not cured:
            lines.append(f"{b['name']} (UCX {b['ucx_version']}): RSS grew without a cure and stayed flat with "
                         "either cure: the leak reproduced and moeguard's settings cure it.")
        elif cured:
            lines.append(f"{b['name']} (UCX {b['ucx_version']}): RSS grew even with a cure set: the settings "
                         "do not cure what grew here.")
        else:
            why = ("every transport UCX chose registers without pinning pages "
                   f"({', '.join(b['transports']) or 'none logged'}), so a registration cache that keeps regions "
                   "past their unmap keeps no memory" if pinning_free(b["transports"]) else
                   "UCX chose a transport that can pin memory, and it still did not grow")
            lines.append(f"{b['name']} (UCX {b['ucx_version']}): no setting grew by {LEAK_MIB_PER_MIN:g} MiB/min "
                         f"or more in every run, defaults included: the leak is not reproduced; {why}.")
        some = {n: runs for n, runs in b["settings"].items() if 0 < grown(runs) < len(runs)}
        in_heap = bool(some)
        if some:
            parts = []
            for n, runs in some.items():
                side = next(side for side in SIDES if any(grew_run(r, side) for r in runs))
                up = [r for r in runs if grew_run(r, side)]
                flat = [r for r in runs if r not in up]
                heap_up = statistics.median(r[side].get("heap_rss_end_mib", 0.0) for r in up)
                heap_flat = statistics.median(r[side].get("heap_rss_end_mib", 0.0) for r in flat)
                growth = statistics.median(r[side]["growth_mib"] for r in up)
                in_heap = in_heap and heap_up - heap_flat >= 0.5 * growth
                parts.append(f"{n}: {grown(runs)} of {len(runs)} ({side} +{growth:.0f} MiB; its `[heap]` ended at "
                             f"{heap_up:.0f} MiB against {heap_flat:.0f} MiB in the runs that stayed flat)")
            lines.append(f"{b['name']}: some runs grew and others of the same setting did not: " + "; ".join(parts)
                         + (". The growth sat in the `[heap]`, malloc's arena (the trial's per-transfer tensor is "
                            "malloc'd and freed there), not in a mapping UCX's registration cache holds."
                            if in_heap else ". The growth was not in the `[heap]`."))
        cured_runs = [r for n in CURES for r in b["settings"].get(n, [])]
        uncured_runs = [r for n in UNCURED for r in b["settings"].get(n, [])]
        if grown(cured_runs) and not grown(uncured_runs) and uncured_runs:
            lines.append(f"{b['name']}: every run that grew had a cure set ({grown(cured_runs)} of {len(cured_runs)} "
                         f"runs with one, 0 of {len(uncured_runs)} without): with this UCX the cures did not keep the "
                         "process flat, the growth came only with them."
                         + (" It is malloc's, and this trial does not show why a UCX setting changes it."
                            if in_heap else ""))
    if not any(grew(b, UNCURED + CURES) for b in builds):
        lines.append("The field leak (vLLM issue 24264) was seen on GPU nodes, where UCX registers through "
                     "memory domains that pin (InfiniBand verbs, CUDA); on a host with neither the trial cannot "
                     "tell the cures from the defaults, and moeguard's UCX settings stay what the field report "
                     "and NIXL's own fix say they are, not a cure measured here.")
    return "\n\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--transfers", type=int, default=1000)
    parser.add_argument("--mib", type=float, default=4.0)
    parser.add_argument("--out", type=Path, default=RESULTS / "ucx_leak")
    parser.add_argument("--render-only", action="store_true", help="rewrite the .md from the .json")
    args = parser.parse_args(argv)
    if args.render_only:
        args.out.with_suffix(".md").write_text(render(json.loads(args.out.with_suffix(".json").read_text())))
        return
    builds = []
    for build in BUILDS:
        site = install(build)
        stub = driver_stub() if build.needs_driver_stub else None
        settings: dict[str, list[dict[str, Any]]] = {}
        for name, env in SETTINGS.items():
            for rep in range(args.reps):
                run = trial(build, site, stub, env, args.transfers, args.mib)
                print(f"{build.name} {name} rep {rep + 1}: prefill {run['prefill']['slope_mib_per_min']:.1f} "
                      f"MiB/min, decode {run['decode']['slope_mib_per_min']:.1f} MiB/min "
                      f"({run['wall_seconds']:.0f} s)", flush=True)
                settings.setdefault(name, []).append(run)
        every = [r for runs in settings.values() for r in runs]
        builds.append({"name": build.name, "note": build.note,
                       "ucx_version": ",".join(sorted({r["ucx_version"] for r in every})),
                       "transports": sorted({t for r in every for t in r["transports"]}), "settings": settings})
    data = {"cpu": cpu_model(), "date": time.strftime("%Y-%m-%d"), "transfers": args.transfers,
            "block_mib": args.mib, "reps": args.reps, "builds": builds}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(render(data))
    print(args.out.with_suffix(".md"))


if __name__ == "__main__":
    main()
