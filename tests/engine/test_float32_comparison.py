"""The row-by-row float32 comparison of tests/engine/float32_comparison.py (which the CUDA tests
use to judge FlashInfer) on the CPU: on synthetic logits, each check fails on the error it is for;
on two tiny random models (the default test shape and GQA group 4 / head_dim 128), a second
bfloat16 path of the torch backend passes against torch-bf16 and a float32 run, and a path that
drops the masks fails on exactly the masked rows."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.batch import ForwardBatch
from engine.engine import Engine
from engine.engine_config import EngineConfig
from tests.engine.conftest import TINY, tiny_hf_model, tiny_weights
from tests.engine.float32_comparison import (GQA4_HEAD128, NUM_PAGES, PAGE_SIZE,
                                             check_against_float32, compare_rows, mixed_batches,
                                             print_summaries, run_batches)


def _noisy(reference: torch.Tensor, scale: float, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return reference + scale * torch.randn(reference.shape, generator=gen)


@pytest.fixture
def reference() -> dict[str, torch.Tensor]:
    """Two batches of float32 logits [R, 5000]; every row's top-1 leads its top-2 by 3."""
    gen = torch.Generator().manual_seed(0)
    batches = {}
    for name, rows in (("a", 6), ("b", 3)):
        logits = torch.randn(rows, 5000, generator=gen)
        logits[:, 7] = logits.max(dim=-1).values + 3.0
        batches[name] = logits
    return batches


def test_paths_as_far_from_float32_as_the_baseline_pass(reference):
    baseline = {n: _noisy(r, 0.1, 1) for n, r in reference.items()}
    candidate = {n: _noisy(r, 0.12, 2) for n, r in reference.items()}
    comparisons = check_against_float32(candidate, baseline, reference)
    assert [c.num_decisive for c in comparisons] == [6, 3]
    assert all(bool(c.tokens_agree.all()) for c in comparisons)


def test_a_path_three_times_further_fails_naming_its_rows(reference):
    baseline = {n: _noisy(r, 0.1, 1) for n, r in reference.items()}
    candidate = dict(baseline, b=_noisy(reference["b"], 0.3, 2))
    with pytest.raises(AssertionError) as failure:
        check_against_float32(candidate, baseline, reference)
    lines = str(failure.value).splitlines()
    assert sum(line.startswith("b: row ") and "x > 2.0x" in line for line in lines) == 3
    assert not any(line.startswith("a: row ") for line in lines)


def test_a_flipped_decisive_token_fails_although_the_error_is_small(reference):
    baseline = {n: _noisy(r, 0.1, 1) for n, r in reference.items()}
    candidate = {n: t.clone() for n, t in baseline.items()}
    row = candidate["a"][2]
    second = int(row.topk(2).indices[1])
    row[7], row[second] = row[second].clone(), row[7].clone()     # top-2 wins: a wrong argmax
    comparison = compare_rows("a", candidate["a"], baseline["a"], reference["a"])
    assert bool(comparison.decisive[2]) and not bool(comparison.tokens_agree[2])
    assert float(comparison.error_ratio(1e-3)[2]) < 2.0          # the error check alone passes
    with pytest.raises(AssertionError, match="a: row 2: greedy token differs"):
        check_against_float32(candidate, baseline, reference)


def test_a_near_tie_may_flip(reference):
    """A row whose float32 margin is within the baseline's error is not decisive: its greedy token
    may differ without failing."""
    tied = {n: r.clone() for n, r in reference.items()}
    tied["a"][0, 7] = tied["a"][0].topk(2).values[1] + 0.05
    baseline = {n: _noisy(r, 0.1, 1) for n, r in tied.items()}
    candidate = {n: t.clone() for n, t in baseline.items()}
    second = int(tied["a"][0].topk(2).indices[1])
    candidate["a"][0, 7], candidate["a"][0, second] = tied["a"][0, second], tied["a"][0, 7]
    comparisons = check_against_float32(candidate, baseline, tied)
    assert not bool(comparisons[0].decisive[0])


def test_too_few_decisive_rows_fail(reference):
    flat = {n: torch.zeros_like(r) for n, r in reference.items()}      # every row a tie
    noisy = {n: _noisy(r, 0.1, 1) for n, r in flat.items()}
    with pytest.raises(AssertionError, match="only 0 of 9 rows have a decisive float32 margin"):
        check_against_float32(noisy, noisy, flat)


def test_shapes_must_match(reference):
    with pytest.raises(ValueError, match="shapes differ"):
        compare_rows("a", reference["a"][:2], reference["a"], reference["a"])


def _engine(config, weights, **fields) -> Engine:
    settings = dict(page_size=PAGE_SIZE, num_pages=NUM_PAGES, device="cpu",
                    attention_backend="torch", **fields)
    return Engine(config, {n: t.clone() for n, t in weights.items()}, None,
                  EngineConfig(**settings), seed=0)


def _without_masks(batches: dict[str, ForwardBatch]) -> dict[str, ForwardBatch]:
    return {name: ForwardBatch(tuple(dataclasses.replace(r, mask=None) for r in batch.requests))
            for name, batch in batches.items()}


@pytest.mark.parametrize("config", [TINY, GQA4_HEAD128], ids=lambda c: c.name)
def test_torch_bf16_paths_against_a_float32_run(config, one_torch_thread):
    weights = tiny_weights(tiny_hf_model(dataclasses.replace(config, max_position=256)))
    batches = mixed_batches(config.vocab_size)
    reference = run_batches(_engine(config, weights, dtype="float32").logits, batches)
    baseline = run_batches(_engine(config, weights, dtype="bfloat16").logits, batches)
    # another bfloat16 path: the same activations over a float16 KV pool
    candidate = run_batches(_engine(config, weights, dtype="bfloat16", kv_dtype="float16").logits,
                            batches)
    comparisons = check_against_float32(candidate, baseline, reference)
    print_summaries(config.name, comparisons)
    assert sum(c.num_rows for c in comparisons) == 60 + 1 + 3 + 1 + 17 + 4
    assert all(float(c.baseline_error.min()) > 0 for c in comparisons)   # bf16 really differs

    no_masks = run_batches(_engine(config, weights, dtype="bfloat16").logits,
                           _without_masks(batches))
    with pytest.raises(AssertionError, match="row"):
        check_against_float32(no_masks, baseline, reference)
    failing = {name: compare_rows(name, no_masks[name], baseline[name], reference[name])
               .failing(2.0, 1e-3).nonzero().flatten().tolist() for name in batches}
    # C's rows only: its masked prefill (rows 40..59 of the first batch; its first row attends
    # slot 0 alone, mask or not), its masked decode (row 4 of the second batch: A's decode and
    # B's fork come first), its plain decode (row 2 of the third) over the K/V those wrote
    assert list(failing.values()) == [list(range(41, 60)), [4], [2]]
