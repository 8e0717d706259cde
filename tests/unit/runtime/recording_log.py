"""A worker log that records its events instead of writing them (unit tests of what the worker logs)."""

from __future__ import annotations

from moeguard_runtime.telemetry.telemetry import RateLimitedLog


class RecordingLog(RateLimitedLog):
    """``events``: ``(name, fields)`` of every :meth:`event` call, forced or not, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[str, dict[str, object]]] = []

    def event(self, name: str, force: bool = False, **kw: object) -> bool:
        self.events.append((name, kw))
        return True
