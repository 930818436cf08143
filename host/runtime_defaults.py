"""The runtime's choices where the scheduler policy leaves them open (None): overlap, the start
hold and chained steps, by where the engine runs."""
from __future__ import annotations

import dataclasses

from engine.protocol import EngineLike
from host.scheduling.types import CPU_CHAIN_STEPS, SchedulerPolicy

__all__ = ["overlap_by_default", "start_hold_by_default", "resolved_policy"]


def overlap_by_default(engine: EngineLike) -> bool:
    """SchedulerPolicy.overlap when left None: on for an engine on a GPU (its forward leaves the
    CPU to the host), off for one on the CPU (the host's work takes the engine's cores: its
    decode forwards run slower beside it by about what it saves between them;
    docs/performance/2026-11-26-wasm-path-time-overlap-decided.md)."""
    return getattr(getattr(engine, "device", None), "type", None) == "cuda"


def start_hold_by_default(engine: EngineLike) -> float:
    """SchedulerPolicy.start_hold_ms when left None: 500 ms for an engine on the CPU (a batch
    run while instances start shares the cores with them, and prompts cost less together in
    one batch than split over several; docs/performance/2026-11-26-instances-starting-together.md),
    0 on a GPU."""
    return 0.0 if overlap_by_default(engine) else 500.0


def resolved_policy(policy: SchedulerPolicy, engine: EngineLike) -> SchedulerPolicy:
    """`policy` with its open fields (overlap, start_hold_ms, chain_steps) chosen for `engine`."""
    if policy.overlap is None:
        policy = dataclasses.replace(policy, overlap=overlap_by_default(engine))
    if policy.start_hold_ms is None:
        policy = dataclasses.replace(policy, start_hold_ms=start_hold_by_default(engine))
    if policy.chain_steps is None:   # overlap has its own short path between steps
        policy = dataclasses.replace(policy, chain_steps=1 if policy.overlap else CPU_CHAIN_STEPS)
    return policy
