"""The contention policy (host/kv/contention.py) on its own and in a runtime: tenants get their
guaranteed share, exports count against their tenant, an instance within its (tenant's) share is
never suspended or terminated for one holding more, and the victim comes from the tenant most over
its share. The runtime tests here run with swap_mb=0 (no suspension: a victim is terminated,
"swap space full"), so they test who is chosen; tests/host/test_suspension.py the suspensions."""
from __future__ import annotations

import pytest

from host.kv.contention import Holder, PoolView, next_victim, tenant_shares
from host.runtime_config import RuntimeConfig
from tests.host.components import components, make_runtime, program_cache_dir  # noqa: F401
from tests.host.fake_engine import FakeEngine
from tests.host.test_runtime import Events, launch


def view(holders, shares, tenant_pages=None, num_pages=16):
    holders = tuple(Holder(i, t, n, k) for k, (i, t, n) in enumerate(holders))
    if tenant_pages is None:
        tenant_pages = {}
        for holder in holders:
            tenant_pages[holder.tenant] = tenant_pages.get(holder.tenant, 0) + holder.num_pages
    return PoolView(num_pages, holders, tenant_pages, shares)


def test_shares_split_what_configured_shares_leave():
    assert tenant_shares(16, {"a": 10}, {"a", "b", "c"}) == {"a": 10, "b": 3, "c": 3}
    assert tenant_shares(16, {}, {"default"}) == {"default": 16}


def test_same_tenant_victim_must_hold_more_than_fair_and_than_the_requester():
    hoarder_first = view([("hoarder", "d", 12), ("polite", "d", 4)], {"d": 16})
    assert next_victim(hoarder_first, "hoarder", 4) is None           # polite holds 4 <= 8
    assert next_victim(hoarder_first, "polite", 2).instance_id == "hoarder"
    two_over = view([("a", "d", 6), ("b", "d", 7), ("c", "d", 3)], {"d": 16})
    assert next_victim(two_over, "a", 1) is None                      # b holds 7, a would hold 7


def test_cross_tenant_victim_only_from_a_tenant_over_its_share_for_one_within():
    pool = view([("a1", "a", 6), ("a2", "a", 5), ("b1", "b", 4), ("c1", "c", 1)],
                {"a": 6, "b": 6, "c": 4})
    victim = next_victim(pool, "b1", 2)
    assert victim.instance_id == "a1"                     # tenant a: 11 of 6, most pages first
    assert next_victim(pool, "b1", 3) is None             # b would hold 7, over its 6
    within = view([("a1", "a", 8), ("b1", "b", 8)], {"a": 8, "b": 8})
    assert next_victim(within, "b1", 1) is None


def test_exports_count_against_their_tenant():
    pool = view([("b1", "b", 2)], {"a": 8, "b": 8}, tenant_pages={"a": 9, "b": 2})
    assert next_victim(pool, "b1", 2) is None             # a's pages are exports: no instance
    with_instance = view([("a1", "a", 1), ("b1", "b", 2)], {"a": 8, "b": 8},
                         tenant_pages={"a": 9, "b": 2})
    assert next_victim(with_instance, "b1", 2).instance_id == "a1"


def test_kv_shares_are_validated():
    with pytest.raises(ValueError, match="named twice"):
        RuntimeConfig(kv_shares=(("a", 1), ("a", 2)))
    with pytest.raises(ValueError, match=">= 0"):
        RuntimeConfig(kv_shares=(("a", -1),))


def test_runtime_refuses_shares_over_the_pool(program_cache_dir):  # noqa: F811
    from host.runtime import Runtime
    with pytest.raises(ValueError, match="more than the pool of 16"):
        Runtime(FakeEngine(num_pages=16, page_size=4),
                RuntimeConfig(cache_dir=program_cache_dir, kv_shares=(("a", 9), ("b", 8))))


def _hold(runtime, components, num_pages, **kwargs):  # noqa: F811
    events = Events()
    instance_id = launch(runtime, components, "holder", "x" * num_pages, on_event=events, **kwargs)
    assert events.next() == ("message", "holding")
    return instance_id, events


def test_early_hoarder_cannot_terminate_a_later_fair_instance(components, make_runtime):  # noqa: F811
    engine = FakeEngine(num_pages=16, page_size=4)
    runtime = make_runtime(engine, swap_mb=0)
    solo = runtime.wait(launch(runtime, components, "generate", "abcdefghij"), timeout=10).value
    hoarder, _ = _hold(runtime, components, 12)
    polite, polite_events = _hold(runtime, components, 4)
    runtime.send(hoarder, "xxxx")                         # pool full; polite holds 4 <= 8
    outcome = runtime.wait(hoarder, timeout=5)
    assert outcome.status == "trap" and "out of KV pages" in outcome.value
    assert runtime.list_instances()[0].instance_id == polite

    hoarder, _ = _hold(runtime, components, 12)           # again, and now a newcomer needs 4
    outcome = runtime.wait(launch(runtime, components, "generate", "abcdefghij"), timeout=10)
    assert (outcome.status, outcome.value) == ("ok", solo)
    hoarder_outcome = runtime.wait(hoarder, timeout=5)
    assert hoarder_outcome.status == "trap"                       # a policy end: a trap now
    assert "swap space full" in hoarder_outcome.value
    assert "over its fair share of 5" in hoarder_outcome.value   # 16 // 3 instances
    runtime.send(polite, "")
    assert runtime.wait(polite, timeout=5).value == "released"
    assert runtime.statistics().pages.num_free == 16


def test_tenant_within_its_share_takes_pages_back_from_one_over(components,  # noqa: F811
                                                                make_runtime):
    runtime = make_runtime(FakeEngine(num_pages=16, page_size=4), kv_shares=(("a", 8), ("b", 8)),
                           swap_mb=0)
    hog, _ = _hold(runtime, components, 10, tenant="a")   # borrows 2 of b's share
    fair, fair_events = _hold(runtime, components, 2, tenant="a")
    b1, b_events = _hold(runtime, components, 4, tenant="b")
    runtime.send(b1, "xxxx")                              # b: 8 of 8 -> a over its share
    assert b_events.next() == ("message", "holding")
    outcome = runtime.wait(hog, timeout=5)
    assert outcome.status == "trap" and "tenant 'a' held 12 pages" in outcome.value
    runtime.send(fair, "x" * 6)                           # a and b: 8 of 8 each, pool full
    assert fair_events.next() == ("message", "holding")
    runtime.send(b1, "x")                                 # b would be over its own share: no
    outcome = runtime.wait(b1, timeout=5)
    assert outcome.status == "trap" and "out of KV pages" in outcome.value
    assert "hard quota of 8" in outcome.value             # no wait could serve it
    assert [info.instance_id for info in runtime.list_instances()] == [fair]
    runtime.send(fair, "")
    assert runtime.wait(fair, timeout=5).value == "released"
    assert runtime.statistics().pages.num_free == 16


def test_persistent_exports_are_capped_at_their_tenant_share(components,  # noqa: F811
                                                             make_runtime):
    runtime = make_runtime(FakeEngine(num_pages=16, page_size=4), kv_shares=(("a", 8), ("b", 8)))
    for index in range(4):                                # 4 x 2 pages: a's whole share
        events = Events()
        exporter = launch(runtime, components, "exporter", f"e{index}", "persistent",
                          tenant="a", on_event=events)
        assert events.next() == ("message", "exported")
        runtime.send(exporter, "bye")
        assert runtime.wait(exporter, timeout=5).value == "done"
    outcome = runtime.wait(launch(runtime, components, "exporter", "e4", "persistent",
                                  tenant="a"), timeout=5)
    assert outcome.status == "error"
    assert "would hold 10 KV pages, over the tenant's export limit of 8" in outcome.value
    b1, _ = _hold(runtime, components, 8, tenant="b")     # b's share is whole
    runtime.send(b1, "")
    assert runtime.wait(b1, timeout=5).value == "released"
    assert runtime.pool_view().tenant_pages == {"a": 8}
    for index in range(4):
        assert runtime.exports.release("a", f"e{index}", "test") is None
    assert runtime.statistics().pages.num_free == 16
