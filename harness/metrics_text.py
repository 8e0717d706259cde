"""Samples from a worker's Prometheus text exposition (``/metrics``), parsed by prometheus_client.

Pure: text in, samples out. Shared by the headline experiment, the soak and ``harness/stack.py``.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.parser import text_string_to_metric_families

Sample = tuple[str, dict[str, str], float]
"""(sample name, labels, value); a counter's sample name ends in ``_total``, a histogram's
buckets in ``_bucket``."""


def samples(text: str) -> Iterator[Sample]:
    """Every sample in ``text``, in order."""
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            yield s.name, dict(s.labels), float(s.value)


def samples_named(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """(labels, value) of every sample called ``name``."""
    return [(labels, value) for n, labels, value in samples(text) if n == name]
