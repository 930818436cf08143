"""Where a launch goes: pure functions over a snapshot of the replicas' loads.

In order (`place`):
1. export affinity: the launch's affinity key names exports of its tenant; the live replica
   holding most of their pages wins (its import is then local);
2. key affinity: rendezvous (highest random weight) hashing of the key over the live replicas,
   skipping those whose instances would pass `bounded_load` times the mean (consistent hashing
   with bounded loads);
3. otherwise, or with no key: the least loaded replica (instances, then queued passes, then the
   most free pages, then the id, for a total order). Instances come first: the front counts
   them exactly as it places them, while queued passes and free pages are as old as the
   replica's last report.
Affinity of either kind is ignored while the replicas are imbalanced: the busiest holds more than
`balance_abs` instances more than the idlest AND more than `balance_rel` times as many (the rule
of SGLang's cache-aware router).
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Mapping, Sequence

__all__ = ["ReplicaLoad", "PlacementPolicy", "Placement", "is_imbalanced", "export_affinity",
           "rendezvous", "least_loaded", "place"]


@dataclass(frozen=True)
class ReplicaLoad:
    """One replica as placement sees it."""

    replica_id: str
    num_instances: int
    num_queued_passes: int = 0
    num_free_pages: int = 0


@dataclass(frozen=True)
class PlacementPolicy:
    """`bounded_load`: a replica is skipped by key affinity when one more instance would put it
    above this multiple of the mean (>= 1). `balance_abs` / `balance_rel`: the imbalance rule."""

    bounded_load: float = 1.25
    balance_abs: int = 8
    balance_rel: float = 1.5

    def __post_init__(self) -> None:
        if not (self.bounded_load >= 1.0 and math.isfinite(self.bounded_load)):
            raise ValueError(f"PlacementPolicy.bounded_load must be a finite number >= 1, "
                             f"got {self.bounded_load}")
        if self.balance_abs < 0:
            raise ValueError(f"PlacementPolicy.balance_abs must be >= 0, got {self.balance_abs}")
        if not (self.balance_rel >= 1.0 and math.isfinite(self.balance_rel)):
            raise ValueError(f"PlacementPolicy.balance_rel must be a finite number >= 1, "
                             f"got {self.balance_rel}")


@dataclass(frozen=True)
class Placement:
    """The chosen replica and the rule that chose it: "export", "key" or "least_loaded"."""

    replica_id: str
    rule: str


def is_imbalanced(loads: Sequence[ReplicaLoad], policy: PlacementPolicy) -> bool:
    """Whether the busiest replica's instances exceed the idlest's by more than balance_abs AND
    by more than balance_rel times."""
    if len(loads) < 2:
        return False
    counts = [load.num_instances for load in loads]
    busiest, idlest = max(counts), min(counts)
    return busiest - idlest > policy.balance_abs and busiest > policy.balance_rel * idlest


def export_affinity(loads: Sequence[ReplicaLoad],
                    held_pages: Mapping[str, int]) -> str | None:
    """The live replica holding most pages of the named exports (`held_pages`: replica id ->
    pages), ties to the less loaded one; None when no live replica holds any."""
    live = {load.replica_id: load for load in loads}
    holders = [(pages, live[rid]) for rid, pages in held_pages.items()
               if rid in live and pages > 0]
    if not holders:
        return None
    return min(holders, key=lambda held: (-held[0], _load_key(held[1])))[1].replica_id


def _weight(key: str, replica_id: str) -> int:
    digest = hashlib.blake2b(f"{key}\0{replica_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def rendezvous(key: str, loads: Sequence[ReplicaLoad], bounded_load: float) -> str | None:
    """The replica of highest rendezvous weight for `key` among those whose instances plus one
    stay within `bounded_load` times the mean after this launch; None when there are none."""
    if not loads:
        return None
    total = sum(load.num_instances for load in loads) + 1
    capacity = math.ceil(bounded_load * total / len(loads))
    eligible = [load for load in loads if load.num_instances + 1 <= capacity]
    if not eligible:
        return None
    chosen = max(eligible, key=lambda load: (_weight(key, load.replica_id), load.replica_id))
    return chosen.replica_id


def _load_key(load: ReplicaLoad) -> tuple[int, int, int, str]:
    return (load.num_instances, load.num_queued_passes, -load.num_free_pages, load.replica_id)


def least_loaded(loads: Sequence[ReplicaLoad]) -> str:
    """The least loaded replica (ValueError when there is none)."""
    if not loads:
        raise ValueError("least_loaded: no live replica")
    return min(loads, key=_load_key).replica_id


def place(loads: Sequence[ReplicaLoad], policy: PlacementPolicy, *, key: str | None = None,
          held_pages: Mapping[str, int] | None = None) -> Placement:
    """Choose a replica among the live ones in `loads` for a launch with affinity `key` (None:
    none) whose named exports lie as `held_pages` says (replica id -> pages). ValueError when
    `loads` is empty."""
    if not loads:
        raise ValueError("place: no live replica")
    if key is not None and not is_imbalanced(loads, policy):
        chosen = export_affinity(loads, held_pages or {})
        if chosen is not None:
            return Placement(chosen, "export")
        chosen = rendezvous(key, loads, policy.bounded_load)
        if chosen is not None:
            return Placement(chosen, "key")
    return Placement(least_loaded(loads), "least_loaded")
