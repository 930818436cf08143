"""The cluster's Directory (host/cluster/directory.py) as plain Python: quotas reserved across
replicas, epochs, the export index and what a lost replica takes with it."""
from __future__ import annotations

import pytest

from host.cluster.directory import Directory, TenantQuota
from host.cluster.errors import ReservationError, StaleEpochError


@pytest.fixture
def directory() -> Directory:
    directory = Directory((TenantQuota("acme", max_instances=3, max_kv_pages=10,
                                       max_program_bytes=100),))
    assert (directory.join("r0"), directory.join("r1")) == (1, 1)
    return directory


def test_quotas_hold_across_replicas(directory: Directory) -> None:
    directory.reserve("acme", "r0", 1, 4)
    directory.reserve("acme", "r1", 1, 4)
    with pytest.raises(ReservationError, match="max_kv_pages \\(10\\) with 8 reserved"):
        directory.reserve("acme", "r1", 1, 3)
    third = directory.reserve("acme", "r1", 1, 2)
    with pytest.raises(ReservationError, match="instance quota: 3 running across the cluster"):
        directory.reserve("acme", "r0", 1, 0)
    assert directory.release(third.key) and not directory.release(third.key)
    assert directory.usage("acme") == (2, 8)


def test_unconfigured_tenants_take_the_default_quota() -> None:
    unlimited = Directory()
    unlimited.join("r0")
    for _ in range(50):
        unlimited.reserve("anyone", "r0", 1, 1000)
    capped = Directory(default_quota=TenantQuota("*", 1, 5, 0))
    capped.join("r0")
    capped.reserve("anyone", "r0", 1, 5)
    with pytest.raises(ReservationError, match="instance quota"):
        capped.reserve("anyone", "r0", 1, 0)


def test_a_stale_epoch_reserves_nothing(directory: Directory) -> None:
    assert directory.join("r0") == 2
    with pytest.raises(StaleEpochError, match="epoch 2, not 1"):
        directory.reserve("acme", "r0", 1, 1)
    with pytest.raises(StaleEpochError):
        directory.reserve("acme", "r9", 1, 1)               # never joined


@pytest.mark.parametrize("tenant, pages", [("", 1), (None, 1), ("x" * 300, 1), ("acme", -1),
                                           ("acme", True), ("acme", 1.5)])
def test_reservations_are_validated(directory: Directory, tenant, pages) -> None:
    with pytest.raises(ReservationError):
        directory.reserve(tenant, "r0", 1, pages)


def test_program_bytes_count_once_per_program(directory: Directory) -> None:
    directory.add_program("acme", "a" * 64, 60)
    directory.add_program("acme", "a" * 64, 60)              # the same program again: no-op
    assert directory.program_bytes("acme") == 60
    with pytest.raises(ReservationError, match="max_program_bytes \\(100\\); using 60"):
        directory.add_program("acme", "b" * 64, 41)


def test_export_index_and_a_lost_replica(directory: Directory) -> None:
    assert directory.report_exports("r0", 1, {("acme", "prefix"): 3, ("acme", "solo"): 2})
    assert directory.report_exports("r1", 1, {("acme", "prefix"): 3})   # a mirror
    assert not directory.report_exports("r1", 7, {("acme", "x"): 1})    # stale: ignored
    assert directory.held_pages("acme", ("prefix", "solo")) == {"r0": 5, "r1": 3}
    assert directory.held_pages("other", ("prefix",)) == {}
    kept = directory.reserve("acme", "r1", 1, 2)
    directory.reserve("acme", "r0", 1, 2)

    assert directory.drop_replica("r0", 1) == ["export 'solo' was lost with replica r0"]
    assert directory.holders("acme", "prefix") == {"r1": 3}             # the mirror remains
    assert directory.why_missing("acme", "solo") == "export 'solo' was lost with replica r0"
    assert directory.why_missing("acme", "prefix") is None
    assert directory.usage("acme") == (1, 2) and directory.release(kept.key)


def test_rejoining_lets_the_old_life_go(directory: Directory) -> None:
    directory.report_exports("r0", 1, {("acme", "p"): 2})
    directory.reserve("acme", "r0", 1, 4)
    assert directory.join("r0") == 2
    assert directory.usage("acme") == (0, 0)
    assert directory.why_missing("acme", "p") == "export 'p' was lost with replica r0"
    assert directory.drop_replica("r0", 1) == []              # that life is already gone
    directory.report_exports("r0", 2, {("acme", "p"): 2})     # exported again: not lost now
    assert directory.why_missing("acme", "p") is None


def test_replacing_a_report_forgets_released_exports(directory: Directory) -> None:
    directory.report_exports("r0", 1, {("acme", "p"): 2})
    directory.report_exports("r0", 1, {})
    assert directory.holders("acme", "p") == {}
    assert directory.why_missing("acme", "p") is None         # released, not lost


def test_topics_map_subscribed_replicas_and_leave_with_a_lost_one() -> None:
    directory = Directory()
    for replica_id in ("r0", "r1", "r2"):
        directory.join(replica_id)
    assert directory.subscribe_topic("t", "news", "r0", 1) == ["r1", "r2"]
    assert directory.subscribe_topic("t", "news", "r1", 1) == ["r0", "r2"]
    assert directory.subscribe_topic("t", "news", "r2", 7) == []     # a stale life: no change
    assert directory.topic_map() == {("t", "news"): ["r0", "r1"]}
    directory.unsubscribe_topic("t", "news", "r0", 1)
    assert directory.topic_map() == {("t", "news"): ["r1"]}
    directory.drop_replica("r1", 1)
    assert directory.topic_map() == {}
    with pytest.raises(ReservationError, match="topic must be a string of at most 4096"):
        directory.subscribe_topic("t", "x" * 4097, "r0", 1)
