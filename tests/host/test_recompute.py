"""Restore by recompute (issue 53): a suspended instance's pages released with the tokens that
wrote them recorded, and recomputed by a prefill into fresh pages on restore. Only a plain
sequence of token passes is recomputed; anything else (a copy into a page, a masked pass, a
rewind, a token fed from a pass not yet run, an import) makes the victim swapped whole. Under an
oversubscribed pool every instance completes with the outputs of an unconstrained pool, on the
fake engine and on the real model in float32."""
from __future__ import annotations

import time

import pytest

from engine.batch import GREEDY, ForwardBatch
from host.kv import ExportRegistry, InstancePages, PageAllocator
from host.kv.page_log import PageLogs
from host.restore_costs import RestoreCosts, measure_restore_costs
from tests.host.components import components, make_runtime, program_cache_dir  # noqa: F401
from tests.host.fake_engine import FakeEngine
from tests.host.test_runtime import launch

RECOMPUTE = lambda num_pages, num_tokens: True        # noqa: E731 -- always, when possible


def _table(engine: FakeEngine, allocator: PageAllocator) -> InstancePages:
    return InstancePages(allocator, ExportRegistry(allocator), instance_id="a", tenant="t",
                         page_quota=allocator.num_pages, page_size=engine.page_size)


def _run(engine: FakeEngine, prepared) -> tuple:
    outputs = engine.forward(ForwardBatch((prepared.request,)))[0].outputs
    prepared.on_done()
    return outputs


def _grown(engine: FakeEngine, pages: InstancePages, prompt: list[int], num_steps: int):
    """A sequence prefilled with `prompt` then decoded `num_steps` greedy steps (one page
    allocated whenever the last is full). Returns (sequence id, tokens, kv length, last output)."""
    page_size = engine.page_size
    sequence = pages.create_sequence()
    tokens = list(prompt)
    pages.sequence_append(sequence, pages.allocate_pages(-(-len(tokens) // page_size)))
    n = len(tokens)
    (token,) = _run(engine, pages.prepare(sequence, tokens, range(n), n - (n - 1) // page_size
                                          * page_size, (n - 1,), (GREEDY,)))
    for _ in range(num_steps):
        tokens.append(token)
        n = len(tokens)
        if n > len(pages.sequence_pages(sequence)) * page_size:
            pages.sequence_append(sequence, pages.allocate_pages(1))
        (token,) = _run(engine, pages.prepare(sequence, (token,), (n - 1,),
                                              n - (n - 1) // page_size * page_size, (0,),
                                              (GREEDY,)))
    return sequence, tokens, token


def _suspend(engine: FakeEngine, pages: InstancePages, choose=RECOMPUTE, charge=None):
    assert pages.begin_suspend() and pages.wait_drained(1.0)
    out = pages.swap_out(engine.read_pages, charge or (lambda nbytes: None),
                         engine.kv_page_nbytes, choose)
    assert out.refused is None
    return out


def test_recomputed_pages_hold_the_same_tokens_local_ids_kept():
    engine = FakeEngine(num_pages=16, page_size=4)
    allocator = PageAllocator(16)
    pages = _table(engine, allocator)
    sequence, tokens, last = _grown(engine, pages, [5, 6, 7, 8, 9, 10], 7)   # 13 tokens: 4 pages
    page_ids = pages.sequence_pages(sequence)
    before = [engine.page_tokens(pages._pages[pid].physical_id)[:len(tokens) - 4 * i]
              for i, pid in enumerate(page_ids)]
    out = _suspend(engine, pages)
    assert (out.recompute, out.num_pages, out.num_recomputed, out.nbytes) == (True, 4, 4, 0)
    assert engine.num_pages_read == 0 and allocator.num_free() == 16
    engine.scribble(allocator.allocate(16), 99)               # another owner wrote them all
    allocator.release(list(range(16)))
    fresh = allocator.allocate(4)
    num_batches = len(engine.batches)
    assert pages.swap_in(fresh, engine.write_pages, engine.forward) == 0
    (recompute,) = engine.batches[num_batches:]               # one prefill pass, 13 tokens
    assert recompute.requests[0].token_ids == tuple(tokens)
    assert recompute.requests[0].positions == tuple(range(len(tokens)))
    assert pages.sequence_pages(sequence) == page_ids and engine.num_pages_written == 0
    after = [engine.page_tokens(pages._pages[pid].physical_id)[:len(tokens) - 4 * i]
             for i, pid in enumerate(page_ids)]
    assert after == before
    # the next step reads the recomputed pages: the same output as without the suspension
    reference = FakeEngine(num_pages=16, page_size=4)
    ref_pages = _table(reference, PageAllocator(16))
    ref_sequence, _, ref_last = _grown(reference, ref_pages, [5, 6, 7, 8, 9, 10], 7)
    assert ref_last == last
    n = len(tokens) + 1
    step = lambda e, p, s: _run(e, p.prepare(s, (last,), (n - 1,), n - 12, (0,), (GREEDY,)))  # noqa: E731
    assert step(engine, pages, sequence) == step(reference, ref_pages, ref_sequence)


def test_a_fork_recomputes_its_own_pages_over_the_shared_prefix():
    """A fork's shared full pages stay resident (refcount 2); its own pages are recomputed
    over them; the parent, suspended alone, recomputes the pages it alone holds."""
    engine = FakeEngine(num_pages=16, page_size=4)
    allocator = PageAllocator(16)
    pages = _table(engine, allocator)
    parent, tokens, last = _grown(engine, pages, list(range(1, 9)), 0)        # 2 full pages
    shared = pages.share_pages(pages.sequence_pages(parent))
    child = pages.create_sequence()
    pages.sequence_append(child, shared + pages.allocate_pages(1))
    _run(engine, pages.prepare(child, (last, 3), (8, 9), 2, (1,), (GREEDY,)))
    out = _suspend(engine, pages)
    assert (out.recompute, out.num_pages, out.num_recomputed) == (True, 1, 1)
    fresh = allocator.allocate(1)
    num_batches = len(engine.batches)
    pages.swap_in(fresh, engine.write_pages, engine.forward)
    (recompute,) = engine.batches[num_batches:]
    assert recompute.requests[0].token_ids == (last, 3)
    assert engine.page_tokens(fresh[0])[:2] == (last, 3)


@pytest.mark.parametrize("spoil", ["copy", "mask", "fed", "adapter step", "adapter pass"])
def test_a_page_not_from_plain_passes_makes_the_victim_swapped(spoil):
    """The recompute runs the base model: a page an adapter wrote is not recomputable."""
    engine = FakeEngine(num_pages=16, page_size=4)
    allocator = PageAllocator(16)
    pages = _table(engine, allocator)
    sequence, tokens, last = _grown(engine, pages, [5, 6, 7, 8, 9, 10], 1)    # 7 tokens
    page_ids = pages.sequence_pages(sequence)
    if spoil == "copy":
        copy = pages.copy_tokens_request(page_ids[0], page_ids[1], 0, 3, 1)
        engine.copy_tokens(copy.copies)
        copy.on_done()
    elif spoil == "mask":
        pages.mask_tokens(page_ids[0], 0, 1, True)
        _run(engine, pages.prepare(sequence, (last,), (7,), 4, (0,), (GREEDY,)))
    elif spoil == "fed":
        step = pages.prepare(sequence, (0,), (7,), 4, (0,), (GREEDY,), reclaim=False,
                             fed=True)
        step[0].on_done()
    else:
        pages.bind_adapter("adapters.bind", sequence, "tone")
        tokens = (last,) if spoil == "adapter step" else (last, last)
        if len(tokens) == 2:                         # 9 slots: a third page
            pages.sequence_append(sequence, pages.allocate_pages(1))
        prepared = pages.prepare(sequence, tokens, tuple(range(7, 7 + len(tokens))),
                                 4 if len(tokens) == 1 else 1, (len(tokens) - 1,),
                                 (GREEDY,))
        assert prepared.request.adapter == "tone"
        _run(engine, prepared)
    out = _suspend(engine, pages)
    assert not out.recompute and engine.num_pages_read == out.num_pages > 0


def test_a_rewind_cuts_the_record_and_the_pages_are_recomputed_as_rewritten():
    """Slot 5 written again (a rejected draft, a rewind): the record is cut there and goes on;
    the recompute writes the tokens as they are now."""
    engine = FakeEngine(num_pages=16, page_size=4)
    allocator = PageAllocator(16)
    pages = _table(engine, allocator)
    sequence, tokens, last = _grown(engine, pages, [5, 6, 7, 8, 9, 10], 1)    # 7 tokens
    _run(engine, pages.prepare(sequence, (11,), (5,), 2, (0,), (GREEDY,)))   # back to 6
    _run(engine, pages.prepare(sequence, (12,), (6,), 3, (0,), (GREEDY,)))
    out = _suspend(engine, pages)
    assert out.recompute and out.num_recomputed == 2
    num_batches = len(engine.batches)
    pages.swap_in(allocator.allocate(2), engine.write_pages, engine.forward)
    (recompute,) = engine.batches[num_batches:]
    assert recompute.requests[0].token_ids == (5, 6, 7, 8, 9, 11, 12)


def test_a_page_whose_context_changed_after_it_was_written_is_swapped():
    """Page 0 rewritten after page 1 attended to it: page 1's slots hold what the old page 0
    gave, so it cannot be recomputed (the victim is swapped), until page 1 is written again
    from its first slot."""
    logs = PageLogs(2, lambda page_id: False)
    sequence = object()
    logs.note_pass(sequence, [0, 1], 0, 0, [1, 2, 3], [0, 1, 2], plain=True)
    assert logs.plan([0, 1], lambda page_id: True).num_tokens == 3
    logs.note_pass(sequence, [0], 0, 1, [9], [1], plain=True)       # page 0's slot 1 again
    assert logs.plan([0, 1], lambda page_id: True) is None
    logs.note_pass(sequence, [0, 1], 0, 2, [4], [2], plain=True)     # page 1 from slot 0
    plan = logs.plan([0, 1], lambda page_id: True)
    assert plan.waves[0][0].token_ids == (1, 9, 4)


def test_an_imported_page_alone_with_the_importer_is_swapped():
    engine = FakeEngine(num_pages=16, page_size=4)
    allocator = PageAllocator(16)
    exports = ExportRegistry(allocator)
    exporter = InstancePages(allocator, exports, instance_id="x", tenant="t", page_quota=16,
                             page_size=4)
    sequence, _, _ = _grown(engine, exporter, [1, 2, 3, 4], 0)
    assert exporter.export_pages("e", exporter.sequence_pages(sequence), False) is None
    pages = InstancePages(allocator, exports, instance_id="a", tenant="t", page_quota=16,
                          page_size=4)
    assert len(pages.import_pages("e")) == 1
    exporter.release_all()                         # the importer alone holds the page now
    out = _suspend(engine, pages)
    assert (out.recompute, out.num_pages, engine.num_pages_read) == (False, 1, 1)


def test_the_swap_space_full_recomputes_a_victim_that_can_be():
    engine = FakeEngine(num_pages=16, page_size=4)
    allocator = PageAllocator(16)
    pages = _table(engine, allocator)
    _grown(engine, pages, [5, 6, 7, 8, 9], 3)
    out = _suspend(engine, pages, choose=lambda num_pages, num_tokens: False,
                   charge=lambda nbytes: "swap space full: test")
    assert out.recompute and out.num_pages == 2 and engine.num_pages_read == 0


def test_a_page_never_written_is_restored_computing_nothing():
    engine = FakeEngine(num_pages=16, page_size=4)
    allocator = PageAllocator(16)
    pages = _table(engine, allocator)
    pages.allocate_pages(3)
    out = _suspend(engine, pages)
    assert (out.recompute, out.num_pages, out.num_recomputed) == (True, 3, 0)
    num_batches = len(engine.batches)
    pages.swap_in(allocator.allocate(3), engine.write_pages, engine.forward)
    assert len(engine.batches) == num_batches and len(pages.physical_ids()) == 3


def test_page_logs_mark_a_write_through_another_context_dirty():
    logs = PageLogs(4, lambda page_id: False)
    seq_a, seq_b = object(), object()
    logs.note_pass(seq_a, [0, 1], 0, 0, list(range(6)), list(range(6)), plain=True)
    assert logs.plan([0, 1], lambda page_id: True).num_tokens == 6
    logs.note_pass(seq_b, [2, 1], 0, 6, [9], [6], plain=True)    # page 1 after page 2 now
    assert logs.plan([0, 1], lambda page_id: True) is None


def test_page_logs_chain_a_long_sequence_in_constant_space_per_page():
    """2,000 pages grown one by one: each record names the page before it (no context tuple),
    and the plan is one pass over all of their tokens."""
    logs = PageLogs(2, lambda page_id: False)
    sequence, page_ids = object(), []
    for page_id in range(2000):
        page_ids.append(page_id)
        logs.note_pass(sequence, page_ids, 0, 2 * page_id, [7, 8], [2 * page_id, 2 * page_id + 1],
                       plain=True)
    assert all(logs._logs[pid].head == () for pid in page_ids)
    plan = logs.plan(page_ids, lambda page_id: True)
    ((group,),) = plan.waves
    assert (group.own, group.prefix, plan.num_tokens) == (tuple(page_ids), (), 4000)
    assert logs.plan(page_ids[1000:], lambda page_id: True).waves[0][0].prefix == tuple(
        page_ids[:1000])                          # the first 1000 stay resident: a prefix


def test_page_logs_a_page_written_again_through_a_repeat_is_dirty():
    logs = PageLogs(2, lambda page_id: False)
    sequence = object()
    logs.note_pass(sequence, [0], 0, 0, [1, 2], [0, 1], plain=True)
    logs.note_pass(sequence, [0, 1, 0], 0, 4, [3], [4], plain=True)    # page 0 again, after 1
    assert logs.plan([0, 1], lambda page_id: True) is None


def test_restore_costs_choose_the_cheaper_and_a_mode_fixes_it():
    costs = RestoreCosts(copy_s_per_page=1e-3, prefill_s_per_token=1e-4)
    assert costs.recompute_cheaper(num_pages=2, num_tokens=19)
    assert not costs.recompute_cheaper(num_pages=2, num_tokens=21)
    assert RestoreCosts(1.0, 0.0, "swap").recompute_cheaper(2, 0) is False
    engine = FakeEngine(num_pages=16, page_size=4)
    allocator = PageAllocator(16)
    measured = measure_restore_costs(engine, allocator)
    assert measured.copy_s_per_page > 0 and measured.prefill_s_per_token > 0
    assert allocator.num_free() == 16                      # its pages returned
    with pytest.raises(ValueError, match="restore mode"):
        measure_restore_costs(engine, allocator, "copy")


# ------------------------------------------------------------------ the runtime
def test_an_oversubscribed_pool_recomputes_and_outputs_match(components,  # noqa: F811
                                                             make_runtime):
    """Six growers peaking at 6 pages each (36) on a pool of 16, restore by recompute: every
    one completes with the outputs of a roomy pool; pages recomputed, none copied."""
    prompts = [f"prompt {i}!" for i in range(6)]
    roomy = make_runtime(FakeEngine(num_pages=64, page_size=4))
    expected = {p: roomy.wait(launch(roomy, components, "grower", p), timeout=20).value
                for p in prompts}
    engine = FakeEngine(num_pages=16, page_size=4)
    runtime = make_runtime(engine, restore="recompute")
    program = runtime.load_program(components.component("grower"))
    ids = {p: runtime.launch(program, [p]) for p in prompts}
    outcomes = {p: runtime.wait(i, timeout=60) for p, i in ids.items()}
    assert {p: (o.status, o.value) for p, o in outcomes.items()} == {
        p: ("ok", expected[p]) for p in prompts}
    stats = runtime.statistics().suspensions
    assert stats.num_restores >= 1 and stats.num_recomputed_pages >= 1
    assert stats.num_swapped_pages == 0 and engine.num_pages_read == 0
    assert runtime.statistics().pages.num_free == 16


def test_the_real_model_recomputes_to_the_same_float32_tokens(components,  # noqa: F811
                                                              make_runtime):
    """The default model in float32: growers suspended and restored by recompute decode the
    tokens they decode on a roomy pool (K/V recomputed by a prefill round differently in the
    last bits than the decode steps that wrote them; greedy tokens are the same)."""
    from engine import load_default_engine

    engine = load_default_engine(dtype="float32", page_size=16, num_pages=24, progress=False,
                                 seed=0)
    prompts = [f"Once upon a time, in land number {i}," for i in range(4)]
    decode = "x" * 24                              # 24 tokens: up to 3 pages each, 12 in all
    roomy = make_runtime(engine)
    expected = {p: roomy.wait(launch(roomy, components, "grower", p, decode),
                              timeout=120).value for p in prompts}
    roomy.close()
    small = _SmallerPool(engine, 8)
    runtime = make_runtime(small, restore="recompute")
    program = runtime.load_program(components.component("grower"))
    ids = {p: runtime.launch(program, [p, decode]) for p in prompts}
    outcomes = {p: runtime.wait(i, timeout=240) for p, i in ids.items()}
    assert {p: (o.status, o.value) for p, o in outcomes.items()} == {
        p: ("ok", expected[p]) for p in prompts}
    stats = runtime.statistics().suspensions
    assert stats.num_recomputed_pages >= 1 and stats.num_swapped_pages == 0


class _SmallerPool:
    """The real engine with only its first `num_pages` pages offered to the host."""

    def __init__(self, engine, num_pages: int) -> None:
        self._engine = engine
        self.num_pages = num_pages

    def __getattr__(self, name: str):
        return getattr(self._engine, name)


def test_a_failed_recompute_ends_that_instance_alone_and_every_page_returns(
        components, make_runtime):  # noqa: F811
    """The engine fails every recompute pass (a pass without outputs): each instance restored
    by recompute ends with a trap naming it; the others complete as on a roomy pool; the pool
    is whole afterwards."""
    class FailingRecompute(FakeEngine):
        def forward(self, batch):
            if any(not request.output_indices for request in batch.requests):
                raise RuntimeError("injected recompute failure")
            return super().forward(batch)

    prompts = [f"prompt {i}!" for i in range(6)]
    roomy = make_runtime(FakeEngine(num_pages=64, page_size=4))
    expected = {p: roomy.wait(launch(roomy, components, "grower", p), timeout=20).value
                for p in prompts}
    runtime = make_runtime(FailingRecompute(num_pages=16, page_size=4), restore="recompute")
    program = runtime.load_program(components.component("grower"))
    ids = {p: runtime.launch(program, [p]) for p in prompts}
    outcomes = {p: runtime.wait(i, timeout=60) for p, i in ids.items()}
    failed = {p for p, o in outcomes.items() if o.status != "ok"}
    assert failed, "no recompute ran: the test did not test anything"
    for p in failed:
        assert outcomes[p].status == "trap"
        assert "could not be recomputed" in outcomes[p].value, outcomes[p].value
    assert {p: o.value for p, o in outcomes.items() if p not in failed} == {
        p: expected[p] for p in prompts if p not in failed}
    assert _eventually_free(runtime, 16)


def _eventually_free(runtime, num_pages: int, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while runtime.statistics().pages.num_free != num_pages:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True
