"""The four-arm headline's traffic: a 10-minute window of the Azure conversation trace, time
compressed, with a tenant that switches to repetitive prompts partway through. Pure and seeded:
the same schedule for every arm and repetition.

* **window**: the trace's requests that arrive in its first ``window_s`` seconds, every
  ``thin``-th of them (the trace's 5.5 requests/s are far more than two CPU workers of a small
  model serve), arrival times divided by ``time_compression``, lengths × ``length_scale``,
  ``max_tokens`` capped (:func:`harness.loadgen.scale`). Prompts are real text (the Python docs).
* **skew tenant**: from ``skew_at`` (a fraction of the compressed run) on, every
  ``skew_every``-th request carries a repetitive prompt of the same length instead
  (:func:`harness.loadgen.repetitive_prompt`: most tokens go to a few experts).

The second regime change, the leak, is not traffic: :mod:`bench.headline_loop` starts it at
``leak_at`` of the run (the leak fault's lock file).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from harness.loadgen import RequestSpec, prompt_of_length, read_trace, repetitive_prompt, scale

from bench.traffic import PROMPT_STRIDE, Labeled


@dataclass(frozen=True)
class LoopTrafficConfig:
    """Every knob of the traffic; stored with each result."""

    window_s: float = 600.0
    thin: int = 4
    """Every 4th request: about 2-3x what 2 replicas serve within the SLOs on 2 quiet cores (every 12th,
    the pilots' load, was served within the SLOs by every arm once the machine was not shared)."""
    time_compression: float = 8.0
    length_scale: float = 0.25
    max_context: int = 2047
    max_new_tokens_cap: int = 32
    skew_at: float = 0.35
    skew_every: int = 2
    leak_at: float = 0.1

    def __post_init__(self) -> None:
        if self.window_s <= 0 or self.thin < 1 or self.skew_every < 1:
            raise ValueError("window_s must be > 0, thin and skew_every >= 1")
        if not (0 <= self.skew_at <= 1 and 0 <= self.leak_at <= 1):
            raise ValueError("skew_at and leak_at are fractions of the run (0..1)")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def build_loop(cfg: LoopTrafficConfig) -> tuple[list[Labeled], float]:
    """The schedule (sorted by send time) and its duration in compressed seconds (the window /
    compression)."""
    records = [r for r in read_trace() if r.arrival_s < cfg.window_s][::cfg.thin]
    sched = scale(records, time_compression=cfg.time_compression, length_scale=cfg.length_scale,
                  max_context=cfg.max_context, max_new_tokens_cap=cfg.max_new_tokens_cap)
    duration = cfg.window_s / cfg.time_compression
    out: list[Labeled] = []
    skewed_n = 0
    for r in sched.requests:
        skew_phase = r.arrival_s >= cfg.skew_at * duration
        skewed = skew_phase and skewed_n % cfg.skew_every == 0
        if skew_phase:
            skewed_n += 1
        prompt = (repetitive_prompt(r.prompt_tokens, seed=r.index) if skewed
                  else prompt_of_length(r.prompt_tokens, offset=r.index * PROMPT_STRIDE))
        out.append(Labeled(RequestSpec(prompt, r.max_tokens, r.arrival_s), "skew" if skew_phase else "trace", skewed))
    return out, duration
