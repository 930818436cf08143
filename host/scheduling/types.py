"""The scheduler's value types: its policy (when batches fire) and its statistics. See
host/scheduling/scheduler.py for the rules."""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SchedulerPolicy", "SchedulerStats", "PRIORITIES", "POLICY_KINDS", "MAX_CHAIN_STEPS",
           "CPU_CHAIN_STEPS"]

PRIORITIES = ("high", "normal", "low")     # batch order
POLICY_KINDS = ("adaptive", "k-or-t")
MAX_CHAIN_STEPS = 64
CPU_CHAIN_STEPS = MAX_CHAIN_STEPS   # chain_steps unset, no overlap: a chain ends when other work
                                    # is queued, so a longer bound costs no one a wait


@dataclass(frozen=True)
class SchedulerPolicy:
    """When batches fire. k / t_ms are used by "k-or-t" only; max_hold_ms / hold_fraction (the
    bound of the hold after a batch) and run_on_waiter (a thread about to block on a pass runs
    the batch itself when it may fire and none is running) by "adaptive" only.
    max_tokens_per_owner: when more than one
    owner has work, the most input tokens one owner puts into a batch (a longer pass is run in
    chunks of at most that many, engine/chunking.py), so another owner's decode step
    waits at most one batch of max_batch_tokens, and no owner fills it alone.
    overlap: the host resolves a batch and prepares the next one's decode-loop passes while the
    engine runs (host/scheduling/lookahead.py; batches then always run on the engine thread).
    None: the Runtime's choice for its engine (on for a GPU, off on a CPU: runtime.py).
    start_hold_ms: adaptive: a batch of instances' first passes waits for the
    other instances launched and not blocked yet, and for a pause of LAUNCH_BURST_GAP_S (2 ms)
    in the launches, but only until its oldest pass has waited this long
    (host/scheduling/policy.py; 0: never). None: the Runtime's choice for its engine (500 on a
    CPU, where instances starting and a batch share the cores; 0 on a GPU).
    chain_steps: without overlap, a batch of host decode loops' passes runs up to this many
    engine steps before the host resolves it, while nothing else is queued
    (host/scheduling/lookahead.py; 1: every step goes back to the host). None: the Runtime's
    choice for its engine (CPU_CHAIN_STEPS, 64, on a CPU; 1 with overlap, which has its own
    short path)."""

    kind: str = "adaptive"
    max_batch_tokens: int = 4096
    k: int = 8
    t_ms: float = 5.0
    max_hold_ms: float = 10.0
    hold_fraction: float = 0.25
    max_tokens_per_owner: int = 512
    run_on_waiter: bool = True
    overlap: bool | None = None
    start_hold_ms: float | None = None
    chain_steps: int | None = None

    def __post_init__(self) -> None:
        if self.max_tokens_per_owner <= 0:
            raise ValueError(f"SchedulerPolicy.max_tokens_per_owner must be positive, "
                             f"got {self.max_tokens_per_owner}")
        if self.kind not in POLICY_KINDS:
            raise ValueError(f"SchedulerPolicy.kind must be one of {POLICY_KINDS}, "
                             f"got {self.kind!r}")
        if self.max_batch_tokens <= 0:
            raise ValueError(f"SchedulerPolicy.max_batch_tokens must be positive, "
                             f"got {self.max_batch_tokens}")
        if self.k <= 0:
            raise ValueError(f"SchedulerPolicy.k must be positive, got {self.k}")
        if self.t_ms < 0:
            raise ValueError(f"SchedulerPolicy.t_ms must be >= 0, got {self.t_ms}")
        if self.max_hold_ms < 0:
            raise ValueError(f"SchedulerPolicy.max_hold_ms must be >= 0, got {self.max_hold_ms}")
        if self.overlap is not None and not isinstance(self.overlap, bool):
            raise ValueError(f"SchedulerPolicy.overlap must be a bool or None, "
                             f"got {self.overlap!r}")
        if not isinstance(self.run_on_waiter, bool):
            raise ValueError(f"SchedulerPolicy.run_on_waiter must be a bool, "
                             f"got {self.run_on_waiter!r}")
        if self.start_hold_ms is not None and not self.start_hold_ms >= 0:
            raise ValueError(f"SchedulerPolicy.start_hold_ms must be >= 0, "
                             f"got {self.start_hold_ms}")
        if self.chain_steps is not None and (type(self.chain_steps) is not int
                                             or not 1 <= self.chain_steps <= MAX_CHAIN_STEPS):
            raise ValueError(f"SchedulerPolicy.chain_steps must be None or an int in "
                             f"1..{MAX_CHAIN_STEPS}, got {self.chain_steps!r}")
        if self.hold_fraction < 0:
            raise ValueError(f"SchedulerPolicy.hold_fraction must be >= 0, "
                             f"got {self.hold_fraction}")


@dataclass(frozen=True)
class SchedulerStats:
    """Counters since start. batch_size_histogram: (num passes, num batches) ascending.
    num_holds: holds started after a batch (adaptive: an owner was blocked on one of its passes);
    num_hold_timeouts: holds that ended at the bound with an expected owner still missing."""

    num_batches: int
    num_failed_batches: int
    num_forwards: int
    num_copy_items: int
    num_cancelled: int
    num_pending: int
    num_queues: int
    max_batch_size: int
    batch_size_histogram: tuple[tuple[int, int], ...]
    recent_batch_sizes: tuple[int, ...]
    num_holds: int = 0
    num_hold_timeouts: int = 0
