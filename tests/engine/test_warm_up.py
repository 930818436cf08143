"""engine.warm_up on the CPU: each kind of batch runs once (unmasked prefill with a long and a
short request, masked prefill, pure decode, every sampler kind), one progress line per step, and
the engine is left as it was: statistics, sampler stream, pages past the warm-up's, results."""
from __future__ import annotations

import types

import pytest
import torch

from engine.attention.torch_paged import MAX_PADDED_Q
from engine.batch import ForwardBatch, ForwardRequest, SamplerSpec
from engine.page_table import build_page_table
from engine.sampling import Sampler
from engine.sampling_cuda import CudaSampler
from engine.warm_up import (STEP_NAMES, WarmUpError, needs_warm_up, pages_needed, warm_up)


def _record_batches(engine, monkeypatch) -> list[ForwardBatch]:
    batches = []
    real = engine.logits

    def logits(batch):
        batches.append(batch)
        return real(batch)

    monkeypatch.setattr(engine, "logits", logits)
    return batches


def test_each_kind_of_batch_runs_once_with_a_progress_line(make_tiny_engine, monkeypatch):
    engine = make_tiny_engine()
    batches = _record_batches(engine, monkeypatch)
    specs = []
    real_sample = Sampler.sample
    monkeypatch.setattr(Sampler, "sample", lambda self, logits, s, positions=None: (
        specs.extend(s), real_sample(self, logits, s, positions))[1])
    lines = []
    report = warm_up(engine, lines.append)

    assert [step.name for step in report.steps] == list(STEP_NAMES)
    assert report.attention_backend == "torch"
    assert report.total_s == pytest.approx(sum(step.seconds for step in report.steps))
    assert lines[:-1] == [f"warming torch cpu kernels: {step.name} ({step.seconds:.1f} s)"
                          for step in report.steps]
    assert lines[-1] == f"torch cpu kernels warm in {report.total_s:.1f} s"
    prefill, masked, decode = (build_page_table(b, engine.page_size) for b in batches)
    assert prefill.custom_mask is None and sorted(prefill.q_lens().tolist()) == [5, 20]
    assert max(prefill.q_lens().tolist()) > MAX_PADDED_Q      # the long-request path ran too
    assert masked.custom_mask is not None and not bool(masked.custom_mask.all())
    assert decode.custom_mask is None and decode.q_lens().tolist() == [1, 1]
    kinds = {(s.kind, s.top_k > 0, s.top_p < 1, s.min_p > 0, s.seed is not None) for s in specs}
    assert {("greedy", False, False, False, False), ("sample", True, True, False, False),
            ("sample", False, True, False, False), ("sample", True, False, False, False),
            ("sample", False, False, True, False), ("sample", False, False, False, True),
            ("distribution", False, False, False, False)} <= kinds


def _sample_batch() -> ForwardBatch:
    return ForwardBatch((ForwardRequest(tuple(range(1, 9)), tuple(range(8)), (0, 1), 4, (7,),
                                        (SamplerSpec(kind="sample", temperature=1.0),)),))


def test_the_engine_is_left_as_it_was(make_tiny_engine):
    warmed, fresh = make_tiny_engine(), make_tiny_engine()
    warmed.kv_cache.pool.fill_(7.0)
    warm_up(warmed)
    assert warmed.statistics() == fresh.statistics()
    touched = pages_needed(warmed.page_size)
    assert bool((warmed.kv_cache.pool[:, touched:] == 7.0).all())       # only its own pages
    assert not bool((warmed.kv_cache.pool[:, :touched] == 7.0).all())
    # the same unseeded draws (the sampler's stream is untouched) and the same logits
    for _ in range(3):
        assert warmed.forward(_sample_batch()) == fresh.forward(_sample_batch())
    torch.testing.assert_close(warmed.logits(_sample_batch()), fresh.logits(_sample_batch()),
                               atol=0, rtol=0)


@pytest.mark.parametrize("num_pages", [1, 2, 3])
def test_a_small_pool_warms_what_fits(make_tiny_engine, num_pages):
    engine = make_tiny_engine(num_pages=num_pages)          # page_size 4: 4..12 slots, 8 needed
    report = warm_up(engine)
    assert [step.name for step in report.steps] == list(STEP_NAMES)


def test_a_failing_step_is_named(make_tiny_engine, monkeypatch):
    engine = make_tiny_engine()
    real = engine.logits

    def logits(batch):
        if batch.requests[0].mask is not None:
            raise ValueError("no kernel for this mask")
        return real(batch)

    monkeypatch.setattr(engine, "logits", logits)
    lines = []
    with pytest.raises(WarmUpError, match="masked prefill step: ValueError: no kernel") as failure:
        warm_up(engine, lines.append)
    assert failure.value.step == "masked prefill"
    assert isinstance(failure.value.__cause__, ValueError)
    assert len(lines) == 1 and "prefill" in lines[0]


def test_a_cuda_sampler_is_warmed_with_one_of_its_kind(make_tiny_engine, monkeypatch):
    engine = make_tiny_engine()
    engine.sampler = CudaSampler("cpu", seed=0, use_flashinfer=False)
    made = []
    real_init = CudaSampler.__init__

    def init(self, *args, **kwargs):
        made.append(kwargs)
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(CudaSampler, "__init__", init)
    warm_up(engine)
    assert made == [{"seed": 0, "use_flashinfer": False}]


def test_only_cuda_needs_it():
    assert not needs_warm_up(types.SimpleNamespace(device=torch.device("cpu")))
    assert needs_warm_up(types.SimpleNamespace(device=torch.device("cuda")))


def test_pages_needed_covers_both_sequences_and_their_decode_token():
    assert pages_needed(16) == 2 + 1
    assert pages_needed(4) == 6 + 2
    assert pages_needed(1) == 21 + 6


@pytest.mark.parametrize("on_cuda", [False, True])
def test_pie_serve_warms_the_engine_it_loads_when_it_needs_it(monkeypatch, caplog, tmp_path,
                                                              on_cuda):
    """host.server.setup.load_engine_for (what `pie serve` runs before it listens) warms the
    engine when needs_warm_up says so (forced here: there is no CUDA), logging each step on
    "pie.engine"; on the CPU it does not."""
    import logging

    import engine.warm_up
    from host.server.server_config import parse_config
    from host.server.setup import load_engine_for

    monkeypatch.setattr(engine.warm_up, "needs_warm_up", lambda _: on_cuda)
    config = parse_config({"server": {"data_dir": str(tmp_path)},
                           "engine": {"num_pages": 16, "page_size": 16, "device": "cpu"},
                           "tenants": [{"name": "a", "token": "t"}]})
    with caplog.at_level(logging.INFO, logger="pie.engine"):
        served = load_engine_for(config)
    lines = [r.getMessage() for r in caplog.records if "warm" in r.getMessage()]
    assert served.num_pages == 16
    if on_cuda:
        assert [line.split(": ")[1].split(" (")[0] for line in lines[:-1]] == list(STEP_NAMES)
        assert lines[-1].startswith("torch cpu kernels warm in ")
    else:
        assert lines == []
