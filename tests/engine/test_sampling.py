"""Batched sampling: greedy, top-k / top-p / min-p support, seeds, distributions."""
from __future__ import annotations

import math

import torch

from engine.batch import Distribution, ForwardBatch, ForwardRequest, SamplerSpec
from engine.sampling import Sampler, draw_seed, greedy_tokens, sample_batch

VOCAB = 50


def logits_rows(num_rows: int, seed: int = 0) -> torch.Tensor:
    torch.manual_seed(seed)
    return torch.randn(num_rows, VOCAB) * 3


def draws(logits: torch.Tensor, spec: SamplerSpec, num_draws: int) -> set[int]:
    sampler = Sampler(seed=1)
    return {sampler.sample(logits, [spec])[0] for _ in range(num_draws)}


def test_greedy_is_argmax_for_every_row():
    logits = logits_rows(7)
    out = Sampler(seed=0).sample(logits, [SamplerSpec()] * 7)
    assert out == logits.argmax(-1).tolist()


def test_greedy_tokens_match_torch_argmax_on_ties_nan_and_infinities():
    nan, inf = float("nan"), float("inf")
    special = torch.tensor([[1.0, nan, 3.0, nan], [2.0, 5.0, 5.0, 1.0], [-inf] * 4,
                            [0.0, inf, inf, 1.0], [-2.0, -1.0, -1.0, -3.0]])
    assert greedy_tokens(special) == special.argmax(-1).tolist() == [1, 1, 0, 1, 1]
    wide = torch.randn(9, 49152)
    wide[3, 100] = wide[3, 40000] = wide[3].max() + 1        # a tie far apart: the first wins
    assert greedy_tokens(wide) == wide.argmax(-1).tolist()
    assert greedy_tokens(wide)[3] == 100
    rows = wide[[1, 3, 5]][:, ::2]                            # a strided view, not a copy
    assert greedy_tokens(rows) == rows.argmax(-1).tolist()
    halves = wide.to(torch.bfloat16)                          # another dtype: torch's argmax
    assert greedy_tokens(halves) == halves.argmax(-1).tolist()


def test_temperature_zero_sample_is_greedy():
    logits = logits_rows(1)
    assert Sampler().sample(logits, [SamplerSpec(kind="sample", temperature=0.0)]) == \
        [int(logits.argmax())]


def test_top_k_restricts_support():
    logits = logits_rows(1, seed=3)
    top3 = set(logits[0].topk(3).indices.tolist())
    seen = draws(logits, SamplerSpec(kind="sample", temperature=5.0, top_k=3), 200)
    assert seen <= top3 and len(seen) == 3


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05] + [1e-9] * (VOCAB - 4)]))
    seen = draws(logits, SamplerSpec(kind="sample", top_p=0.7), 300)
    assert seen == {0, 1}                     # 0.5 < 0.7, 0.5 + 0.3 >= 0.7
    assert draws(logits, SamplerSpec(kind="sample", top_p=0.4), 50) == {0}


def test_min_p_drops_tokens_below_fraction_of_the_best():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1] + [1e-9] * (VOCAB - 4)]))
    seen = draws(logits, SamplerSpec(kind="sample", min_p=0.45), 300)   # keep p >= 0.18
    assert seen == {0, 1, 2}


def test_seed_reproducible_and_independent_of_batch():
    logits = logits_rows(6, seed=4)
    spec = SamplerSpec(kind="sample", temperature=2.0, seed=1234)
    alone = Sampler(seed=5).sample(logits[2:3], [spec])[0]
    others = [SamplerSpec(kind="sample", temperature=1.5), SamplerSpec(),
              SamplerSpec(kind="distribution", num_top=3)]
    batch_specs = [others[0], others[1], spec, others[2], others[0], others[1]]
    in_batch = Sampler(seed=9).sample(logits, batch_specs)[2]
    assert alone == in_batch
    # different seeds explore the distribution (not a constant)
    tokens = {Sampler().sample(logits[2:3], [SamplerSpec(kind="sample", temperature=2.0, seed=s)])[0]
              for s in range(40)}
    assert len(tokens) > 3


def test_a_seeded_generation_draws_afresh_at_every_position():
    """One seed for a whole generation: the draws depend on the position as well, so a flat
    distribution does not give the same token at every step (one uniform for every step did)."""
    flat = torch.zeros(1, VOCAB)
    spec = SamplerSpec(kind="sample", seed=77)
    tokens = [Sampler().sample(flat, [spec], [position])[0] for position in range(40, 80)]
    assert len(set(tokens)) > 20
    again = [Sampler(seed=3).sample(flat, [spec], [position])[0] for position in range(40, 80)]
    assert again == tokens                                  # same seed and position, same draw
    assert draw_seed(2**64 - 1, 1) < 2**64 and draw_seed(5, 0) == 5


def test_sample_batch_seeds_by_the_position_each_token_goes_to():
    """Through a batch: the same seed and logits at two requests whose tokens go to different
    positions draw independently; at the same position, identically."""
    logits = torch.zeros(3, VOCAB)
    spec = SamplerSpec(kind="sample", seed=5)

    def one_token(position: int) -> ForwardRequest:
        return ForwardRequest((1,), (position,), (0,), position % 16 + 1, (0,), (spec,))
    results = sample_batch(Sampler(), logits,
                           ForwardBatch((one_token(3), one_token(9), one_token(3))))
    first, second, third = (result.outputs[0] for result in results)
    assert first == third == Sampler().sample(logits[:1], [spec], [4])[0]   # token goes at 3 + 1
    differing = {sample_batch(Sampler(), logits[:1], ForwardBatch((one_token(p),)))[0].outputs[0]
                 for p in range(20)}
    assert len(differing) > 10
    assert second in {Sampler().sample(logits[:1], [spec], [10])[0]}


def test_distribution_descending_sums_at_most_one_and_matches_softmax():
    logits = logits_rows(2, seed=5)
    specs = [SamplerSpec(kind="distribution", num_top=5, temperature=0.7),
             SamplerSpec(kind="distribution", num_top=VOCAB)]
    first, full = Sampler().sample(logits, specs)
    assert isinstance(first, Distribution) and len(first.token_ids) == 5
    assert list(first.probs) == sorted(first.probs, reverse=True)
    assert sum(first.probs) <= 1.0 + 1e-6
    expected = torch.softmax(logits[0] / 0.7, -1)
    assert first.token_ids == tuple(expected.topk(5).indices.tolist())
    assert all(math.isclose(p, float(expected[t]), rel_tol=1e-5)
               for t, p in zip(first.token_ids, first.probs))
    assert math.isclose(sum(full.probs), 1.0, rel_tol=1e-5)


def test_sampled_token_id_reads_a_token_or_token_logprobs() -> None:
    from engine.batch import TokenLogprobs, sampled_token_id
    assert sampled_token_id(17) == 17
    assert sampled_token_id(TokenLogprobs(token_id=5, logprob=-0.5, top_token_ids=(5, 2),
                                          top_logprobs=(-0.5, -1.2))) == 5
