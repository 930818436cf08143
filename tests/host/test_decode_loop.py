"""forward.submit-decode: the host-run decode loop, through its bindings, over the fake engine.

The fake engine's outputs are a function of the tokens a position attends to, so the expected
tokens are `fake_next_token` applied step by step; its pages record which token sits in each slot,
so the KV layout after a loop (the prompt and every output but the last, the pages the loop
added appended in order) is checked slot by slot. Every test runs without and with overlapped
batches (SchedulerPolicy.overlap: each loop's next pass prepared while its pass runs, its token
fed by the engine) and with chained steps (SchedulerPolicy.chain_steps 4); the outputs, pages
and KV are the same.
"""
from __future__ import annotations

import dataclasses
import time
from types import SimpleNamespace

import pytest
from wasmtime.component import Record

from host.bindings import decoding
from host.scheduling.decode_loop import MAX_UNREAD_OUTPUTS
from host.bindings.samplers import sampler_spec
from host.errors import TrapError
from host.kv import ExportRegistry, InstancePages, PageAllocator
from host.bindings.tables import InstanceTables
from host.scheduling.scheduler import BatchScheduler, SchedulerPolicy
from tests.host.fake_engine import FakeEngine, fake_next_token

PAGE_SIZE = 4


def _sampler(kind: str = "greedy") -> Record:
    record = Record()
    record.kind, record.temperature, record.seed = kind, 1.0, None
    for name, value in (("top-k", 0), ("top-p", 1.0), ("min-p", 0.0), ("num-top", 4)):
        setattr(record, name, value)
    return record


def _options() -> Record:
    record = Record()
    record.logprobs, record.generation = None, None
    for name, value in (("logit-bias", []), ("allowed-token-ids", None), ("presence-penalty", 0.0),
                        ("frequency-penalty", 0.0), ("repetition-penalty", 1.0)):
        setattr(record, name, value)
    return record


class Setup:
    """One instance's binding context over a fake engine (its scheduler not started until
    `start`), with a sequence holding `prompt`'s slots."""

    def __init__(self, prompt: list[int], num_pool_pages: int = 32,
                 page_quota: int | None = None, overlap: bool = False,
                 chain_steps: int | None = None) -> None:
        self.engine = FakeEngine(num_pages=num_pool_pages, page_size=PAGE_SIZE)
        self.pool = PageAllocator(num_pool_pages)
        self.pages = InstancePages(self.pool, ExportRegistry(self.pool), instance_id="a",
                                   tenant="t", page_quota=page_quota or num_pool_pages,
                                   page_size=PAGE_SIZE,
                                   vocab_size=self.engine.model_config.vocab_size)
        self.overlap = overlap
        self.scheduler = BatchScheduler(self.engine, SchedulerPolicy(overlap=overlap,
                                                                     chain_steps=chain_steps))
        self.tables = InstanceTables(self.pages)
        self.queue_id = self.tables.queues.create("normal")
        self.ctx = SimpleNamespace(
            instance_id="a", tables=self.tables,
            services=SimpleNamespace(scheduler=self.scheduler, model_info=SimpleNamespace(
                vocab_size=self.engine.model_config.vocab_size)),
            wait_future=lambda future, call: future.result(timeout=10))
        self.prompt = prompt
        self.min_outputs = 1
        self.batch_sizes: list[int] = []       # outputs per next() that returned some
        self.sequence_id = self.pages.create_sequence()
        num_pages = -(-len(prompt) // PAGE_SIZE)
        self.prompt_page_ids = self.pages.allocate_pages(num_pages)
        self.pages.sequence_append(self.sequence_id, self.prompt_page_ids)

    def start(self) -> None:
        self.scheduler.start()

    def submit(self, max_tokens: int, *, stop_token_ids=(), sampler: Record | None = None) -> int:
        last_page_len = len(self.prompt) - (len(self.prompt_page_ids) - 1) * PAGE_SIZE
        stream = decoding.submit_decode(
            self.ctx, self.queue_id, self.sequence_id, self.prompt,
            list(range(len(self.prompt))), last_page_len, sampler or _sampler(), _options(),
            max_tokens, list(stop_token_ids))
        return stream.rep

    def read_all(self, rep: int) -> list:
        outputs: list = []
        while True:
            batch = decoding.next_outputs(self.ctx, None, rep, self.min_outputs)
            if isinstance(batch, str) or not batch:
                return outputs + ([batch] if isinstance(batch, str) else [])
            self.batch_sizes.append(len(batch))
            outputs += [output.payload for output in batch]

    def slots(self, page_ids) -> list[int]:
        physical = [self.pages._pages[pid].physical_id for pid in page_ids]
        return [t for pid in physical for t in self.engine.page_tokens(pid)]

    def close(self) -> None:
        self.tables.decode_loops.stop_all()
        self.scheduler.cancel_owner("a")
        self.scheduler.close()
        self.tables.clear()


def _expected(prompt: list[int], num_tokens: int) -> list[int]:
    context, tokens = list(prompt), []
    for _ in range(num_tokens):
        tokens.append(fake_next_token(context))
        context.append(tokens[-1])
    return tokens


MODES = {"no-overlap": {}, "overlap": {"overlap": True}, "chained": {"chain_steps": 4}}


@pytest.fixture(params=list(MODES))
def setups(request):
    made: list[Setup] = []

    def make(prompt: list[int], **kwargs) -> Setup:
        made.append(Setup(prompt, **MODES[request.param], **kwargs))
        return made[-1]
    yield make
    for setup in made:
        setup.close()
        assert setup.pool.num_free() == setup.pool.num_pages, "every page returns"


def test_outputs_equal_step_by_step_and_the_kv_holds_all_but_the_last(setups) -> None:
    setup = setups([10, 11, 12, 13, 14])          # 2 pages, the second with 1 slot used
    setup.start()
    rep = setup.submit(9)
    expected = _expected(setup.prompt, 9)
    assert setup.read_all(rep) == expected
    # KV: 5 + 8 slots = 4 pages: the loop added two, in order
    added = decoding.added_pages(setup.ctx, None, rep)
    sequence = setup.pages.sequence_pages(setup.sequence_id)
    assert len(added) == 2 and sequence == setup.prompt_page_ids + added
    assert setup.pages.num_pages_held == 4
    assert setup.slots(sequence)[:13] == setup.prompt + expected[:8]
    assert setup.engine.statistics().num_requests == 9


def test_a_stop_token_ends_the_loop_after_it(setups) -> None:
    setup = setups([20, 21, 22])
    setup.start()
    expected = _expected(setup.prompt, 12)
    index = next(i for i in range(2, 12) if expected[i] not in expected[:i])
    rep = setup.submit(12, stop_token_ids=[expected[index]])
    assert setup.read_all(rep) == expected[:index + 1]
    # with overlap, the pass after the stop token was prepared (and run) before it was known
    assert setup.engine.statistics().num_requests == index + 1 + setup.overlap


def test_a_page_taken_by_a_pass_ahead_of_the_end_is_given_back(setups) -> None:
    """The stop token's pass fills its page: the pass prepared after it (overlap) took a new
    page, which the loop gives back; the sequence ends as without overlap."""
    setup = setups([20, 21, 22])
    setup.start()
    expected = _expected(setup.prompt, 14)
    index = next(i for i in range(1, 14)
                 if (len(setup.prompt) + i) % PAGE_SIZE == 0 and expected[i] not in expected[:i])
    rep = setup.submit(14, stop_token_ids=[expected[index]])
    assert setup.read_all(rep) == expected[:index + 1]
    kv_len = len(setup.prompt) + index                  # the stop token's slot is not written
    added = decoding.added_pages(setup.ctx, None, rep)
    assert len(setup.prompt_page_ids) + len(added) == -(-kv_len // PAGE_SIZE)
    assert setup.pages.sequence_pages(setup.sequence_id) == setup.prompt_page_ids + added
    assert setup.slots(setup.prompt_page_ids + added)[:kv_len] == setup.prompt + expected[:index]
    assert setup.pool.num_pages - setup.pool.num_free() == len(setup.prompt_page_ids) + len(added)


def test_the_loop_ends_quietly_at_the_quota(setups) -> None:
    setup = setups([1, 2, 3], page_quota=1)       # one page, one free slot after the first pass
    setup.start()
    rep = setup.submit(10)
    assert setup.read_all(rep) == _expected(setup.prompt, 2)   # the second pass fills the page
    assert setup.pages.sequence_pages(setup.sequence_id) == setup.prompt_page_ids
    assert decoding.added_pages(setup.ctx, None, rep) == []


def test_the_loop_ends_quietly_when_the_pool_is_short(setups) -> None:
    setup = setups([1, 2, 3, 4, 5, 6, 7], num_pool_pages=3)   # 2 pages; the pool has 1 more
    setup.pages.allocate_pages(1)                 # taken: none left, and nothing to reclaim
    setup.start()
    rep = setup.submit(10)
    assert setup.read_all(rep) == _expected(setup.prompt, 2)
    assert decoding.added_pages(setup.ctx, None, rep) == []


def test_stop_returns_the_pass_in_flight_then_ends(setups) -> None:
    setup = setups([5, 6])
    rep = setup.submit(50)                        # queued: the scheduler has not started
    decoding.stop(setup.ctx, None, rep)
    setup.start()
    assert setup.read_all(rep) == _expected(setup.prompt, 1)
    assert setup.engine.statistics().num_requests == 1


def test_an_engine_failure_is_the_err_after_the_outputs_before_it(setups) -> None:
    setup = setups([7, 8, 9])
    rep = setup.submit(5)
    setup.engine.fail_next_batches(1)
    setup.start()
    outputs = setup.read_all(rep)
    assert outputs == ["engine failed the batch: fake engine: injected failure"]


def test_a_sequence_destroyed_while_the_loop_runs_traps_at_next(setups) -> None:
    setup = setups([1, 2, 3])
    rep = setup.submit(5)
    setup.pages.destroy_sequence(setup.sequence_id)
    setup.start()
    assert decoding.next_outputs(setup.ctx, None, rep, 1)[0].payload == _expected(setup.prompt, 1)[0]
    with pytest.raises(TrapError, match="forward.submit-decode: unknown sequence id"):
        decoding.next_outputs(setup.ctx, None, rep, 1)


@pytest.mark.parametrize("field, kwargs, message", [
    ("max-tokens", {"max_tokens": 0}, "max-tokens 0 outside 1..65536"),
    ("max-tokens", {"max_tokens": 65537}, "max-tokens 65537 outside 1..65536"),
    ("stop ids", {"stop_token_ids": list(range(65))}, "at most 64 stop-token-ids"),
    ("stop ids", {"stop_token_ids": [1 << 20]}, "each below"),
    ("sampler", {"sampler": _sampler("distribution")}, "greedy or sample, not distribution"),
])
def test_bad_arguments_trap_and_queue_nothing(setups, field, kwargs, message) -> None:
    setup = setups([1, 2])
    kwargs = dict(kwargs)
    max_tokens = kwargs.pop("max_tokens", 4)
    with pytest.raises(TrapError, match=message):
        setup.submit(max_tokens, **kwargs)
    assert setup.scheduler.statistics().num_pending == 0 and len(setup.tables.decode_loops) == 0


def test_stopping_every_loop_then_cancelling_leaves_nothing_queued(setups) -> None:
    """The instance's end: after stop_all no loop submits again, whatever is in flight."""
    setup = setups([3, 4, 5])
    setup.start()
    rep = setup.submit(1000)
    time.sleep(0.05)
    setup.tables.decode_loops.stop_all()
    setup.scheduler.cancel_owner("a")
    time.sleep(0.05)
    num_requests = setup.engine.statistics().num_requests
    time.sleep(0.05)
    assert setup.engine.statistics().num_requests == num_requests
    assert setup.scheduler.statistics().num_pending == 0
    outputs = setup.read_all(rep)
    assert 1 <= len(outputs) < 1000


def test_defer_wake_outside_a_batch_resolution_is_refused() -> None:
    with BatchScheduler(FakeEngine()) as scheduler:
        assert scheduler.defer_wake(lambda: None) is False


def test_a_loop_waits_for_its_reader_past_max_unread_outputs(setups) -> None:
    setup = setups([1, 2, 3], num_pool_pages=64)
    setup.start()
    rep = setup.submit(150)
    deadline = time.monotonic() + 5
    while (setup.engine.statistics().num_requests < MAX_UNREAD_OUTPUTS
           and time.monotonic() < deadline):
        time.sleep(0.01)
    time.sleep(0.1)                                  # it would run on, were it not held
    assert setup.engine.statistics().num_requests == MAX_UNREAD_OUTPUTS
    assert setup.read_all(rep) == _expected(setup.prompt, 150)


def test_next_waits_for_min_outputs_unless_the_loop_is_over(setups) -> None:
    setup = setups([4, 5, 6], num_pool_pages=32)
    setup.min_outputs = 10
    rep = setup.submit(25)
    setup.start()
    assert setup.read_all(rep) == _expected(setup.prompt, 25)
    assert all(size >= 10 for size in setup.batch_sizes[:-1]) and sum(setup.batch_sizes) == 25


def test_submit_chained_calls_on_done_then_on_outcome_and_refuses_when_closed(setups) -> None:
    setup = setups([1, 2])
    prepared = setup.pages.prepare(setup.sequence_id, [1, 2], [0, 1], 2, [1],
                                   [sampler_spec(setup.ctx, "test", 0, _sampler(), None)])
    calls: list = []
    prepared = dataclasses.replace(prepared, on_done=lambda: calls.append("on_done"))
    assert setup.scheduler.submit_chained(("a", setup.queue_id), "normal", prepared,
                                          lambda outcome: calls.append(outcome))
    assert setup.scheduler.synchronize_future(("a", setup.queue_id)) is None   # not waited for
    setup.start()
    deadline = time.monotonic() + 5
    while len(calls) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert calls[0] == "on_done" and calls[1].outputs == (_expected([1, 2], 1)[0],)
    setup.scheduler.close()
    calls.clear()
    assert not setup.scheduler.submit_chained(("a", setup.queue_id), "normal", prepared,
                                              lambda outcome: calls.append(outcome))
    assert calls == ["on_done"]


def test_next_tokens_returns_the_tokens_next_returns(setups) -> None:
    setup = setups([7, 8, 9])
    setup.start()
    rep = setup.submit(11)
    token_ids: list[int] = []
    while batch := decoding.next_token_ids(setup.ctx, None, rep, 3):
        assert all(type(token_id) is int for token_id in batch)
        token_ids += batch
    assert token_ids == _expected(setup.prompt, 11)


def test_after_max_tokens_outputs_no_pass_is_in_flight(setups) -> None:
    """Once the reader has max-tokens outputs, `next` ends without waiting and the KV holds
    every output but the last (with overlap too: no pass was prepared past the bound)."""
    setup = setups([3, 4, 5])
    setup.start()
    rep, num_tokens = setup.submit(6), 6
    token_ids: list[int] = []
    while len(token_ids) < num_tokens:
        token_ids += decoding.next_token_ids(setup.ctx, None, rep, 1)
    setup.ctx.wait_future = lambda future, call: pytest.fail(f"{call} waited after the end")
    assert decoding.next_token_ids(setup.ctx, None, rep, 1) == []
    kv_len = len(setup.prompt) + num_tokens - 1
    sequence = setup.pages.sequence_pages(setup.sequence_id)
    assert setup.slots(sequence)[:kv_len] == setup.prompt + token_ids[:-1]
    assert setup.engine.statistics().num_requests == num_tokens
