"""forward.submit checks a sampler record once per instance: the cache behind it."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from wasmtime.component import Record

from host.bindings import samplers
from host.errors import TrapError
from host.bindings.samplers import MAX_CACHED_SAMPLERS, SamplerCache


def _sampler(kind: str = "sample", temperature: float = 0.7, top_k: int = 0, seed=None) -> Record:
    record = Record()
    record.kind, record.temperature, record.seed = kind, temperature, seed
    for name, value in (("top-k", top_k), ("top-p", 1.0), ("min-p", 0.0), ("num-top", 0)):
        setattr(record, name, value)
    return record


def _ctx(vocab_size: int = 100) -> SimpleNamespace:
    return SimpleNamespace(tables=SimpleNamespace(samplers=SamplerCache()),
                           services=SimpleNamespace(model_info=SimpleNamespace(
                               vocab_size=vocab_size)))


def test_the_same_fields_give_the_same_checked_spec() -> None:
    ctx = _ctx()
    first = samplers.sampler_spec(ctx, "forward.submit", 0, _sampler(seed=3), None)
    again = samplers.sampler_spec(ctx, "forward.submit", 0, _sampler(seed=3), None)
    other = samplers.sampler_spec(ctx, "forward.submit", 0, _sampler(seed=4), None)
    assert again is first
    assert other is not first and other.seed == 4 and first.seed == 3


def test_a_bad_record_traps_every_time_and_is_never_cached() -> None:
    ctx = _ctx(vocab_size=100)
    for _ in range(2):
        with pytest.raises(TrapError, match="top_k 500 is more than the vocabulary size 100"):
            samplers.sampler_spec(ctx, "forward.submit", 0, _sampler(top_k=500), None)
        with pytest.raises(TrapError, match="temperature"):
            samplers.sampler_spec(ctx, "forward.submit", 0, _sampler(temperature=float("nan")), None)
    assert ctx.tables.samplers.get(("sample", 0.7, 500, 1.0, 0.0, None, 0)) is None


def test_the_cache_is_bounded() -> None:
    cache = SamplerCache()
    for seed in range(3 * MAX_CACHED_SAMPLERS):
        cache.put(("sample", seed), seed)
        assert len(cache._specs) <= MAX_CACHED_SAMPLERS
    assert cache.get(("sample", 3 * MAX_CACHED_SAMPLERS - 1)) == 3 * MAX_CACHED_SAMPLERS - 1


def _options(**fields) -> Record:
    record = Record()
    values = {"logprobs": None, "generation": None, "logit-bias": [], "allowed-token-ids": None,
              "presence-penalty": 0.0, "frequency-penalty": 0.0, "repetition-penalty": 1.0}
    values.update(fields)
    for name, value in values.items():
        setattr(record, name, value)
    return record


def test_default_options_keep_the_checked_spec_and_others_are_applied_and_checked() -> None:
    ctx = _ctx(vocab_size=100)
    base = samplers.sampler_spec(ctx, "forward.submit", 0, _sampler(), None)
    assert samplers.sampler_spec(ctx, "forward.submit", 0, _sampler(), _options()) is base
    with_logprobs = samplers.sampler_spec(ctx, "forward.submit", 0, _sampler(),
                                          _options(logprobs=2))
    assert with_logprobs.num_logprobs == 2 and with_logprobs.temperature == base.temperature
    biased = samplers.sampler_spec(ctx, "forward.submit", 0, _sampler(),
                                   _options(**{"logit-bias": [(3, 1.5)]}))
    assert biased.logit_bias == ((3, 1.5),)
    for bad in ({"repetition-penalty": float("nan")}, {"presence-penalty": float("nan")},
                {"presence-penalty": 0.5}, {"logit-bias": [(100, 1.0)]}):
        with pytest.raises(TrapError):
            samplers.sampler_spec(ctx, "forward.submit", 0, _sampler(), _options(**bad))


def test_submit_looks_queues_and_samplers_up_and_traps_on_unknown_or_bad_ones() -> None:
    """forward.submit answers a known queue and a sampler record seen before from the tables;
    an unknown queue and a bad sampler trap naming the call, every time (never cached)."""
    from host.bindings import forward
    from host.bindings.forward import FutureTable
    from host.bindings.queue import QueueTable

    specs_seen: list = []
    submitted: list = []
    ctx = _ctx(vocab_size=100)
    ctx.instance_id = "a"
    ctx.tables.queues, ctx.tables.futures = QueueTable(), FutureTable()
    ctx.tables.pages = SimpleNamespace(
        prepare=lambda *args: specs_seen.append(args[5]) or "prepared")
    ctx.services.scheduler = SimpleNamespace(
        submit_forward=lambda key, priority, prepared: submitted.append((key, priority)) or key)
    queue_id = ctx.tables.queues.create("high")

    def submit(queue: int, sampler: Record):
        return forward.submit(ctx, queue, 0, [1], [0], 1, [0], [sampler], None)

    for _ in range(2):
        with pytest.raises(TrapError, match="forward.submit: unknown queue id 7"):
            submit(7, _sampler())
        with pytest.raises(TrapError, match="forward.submit: sampler 0: top_k 500"):
            submit(queue_id, _sampler(top_k=500))
    assert specs_seen == [] and submitted == []
    first, second = submit(queue_id, _sampler(seed=3)), submit(queue_id, _sampler(seed=3))
    assert (first.rep, second.rep) == (1, 2) and len(ctx.tables.futures) == 2
    assert submitted == [(("a", queue_id), "high")] * 2
    assert specs_seen[0][0] is specs_seen[1][0] and specs_seen[0][0].seed == 3
