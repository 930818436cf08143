"""Placement rules (host/cluster/placement.py), pure functions, no Ray."""
from __future__ import annotations

import random
from collections import Counter

import pytest

from host.cluster.placement import (PlacementPolicy, ReplicaLoad, export_affinity,
                                    is_imbalanced, least_loaded, place, rendezvous)


def loads(*counts: int) -> list[ReplicaLoad]:
    return [ReplicaLoad(f"r{i}", n, num_free_pages=100) for i, n in enumerate(counts)]


def test_least_loaded_counts_instances_then_queued_passes_then_free_pages() -> None:
    assert least_loaded(loads(3, 1, 2)) == "r1"
    tied = [ReplicaLoad("r0", 2, 5, 10), ReplicaLoad("r1", 2, 1, 10), ReplicaLoad("r2", 2, 1, 50)]
    assert least_loaded(tied) == "r2"
    with pytest.raises(ValueError, match="no live replica"):
        least_loaded([])


def test_imbalance_needs_both_the_absolute_and_the_relative_gap() -> None:
    policy = PlacementPolicy(balance_abs=8, balance_rel=1.5)
    assert not is_imbalanced(loads(20, 13), policy)      # gap 7: under the absolute bound
    assert not is_imbalanced(loads(40, 30), policy)      # gap 10, but 40 < 1.5 * 30
    assert is_imbalanced(loads(20, 10), policy)          # gap 10 and 20 > 15
    assert not is_imbalanced(loads(50), policy)


def test_export_affinity_picks_the_replica_holding_most_pages() -> None:
    live = loads(5, 0, 0)
    assert export_affinity(live, {"r0": 8, "r2": 3}) == "r0"
    assert export_affinity(live, {"r1": 4, "r2": 4}) == "r1"         # tie: less loaded... equal
    assert export_affinity(live, {"r9": 8}) is None                   # not a live replica
    assert export_affinity(live, {}) is None


def test_rendezvous_is_stable_and_skips_replicas_over_the_bound() -> None:
    live = loads(0, 0, 0, 0)
    chosen = rendezvous("session-7", live, 1.25)
    assert chosen == rendezvous("session-7", list(reversed(live)), 1.25)
    keys = [f"user{i}" for i in range(400)]
    spread = Counter(rendezvous(key, live, 1.25) for key in keys)
    assert set(spread) == {"r0", "r1", "r2", "r3"}
    busy = [ReplicaLoad(l.replica_id, 30 if l.replica_id == chosen else 10) for l in live]
    assert rendezvous("session-7", busy, 1.25) != chosen              # 30+1 > 1.25 * 61/4


def test_place_prefers_export_then_key_then_least_loaded() -> None:
    policy = PlacementPolicy()
    live = loads(3, 2, 4)
    assert place(live, policy, key="prefix", held_pages={"r2": 6}).replica_id == "r2"
    assert place(live, policy, key="prefix", held_pages={"r2": 6}).rule == "export"
    keyed = place(live, policy, key="sess", held_pages={})
    assert keyed.rule == "key" and keyed.replica_id == rendezvous("sess", live, 1.25)
    assert place(live, policy).rule == "least_loaded"
    assert place(live, policy).replica_id == "r1"


def test_affinity_is_ignored_while_imbalanced() -> None:
    policy = PlacementPolicy(balance_abs=8, balance_rel=1.5)
    skewed = loads(30, 2)
    chosen = place(skewed, policy, key="prefix", held_pages={"r0": 6})
    assert (chosen.replica_id, chosen.rule) == ("r1", "least_loaded")


def spread(policy: PlacementPolicy, keyed: bool, seed: int) -> dict[str, int]:
    counts = {f"r{i}": 0 for i in range(4)}
    rng = random.Random(seed)
    for _ in range(64):
        live = [ReplicaLoad(rid, n) for rid, n in counts.items()]
        key = f"k{rng.random()}" if keyed else None
        counts[place(live, policy, key=key).replica_id] += 1
    return counts


def test_unkeyed_load_is_spread_evenly() -> None:
    assert spread(PlacementPolicy(), keyed=False, seed=0) == {f"r{i}": 16 for i in range(4)}


@pytest.mark.parametrize("seed", range(5))
def test_keyed_load_stays_within_the_bounds(seed: int) -> None:
    """64 launches with random keys over 4 replicas: none above 1.25x the mean (rounded up),
    and the gap never past balance_abs + 1 (the imbalance rule then places least loaded)."""
    policy = PlacementPolicy()
    counts = spread(policy, keyed=True, seed=seed)
    assert max(counts.values()) <= 20, counts
    assert max(counts.values()) - min(counts.values()) <= policy.balance_abs + 1, counts


@pytest.mark.parametrize("field, value", [("bounded_load", 0.9), ("bounded_load", float("nan")),
                                          ("balance_abs", -1), ("balance_rel", 0.5)])
def test_policy_is_validated(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        PlacementPolicy(**{field: value})
