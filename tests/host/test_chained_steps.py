"""Chained steps (SchedulerPolicy.chain_steps, host/scheduling/lookahead.py): a batch of host
loops' passes runs several engine steps before the host resolves it. Over the fake engine (its
outputs a function of the tokens each position attends to, its pages recording each slot's
token), with readers that take outputs in bulk (a reader waiting for each output is never
chained past it): the outputs and the KV equal those step by step, in fewer resolutions."""
from __future__ import annotations

import dataclasses
import time

import pytest

from engine.errors import RequestError
from host.bindings import decoding
from host.runtime import Runtime
from host.runtime_config import RuntimeConfig
from host.scheduling.types import SchedulerPolicy
from tests.host.fake_engine import FakeEngine
from tests.host.test_decode_loop import Setup, _expected, _options, _sampler
from tests.host.test_scheduler import pass_on


@pytest.fixture
def setups():
    made: list[Setup] = []

    def make(prompt: list[int], chain_steps: int = 4, min_outputs: int = 64, **kwargs) -> Setup:
        made.append(Setup(prompt, chain_steps=chain_steps, **kwargs))
        made[-1].min_outputs = min_outputs
        return made[-1]
    yield make
    for setup in made:
        setup.close()
        assert setup.pool.num_free() == setup.pool.num_pages, "every page returns"


def _resolutions(setup: Setup, rep: int) -> list[int]:
    """The number of steps each resolution of the loop `rep` carried (filled as it runs)."""
    loop = setup.tables.decode_loops.get("test", rep)
    sizes: list[int] = []
    on_pass = loop._on_pass

    def counted(outcome: object) -> None:
        sizes.append(len(outcome) if isinstance(outcome, tuple) else 1)
        on_pass(outcome)
    loop._on_pass = counted
    return sizes


def test_outputs_and_kv_equal_step_by_step_in_fewer_resolutions(setups) -> None:
    setup = setups([10, 11, 12, 13, 14])           # 2 pages, the second with 1 slot used
    rep = setup.submit(13)
    sizes = _resolutions(setup, rep)
    setup.start()
    expected = _expected(setup.prompt, 13)
    assert setup.read_all(rep) == expected
    assert sizes == [1, 4, 4, 4]                  # the prompt's pass, then chains of 4
    added = decoding.added_pages(setup.ctx, None, rep)   # 5 + 12 slots: 5 pages
    sequence = setup.pages.sequence_pages(setup.sequence_id)
    assert len(added) == 3 and sequence == setup.prompt_page_ids + added
    assert setup.slots(sequence)[:17] == setup.prompt + expected[:12]
    assert setup.engine.statistics().num_requests == 13
    # every step is a batch in the statistics, as the engine saw it
    assert setup.scheduler.statistics().num_batches == len(setup.engine.batches)


def test_a_chain_grows_the_sequence_into_new_pages_as_the_steps_would(setups) -> None:
    setup = setups([1, 2, 3])                     # one page, one free slot after the prompt
    rep = setup.submit(9)
    sizes = _resolutions(setup, rep)
    forward, calls = setup.engine.forward, []
    setup.engine.forward = lambda batch: calls.append(batch) or forward(batch)
    setup.start()
    expected = _expected(setup.prompt, 9)
    assert setup.read_all(rep) == expected
    assert sizes == [1, 4, 4]                     # the prompt's pass (a future: never chained)
    assert len(calls) == len(setup.engine.batches) == 9     # none the engine refused
    added = decoding.added_pages(setup.ctx, None, rep)   # 3 + 8 slots: 3 pages
    sequence = setup.pages.sequence_pages(setup.sequence_id)
    assert len(added) == 2 and sequence == setup.prompt_page_ids + added
    assert setup.slots(sequence)[:11] == setup.prompt + expected[:8]


def test_every_chained_step_ends_its_pins_once_it_has_run(setups) -> None:
    setup = setups([1, 2, 3])
    rep = setup.submit(9)
    setup.start()
    assert setup.read_all(rep) == _expected(setup.prompt, 9)
    added = decoding.added_pages(setup.ctx, None, rep)
    num_free = setup.pool.num_free()
    setup.pages.free_pages(added)                 # a pin still in flight would defer them
    assert setup.pool.num_free() == num_free + len(added)


def test_pages_freed_during_a_chain_return_once_it_is_over(setups) -> None:
    """The chained steps hold no pins of their own: the pass that began the chain holds the
    instance's until the chain is resolved, so a page freed meanwhile waits for that."""
    setup = setups([1, 2, 3], chain_steps=64)
    spare_page_ids = setup.pages.allocate_pages(2)
    rep = setup.submit(12)
    forward, free_counts = setup.engine.forward, []

    def forward_freeing(batch):                   # frees the spare pages before the 4th pass
        if setup.engine.statistics().num_batches == 3:
            setup.pages.free_pages(spare_page_ids)
        free_counts.append(setup.pool.num_free())
        return forward(batch)
    setup.engine.forward = forward_freeing
    num_free = setup.pool.num_free()
    setup.start()
    assert setup.read_all(rep) == _expected(setup.prompt, 12)
    # passes 2-12 are one chain: the loop had added one page by the 4th, the freed two wait
    assert len(free_counts) == 12 and max(free_counts[3:]) <= num_free
    num_added = len(decoding.added_pages(setup.ctx, None, rep))
    assert setup.pool.num_free() == num_free + len(spare_page_ids) - num_added


def test_each_chained_step_is_counted_as_soon_as_it_has_run(setups) -> None:
    setup = setups([1, 2, 3, 4, 5], chain_steps=64)
    rep = setup.submit(12)
    sizes = _resolutions(setup, rep)
    forward, seen = setup.engine.forward, []

    def forward_counted(batch):                   # the batches counted before each forward
        seen.append(setup.scheduler.statistics().num_batches)
        return forward(batch)
    setup.engine.forward = forward_counted
    setup.start()
    assert setup.read_all(rep) == _expected(setup.prompt, 12)
    assert sizes == [1, 11]                       # the prompt's pass, then one chain
    assert seen[1:] == list(range(seen[1], seen[1] + 11))   # the chain's steps, one by one
    assert setup.scheduler.statistics().num_batches == 12


def test_a_stop_token_ends_the_chain_with_no_step_after_it(setups) -> None:
    setup = setups([20, 21, 22, 23, 24])
    expected = _expected(setup.prompt, 12)
    index = next(i for i in range(2, 12) if expected[i] not in expected[:i])
    rep = setup.submit(12, stop_token_ids=[expected[index]])
    setup.start()
    assert setup.read_all(rep) == expected[:index + 1]
    assert setup.engine.statistics().num_requests == index + 1


def test_a_reader_waiting_for_each_output_gets_each_on_its_own(setups) -> None:
    setup = setups([5, 6, 7], min_outputs=1)
    rep = setup.submit(6)
    sizes = _resolutions(setup, rep)
    loop, forward = setup.tables.decode_loops.get("test", rep), setup.engine.forward

    def forward_once_read(batch):                 # each step runs with the reader back waiting
        deadline = time.monotonic() + 10
        while loop._waiter is None and time.monotonic() < deadline:
            time.sleep(0.001)
        return forward(batch)
    setup.engine.forward = forward_once_read
    setup.start()
    assert setup.read_all(rep) == _expected(setup.prompt, 6)
    assert setup.batch_sizes == [1] * 6 and sizes == [1] * 6


def test_work_queued_during_a_chain_runs_after_the_step_it_came_in(setups) -> None:
    setup = setups([1, 2, 3, 4, 5])               # the chain's pages: the pool's first two
    rep = setup.submit(8)
    forward = setup.engine.forward
    other = []

    def forward_then_submit(batch):
        results = forward(batch)
        if len(setup.engine.batches) == 2:        # the first chained step has run
            other.append(setup.scheduler.submit_forward(("b", 0), "normal",
                                                        pass_on(30, [9], 1)))
        return results
    setup.engine.forward = forward_then_submit
    setup.start()
    assert setup.read_all(rep) == _expected(setup.prompt, 8)
    assert other[0].result(timeout=10) is not None
    third = [request.page_ids for request in setup.engine.batches[2].requests]
    assert (30,) in third                         # in the very next batch


def test_a_chain_ends_quietly_at_the_quota_as_the_loop_would(setups) -> None:
    setup = setups([1, 2, 3], page_quota=1)       # one page, one free slot after the first pass
    rep = setup.submit(10)
    setup.start()
    assert setup.read_all(rep) == _expected(setup.prompt, 2)   # the second pass fills the page
    assert setup.pages.sequence_pages(setup.sequence_id) == setup.prompt_page_ids


def test_a_chained_step_the_engine_fails_ends_the_loop_after_its_outputs(setups) -> None:
    setup = setups([1, 2, 3, 4, 5])
    rep = setup.submit(12)
    sizes = _resolutions(setup, rep)
    forward = setup.engine.forward

    def fail_the_third(batch):
        if len(setup.engine.batches) == 2:        # the prompt's pass and the loop's next ran
            setup.engine.fail_next_batches(1)
        return forward(batch)
    setup.engine.forward = fail_the_third
    setup.start()
    outputs = setup.read_all(rep)
    assert outputs[:-1] == _expected(setup.prompt, 2)
    assert outputs[-1] == "engine failed the batch: fake engine: injected failure"
    assert sizes == [1, 2]                        # a result, then the failed step's error


def test_a_pass_the_engine_refuses_in_a_step_ends_its_loop_alone(setups) -> None:
    setup = setups([1, 2, 3, 4, 5])
    other_id = setup.pages.create_sequence()       # a second loop of the instance, own pages
    setup.pages.sequence_append(other_id, setup.pages.allocate_pages(2))
    rep = setup.submit(10)
    other = decoding.submit_decode(setup.ctx, setup.tables.queues.create("normal"), other_id,
                                   [7, 8, 9, 10, 11], list(range(5)), 1, _sampler(), _options(),
                                   10, []).rep
    forward = setup.engine.forward
    refused = []

    def refuse_one(batch):                        # the first chained step: refuse its first pass
        if len(setup.engine.batches) == 2 and not refused:
            refused.append(batch.requests[0].page_ids)
            raise RequestError(0, "page_ids", "refused by the test")
        return forward(batch)
    setup.engine.forward = refuse_one
    setup.start()
    outputs = {rep: setup.read_all(rep), other: setup.read_all(other)}
    sequence_ids = {rep: setup.sequence_id, other: other_id}
    refused_rep = next(r for r in outputs
                       if refused[0] == setup.pages._physical_ids(
                           setup.pages._sequences[sequence_ids[r]])[:len(refused[0])])
    going_on = other if refused_rep == rep else rep
    prompt = {rep: setup.prompt, other: [7, 8, 9, 10, 11]}
    assert outputs[refused_rep][-1].startswith("engine failed the batch: request 0")
    assert outputs[refused_rep][:-1] == _expected(prompt[refused_rep], 2)
    assert outputs[going_on] == _expected(prompt[going_on], 10)   # the other loop goes on


@pytest.mark.parametrize("value", [0, 65, 2.0, True, "4"])
def test_chain_steps_out_of_range_is_refused(value) -> None:
    with pytest.raises(ValueError, match="chain_steps"):
        SchedulerPolicy(chain_steps=value)


def test_the_runtime_chains_up_to_64_steps_on_a_cpu_and_none_with_overlap(tmp_path) -> None:
    config = RuntimeConfig(cache_dir=tmp_path)
    with Runtime(FakeEngine(num_pages=8, page_size=4), config) as runtime:
        assert runtime.scheduler.policy.chain_steps == 64
    overlapped = dataclasses.replace(config, scheduler=SchedulerPolicy(overlap=True))
    with Runtime(FakeEngine(num_pages=8, page_size=4), overlapped) as runtime:
        assert runtime.scheduler.policy.chain_steps == 1
