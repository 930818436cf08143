"""What the runtime tells its caller about an instance: events as they happen, and the outcome."""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["EndedInstance", "InstanceEvent", "InstanceOutcome", "EVENT_KINDS", "OUTCOME_STATUSES"]

EVENT_KINDS = ("message", "result", "error", "trap", "terminated")
OUTCOME_STATUSES = ("ok", "error", "trap", "terminated")


@dataclass(frozen=True)
class InstanceEvent:
    """One event of an instance: a message to its client, or its end (result / error / trap /
    terminated, exactly once, last)."""

    instance_id: str
    kind: str
    data: str

    def __post_init__(self) -> None:
        if self.kind not in EVENT_KINDS:
            raise ValueError(f"InstanceEvent.kind must be one of {EVENT_KINDS}, got {self.kind!r}")

    @property
    def is_final(self) -> bool:
        return self.kind != "message"


@dataclass(frozen=True)
class InstanceOutcome:
    """How an instance ended. status "ok": value is run's result; "error": run returned err
    (value is its message); "trap": the host trapped it (value names the cause); "terminated":
    its client or the contention policy ended it (value says why)."""

    status: str
    value: str

    def __post_init__(self) -> None:
        if self.status not in OUTCOME_STATUSES:
            raise ValueError(f"InstanceOutcome.status must be one of {OUTCOME_STATUSES}, "
                             f"got {self.status!r}")

    @property
    def event_kind(self) -> str:
        """The kind of the final InstanceEvent that carries this outcome."""
        return {"ok": "result", "error": "error"}.get(self.status, self.status)


@dataclass(frozen=True)
class EndedInstance:
    """What the runtime keeps of an ended instance: its outcome and (trimmed) log, answering
    the calls a client may still make (`wait`, `terminate`, `log_lines`) as the Instance did.
    Not the Instance itself: its locks, tables and callbacks (dozens of Python objects) would stay
    alive for every instance kept, and a full garbage collection walks all of them."""

    instance_id: str
    outcome: InstanceOutcome
    log: tuple[str, ...]

    def wait(self, timeout: float | None = None) -> InstanceOutcome:
        return self.outcome

    def terminate(self, reason: str, status: str = "terminated") -> bool:
        return False                       # it has ended already

    def log_lines(self) -> tuple[str, ...]:
        return self.log

    @property
    def num_kept_chars(self) -> int:
        """Characters kept: the log's and the outcome's value."""
        return sum(map(len, self.log)) + len(self.outcome.value)
