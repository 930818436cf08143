"""Fair batches: priorities order work only within an owner; owners and tenants (groups) share
batches by tokens served; a long pass of one owner runs in chunks beside another owner's decode
steps, with exactly the results it has when run whole (the fake engine is page-accurate)."""
from __future__ import annotations

import pytest

from engine.batch import ForwardBatch, ForwardRequest, SamplerSpec
from engine.chunking import split_request, truncate_row
from host.scheduling.scheduler import BatchScheduler, SchedulerPolicy
from host.scheduling.work import PreparedForward
from tests.host.fake_engine import FakeEngine

GREEDY = SamplerSpec()


def request(first_token: int, num_tokens: int, page_ids: tuple[int, ...], *, page_size: int = 4,
            num_context: int = 0, output_indices: tuple[int, ...] | None = None,
            mask=None) -> ForwardRequest:
    """A pass of `num_tokens` tokens after `num_context` slots already written in `page_ids`."""
    kv_len = num_context + num_tokens
    num_pages = -(-kv_len // page_size)
    outputs = (num_tokens - 1,) if output_indices is None else output_indices
    return ForwardRequest(tuple(range(first_token, first_token + num_tokens)),
                          tuple(range(num_context, kv_len)), page_ids[:num_pages],
                          kv_len - (num_pages - 1) * page_size, outputs,
                          (GREEDY,) * len(outputs), mask)


def test_truncate_row():
    assert truncate_row((3, 2, 5), 4) == (3, 1)
    assert truncate_row((0, 6), 6) == (0, 6)
    assert sum(truncate_row((2, 2, 2, 2), 5)) == 5


@pytest.mark.parametrize("num_first", [1, 5, 8, 12])
def test_split_request_gives_the_whole_pass_results(num_first):
    mask = tuple((1, 1, 14) if k % 2 else (16,) for k in range(13))   # odd rows hide slot 1
    whole = request(10, 13, (0, 1, 2, 3), num_context=3, output_indices=(12, 2, 7, 3), mask=mask)
    engine_whole, engine_split = FakeEngine(num_pages=4), FakeEngine(num_pages=4)
    context = request(1, 3, (0,))
    for engine in (engine_whole, engine_split):
        engine.forward(ForwardBatch((context,)))
    (expected,) = engine_whole.forward(ForwardBatch((whole,)))
    first, rest, first_outputs, rest_outputs = split_request(whole, num_first, page_size=4)
    (first_result,) = engine_split.forward(ForwardBatch((first,)))
    (rest_result,) = engine_split.forward(ForwardBatch((rest,)))
    outputs = [None] * 4
    for slots, result in ((first_outputs, first_result), (rest_outputs, rest_result)):
        for slot, output in zip(slots, result.outputs):
            outputs[slot] = output
    assert tuple(outputs) == expected.outputs
    assert [engine_split.page_tokens(p) for p in range(4)] == \
        [engine_whole.page_tokens(p) for p in range(4)]


def _run(policy: SchedulerPolicy, submissions, groups=None) -> tuple[FakeEngine, list]:
    """Queue every submission before the engine thread starts, then run them all."""
    engine = FakeEngine(num_pages=64, page_size=4)
    scheduler = BatchScheduler(engine, policy)
    for owner, group in (groups or {}).items():
        scheduler.set_owner_group(owner, group)
    futures = [scheduler.submit_forward(key, priority, PreparedForward(req))
               for key, priority, req in submissions]
    scheduler.start()
    results = [future.result(timeout=10) for future in futures]
    scheduler.close()
    return engine, results


def test_high_priority_of_one_owner_does_not_starve_another():
    hog = [(("hog", q), "high", request(100 + 8 * q, 8, (4 * q, 4 * q + 1))) for q in range(5)]
    polite = [(("polite", 0), "normal", request(200, 1, (40,)))]
    engine, _ = _run(SchedulerPolicy(max_batch_tokens=8), hog + polite)
    owners = [["polite" if r.token_ids[0] >= 200 else "hog" for r in batch.requests]
              for batch in engine.batches]
    assert owners[0] == ["hog"] and owners[1][0] == "polite"   # was: after all five


def test_priorities_still_order_one_owners_queues():
    submissions = [(("one", 0), "low", request(100, 4, (0,))),
                   (("one", 1), "normal", request(110, 4, (1,))),
                   (("one", 2), "high", request(120, 4, (2,)))]
    engine, _ = _run(SchedulerPolicy(max_batch_tokens=4), submissions)
    assert [b.requests[0].token_ids[0] for b in engine.batches] == [120, 110, 100]


def test_tenants_share_batches_equally_whatever_their_number_of_instances():
    submissions = []
    for owner, base in (("a1", 100), ("a2", 150), ("b1", 200)):
        submissions += [((owner, 0), "normal", request(base + k, 4, (base // 10 + k,)))
                        for k in range(12)]
    groups = {"a1": "tenant-a", "a2": "tenant-a", "b1": "tenant-b"}
    engine, _ = _run(SchedulerPolicy(max_batch_tokens=4), submissions, groups)
    first = [b.requests[0].token_ids[0] for b in engine.batches[:12]]
    counts = {name: sum(1 for t in first if base <= t < base + 50)
              for name, base in (("a1", 100), ("a2", 150), ("b1", 200))}
    assert counts == {"a1": 3, "a2": 3, "b1": 6}


def test_long_pass_is_chunked_beside_another_owners_decode_with_the_same_result():
    long_pass = request(100, 40, tuple(range(10)), output_indices=(39, 5, 20))
    solo, solo_results = _run(SchedulerPolicy(), [(("long", 0), "normal", long_pass)])
    assert len(solo.batches) == 1                            # alone: not chunked
    decodes = [(("decode", 0), "normal", request(200 + k, 1, (20 + k,))) for k in range(6)]
    mixed, mixed_results = _run(SchedulerPolicy(max_tokens_per_owner=8),
                                [(("long", 0), "normal", long_pass)] + decodes)
    assert mixed_results[0] == solo_results[0]
    sizes = [[len(r.token_ids) for r in batch.requests] for batch in mixed.batches]
    assert all(sum(s) <= 8 + 1 for s in sizes), sizes        # no batch carries more than a chunk
    assert sum(len(r.token_ids) for b in mixed.batches for r in b.requests) == 46
    assert [mixed.page_tokens(p) for p in range(10)] == [solo.page_tokens(p) for p in range(10)]
