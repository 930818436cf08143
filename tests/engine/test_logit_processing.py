"""Logit processing and draft verification on synthetic logits (no model): penalties, bias,
allowed sets, log-probabilities, speculative sampling's distribution, the prompt-lookup drafter,
and the engine's validation of the new fields."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from engine.batch import GREEDY, ForwardBatch, ForwardRequest, SamplerSpec, TokenLogprobs
from engine.constrain import GenerationState
from engine.constrain.processing import RowError, process_logits
from engine.errors import RequestError
from engine.sampling import Sampler, sample_batch
from engine.validate import validate_batch

VOCAB = 16
REPO = Path(__file__).resolve().parents[2]


def state_with(*token_ids: int) -> GenerationState:
    state = GenerationState()
    for token_id in token_ids:
        state.accept(token_id)
    return state


def test_penalties_follow_their_definitions() -> None:
    logits = torch.linspace(-2, 2, VOCAB).unsqueeze(0)                 # [1, V]
    state = state_with(3, 3, 12)
    spec = SamplerSpec(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0,
                       state=state)
    out = process_logits(logits, [spec])[0]
    raw = logits[0]
    assert out[3] == pytest.approx(raw[3] * 2.0 - 0.25 * 2 - 0.5)    # negative logit: multiplied
    assert out[12] == pytest.approx(raw[12] / 2.0 - 0.25 - 0.5)       # positive logit: divided
    untouched = [t for t in range(VOCAB) if t not in (3, 12)]
    assert torch.equal(out[untouched], raw[untouched])


def test_bias_and_allowed_set() -> None:
    logits = torch.zeros(2, VOCAB)
    specs = [SamplerSpec(logit_bias=((5, 100.0), (6, -100.0))),
             SamplerSpec(allowed_token_ids=(1, 2))]
    out = process_logits(logits, specs)
    assert out[0, 5] == 100 and out[0, 6] == -100 and out[0, 0] == 0
    assert torch.isinf(out[1]).sum() == VOCAB - 2 and out[1, 1] == 0
    assert Sampler(seed=0).sample(logits, specs) == [5, 1]
    assert process_logits(logits, [SamplerSpec(), SamplerSpec()]) is logits   # no copy


def test_invalid_options_are_refused() -> None:
    with pytest.raises(ValueError, match="presence_penalty"):
        SamplerSpec(presence_penalty=3.0, state=GenerationState())
    with pytest.raises(ValueError, match="need a generation state"):
        SamplerSpec(frequency_penalty=1.0)
    with pytest.raises(ValueError, match="logit_bias"):
        SamplerSpec(logit_bias=((1, float("nan")),))
    bad = ForwardRequest((1, 2), (0, 1), (0,), 2, (1,), (SamplerSpec(logit_bias=((99, 1.0),)),))
    with pytest.raises(ValueError, match="request 0: field samplers.logit_bias"):
        validate_batch(ForwardBatch((bad,)), page_size=16, num_pages=4, vocab_size=VOCAB,
                       max_position=64)
    verify = ForwardRequest((1, 2, 3), (0, 1, 2), (0,), 3, (1, 2), (SamplerSpec(),) * 2,
                            num_drafted=2)
    with pytest.raises(ValueError, match="output_indices"):
        validate_batch(ForwardBatch((verify,)), page_size=16, num_pages=4, vocab_size=VOCAB,
                       max_position=64)


def test_logprobs_are_log_softmax_of_the_raw_logits_and_state_advances() -> None:
    torch.manual_seed(0)
    logits = torch.randn(1, VOCAB) * 3
    state = GenerationState()
    spec = SamplerSpec("sample", temperature=0.5, seed=1, num_logprobs=3,
                       logit_bias=((0, 5.0),), state=state)
    (out,) = Sampler(seed=0).sample(logits, [spec])
    expected = torch.log_softmax(logits[0], -1)
    assert isinstance(out, TokenLogprobs)
    assert out.logprob == pytest.approx(float(expected[out.token_id]))
    assert list(out.top_token_ids) == expected.topk(3).indices.tolist()
    assert state.history() == ([out.token_id], [1])


def test_no_token_left_is_a_row_error() -> None:
    spec = SamplerSpec(allowed_token_ids=(1,), logit_bias=((1, -100.0),))
    logits = torch.full((1, VOCAB), float("-inf"))
    with pytest.raises(RowError):
        process_logits(logits, [spec])


def test_a_row_with_no_token_left_fails_only_its_request() -> None:
    """sample_batch raises the engine's typed RequestError naming the request (the scheduler then
    runs the other requests of the batch again without it)."""
    good = ForwardRequest((5,), (0,), (0,), 1, (0,), (GREEDY,))
    empty = ForwardRequest((5,), (0,), (1,), 1, (0,), (SamplerSpec(allowed_token_ids=(1,),
                                                                   logit_bias=((1, -100.0),)),))
    logits = torch.full((2, VOCAB), float("-inf"))
    with pytest.raises(RequestError) as raised:
        sample_batch(Sampler(seed=0), logits, ForwardBatch((good, empty)))
    assert (raised.value.request_index, raised.value.field) == (1, "samplers")


def test_speculative_sampling_keeps_the_target_distribution() -> None:
    """A draft token accepted with probability p(draft), else a draw from p without it: the
    first token's distribution equals p whatever the draft."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0] + [-30.0] * (VOCAB - 4)] * 2)
    probs = torch.softmax(logits[0].double(), -1)[:4]
    sampler = Sampler(seed=0)
    spec = SamplerSpec("sample", temperature=1.0)
    num_draws = 2000
    counts = torch.zeros(4)
    for _ in range(num_draws):
        counts[sampler.verify(logits, spec, [1]).token_ids[0]] += 1
    assert torch.allclose(counts / num_draws, probs.float(), atol=0.035)   # ~3 sigma


def test_greedy_verify_accepts_the_argmax_prefix() -> None:
    logits = torch.zeros(4, VOCAB)
    for row, best in enumerate((3, 5, 7, 9)):
        logits[row, best] = 1.0
    sampler = Sampler(seed=0)
    assert sampler.verify(logits, SamplerSpec(), [3, 5, 7]).token_ids == (3, 5, 7, 9)
    assert sampler.verify(logits, SamplerSpec(), [3, 6, 7]).token_ids == (3, 5)
    assert sampler.verify(logits, SamplerSpec(), [4, 5, 7]).token_ids == (3,)


def test_prompt_lookup_drafter() -> None:
    spec = importlib.util.spec_from_file_location(
        "drafting", REPO / "inferlets" / "sdk" / "inferlet" / "drafting.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    drafter = module.PromptLookupDrafter(num_drafts=3)
    assert drafter([1, 2, 3, 4, 5, 9, 2, 3]) == [4, 5, 9]        # the last 2-gram seen before
    assert drafter([7, 8, 9]) == []                              # nothing repeats
    assert drafter([5, 1, 6, 1]) == [6, 1]                       # 1-gram fallback
    with pytest.raises(ValueError):
        module.PromptLookupDrafter(num_drafts=0)
