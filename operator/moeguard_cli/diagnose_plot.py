"""``moeguard diagnose --plot FILE.png``: the report's timeline drawn with matplotlib (Agg, no display).

Five panels sharing the time axis: memory in use with the soft and hard limits, expert skew, the budgets
in effect (log scale: tokens and batches differ by orders of magnitude), refusals per second by reason, and
batches in flight / queue / long requests. Each finding's onset (``since``) is a vertical line on every
panel. A missing value is a gap in its line, never 0.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from moeguard_cli.diagnose_report import GiB, Report

if TYPE_CHECKING:
    from matplotlib.figure import Figure

PANELS = 5
DOTS: dict[str, Any] = {"marker": ".", "markersize": 3}
"""Every sample is marked: a lone one between two gaps shows."""


def figure(report: Report) -> Figure:
    """``report``'s timeline as a matplotlib Figure of :data:`PANELS` axes (not attached to pyplot)."""
    from matplotlib.figure import Figure

    tl = report.timeline
    times = tl.times

    def gib(values: list[float | None]) -> list[float]:
        return [float("nan") if v is None else v / GiB for v in values]

    def nan(values: list[float | None]) -> list[float]:
        return [float("nan") if v is None else v for v in values]

    fig = Figure(figsize=(10, 11), layout="constrained")
    axes = fig.subplots(PANELS, 1, sharex=True)
    fig.suptitle(f"moeguard diagnose {report.namespace}/{report.name} (last {report.minutes} min, UTC)")
    mem, skew, budgets, refusals, batches = axes
    mem.plot(times, gib(tl.values["memory_bytes"]), label="memory in use", color="tab:blue", **DOTS)
    mem.plot(times, gib(tl.values["soft_limit_bytes"]), label="soft limit", color="tab:orange", linestyle="--", **DOTS)
    mem.plot(times, gib(tl.values["hard_limit_bytes"]), label="hard limit", color="tab:red", linestyle="--", **DOTS)
    mem.set_ylabel("GiB")
    skew.plot(times, nan(tl.values["skew_ratio"]), label="skew (top / median expert)", color="tab:purple", **DOTS)
    skew.set_ylabel("ratio")
    for key in ("max_prefill_tokens", "max_decode_tokens", "max_batch_requests", "max_concurrent_batches"):
        budgets.plot(times, nan(tl.values[key]), label=key, **DOTS)
    budgets.set_yscale("log")
    budgets.set_ylabel("budget")
    for reason, values in tl.refusals_by_reason.items():
        refusals.plot(times, nan(values), label=reason or "(none)", **DOTS)
    refusals.set_ylabel("refusals/s")
    refusals.set_ylim(bottom=0)
    for key, label in (("batches_in_flight", "batches in flight"), ("queue_requests", "queue"),
                       ("long_requests_running", "long requests")):
        batches.plot(times, nan(tl.values[key]), label=label, **DOTS)
    batches.set_ylabel("count")
    batches.set_ylim(bottom=0)
    for f in report.findings:
        for ax in axes:
            ax.axvline(f.since, color="black", linestyle=":", linewidth=1)
        mem.annotate(f.kind, (f.since, 1.0), xycoords=("data", "axes fraction"), rotation=90, va="top",
                     fontsize=8)
    for ax in axes:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="upper left", fontsize=8)
        ax.grid(alpha=0.3)
    return fig


def plot(report: Report, path: Path) -> None:
    """Draw ``report``'s timeline into the PNG ``path`` (Agg: no display needed).

    Raises:
        OSError: ``path`` cannot be written.
    """
    figure(report).savefig(path, dpi=80, format="png")
