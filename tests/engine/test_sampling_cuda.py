"""CPU tests of engine/sampling_cuda.py: row routing, parity with the reference Sampler, and the
hand-off to FlashInfer's fused sampler (checked with a stand-in `flashinfer` module)."""
from __future__ import annotations

import sys
import types

import pytest
import torch

from engine.batch import Distribution, SamplerSpec
from engine.sampling import Sampler
from engine.sampling_cuda import CudaSampler, make_sampler, uses_fused_sampling

VOCAB = 50
SPECS = [
    SamplerSpec(),                                                        # greedy
    SamplerSpec(kind="sample", temperature=0.8, top_k=5, seed=7),         # seeded
    SamplerSpec(kind="sample", temperature=1.0, top_p=0.9),               # unseeded -> fused
    SamplerSpec(kind="sample", temperature=0.0),                          # temperature 0: greedy
    SamplerSpec(kind="distribution", num_top=3),
    SamplerSpec(kind="sample", temperature=1.2, min_p=0.1),               # min_p -> reference
    SamplerSpec(kind="sample", temperature=0.7, top_k=0, top_p=0.5),      # unseeded -> fused
]


def _logits(seed: int = 0) -> torch.Tensor:
    return torch.randn(len(SPECS), VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_routing_rule():
    assert [uses_fused_sampling(s) for s in SPECS] == [False, False, True, False, False, False, True]


def test_without_flashinfer_matches_the_reference_sampler():
    logits = _logits()
    expected = Sampler(seed=3).sample(logits, SPECS)
    got = CudaSampler("cpu", seed=3, use_flashinfer=False).sample(logits, SPECS)
    assert got == expected
    assert isinstance(got[4], Distribution) and len(got[4].token_ids) == 3
    with pytest.raises(ValueError, match="7 logit rows but 2 samplers"):
        CudaSampler("cpu", use_flashinfer=False).sample(logits, SPECS[:2])


class _FakeSampling:
    """Stand-in for flashinfer.sampling: checks the documented arguments, returns each row's top
    token among its allowed top_k (deterministic, so the test can predict it)."""

    def __init__(self) -> None:
        self.calls = []

    def top_k_top_p_sampling_from_probs(self, probs, top_k, top_p, filter_apply_order, generator):
        assert probs.dtype == torch.float32 and top_k.dtype == torch.int32
        assert top_p.dtype == torch.float32 and filter_apply_order == "top_k_first"
        torch.testing.assert_close(probs.sum(-1), torch.ones(len(probs)))
        self.calls.append((probs.clone(), top_k.clone(), top_p.clone()))
        return probs.argmax(-1).to(torch.int32)


def test_fused_rows_go_to_flashinfer(monkeypatch):
    fake = types.ModuleType("flashinfer")
    fake.sampling = _FakeSampling()
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    logits = _logits(1)
    sampler = CudaSampler("cpu", seed=3)
    assert sampler.uses_flashinfer
    got = sampler.sample(logits, SPECS)
    [(probs, top_k, top_p)] = fake.sampling.calls                        # one call, fused rows only
    assert top_k.tolist() == [VOCAB, VOCAB] and top_p.tolist() == pytest.approx([0.9, 0.5])
    torch.testing.assert_close(probs[1], torch.softmax(logits[6] / 0.7, -1))
    assert got[2] == int(logits[2].argmax()) and got[6] == int(logits[6].argmax())
    reference = Sampler(seed=3).sample(logits[[1, 4, 5]], [SPECS[1], SPECS[4], SPECS[5]])
    assert [got[1], got[4], got[5]] == reference                         # seeded/dist/min_p: same
    assert (got[0], got[3]) == (int(logits[0].argmax()), int(logits[3].argmax()))


def test_make_sampler_on_cpu_is_the_reference():
    assert type(make_sampler(torch.device("cpu"), seed=1)) is Sampler
