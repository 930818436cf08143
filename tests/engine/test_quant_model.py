"""The default model on GGUF blocks ("quantized") against the float32 model dequantized from the
same file: same function up to the 16-bit rounding of activations, on both kernel paths (block
kernels for every batch, and dequantize + GEMM for every batch of more than one row)."""
from __future__ import annotations

import pytest
import torch

from engine.engine_config import EngineConfig
from engine.engine import Engine
from engine.quant import QuantizedTensor
from engine.quant import kernels
from engine.quant.linear import BatchPlanner

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.skipif(not kernels.available(), reason=kernels.unavailable_reason())]

PROMPTS = ("The three most important things to know about the ocean are",
           "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"",
           "Once upon a time, in a small village by the sea,",
           "Question: What is the capital of France?\nAnswer:",
           "1, 2, 3, 5, 8, 13,")
NUM_NEW_TOKENS = 24
MIN_TOP1_AGREEMENT = 0.99
# 16-bit activation blocks move logits a little: measured max |diff| <= 0.01 and mean ~0.001 on
# logits of magnitude up to ~45 (SmolLM2-135M Q4_1); bound the worst position and the mean.
MAX_LOGIT_DIFF, MAX_MEAN_LOGIT_DIFF = 0.05, 0.005


@pytest.fixture(scope="module")
def loaded():
    from engine import loaders

    return loaders.load_model(loaders.default_gguf_path(), dtype="float32", progress=False,
                              keep_quantized=True)


def quantized_engine(loaded, block_rows: int) -> Engine:
    return Engine(loaded.config, dict(loaded.weights), loaded.tokenizer,
                  EngineConfig(dtype="quantized", num_pages=256), seed=0,
                  planner=BatchPlanner(fixed_block_rows=block_rows))


@pytest.fixture(scope="module")
def sequences(real_engine) -> list[list[int]]:
    """Each prompt with the float32 model's greedy continuation."""
    tokenizer = real_engine.tokenizer
    prompts = [tokenizer.encode(text) for text in PROMPTS]
    continuations = real_engine.generate_greedy_batch(prompts, NUM_NEW_TOKENS)
    return [p + c for p, c in zip(prompts, continuations)]


def test_weights_stay_as_blocks(loaded) -> None:
    weights = loaded.weights
    assert isinstance(weights["model.layers.0.mlp.down_proj.weight"], QuantizedTensor)
    assert isinstance(weights["model.embed_tokens.weight"], QuantizedTensor)
    assert weights["model.layers.0.input_layernorm.weight"].dtype == torch.float32


@pytest.mark.parametrize("block_rows", [1 << 20, 1], ids=["block_kernels", "dequantize_gemm"])
def test_logits_and_top1_agree_with_float32(real_engine, loaded, sequences, block_rows) -> None:
    engine = quantized_engine(loaded, block_rows)
    agree = total = 0
    for sequence in sequences:
        expected = real_engine.prompt_logits(sequence, all_positions=True)   # [len, vocab]
        got = engine.prompt_logits(sequence, all_positions=True)
        diff = (got - expected).abs()
        assert float(diff.max()) < MAX_LOGIT_DIFF
        assert float(diff.mean()) < MAX_MEAN_LOGIT_DIFF
        agree += int((got.argmax(-1) == expected.argmax(-1)).sum())
        total += len(sequence)
    assert agree / total >= MIN_TOP1_AGREEMENT


def test_greedy_decode_steps_agree_with_float32(real_engine, loaded, sequences) -> None:
    """Decode steps (one row per sequence per step, the block kernels) follow the float32 model's
    greedy tokens on >= 99% of the steps, teacher-forced by comparing step by step."""
    engine = quantized_engine(loaded, 8)
    prompts = [s[:-NUM_NEW_TOKENS] for s in sequences]
    got = engine.generate_greedy_batch(prompts, NUM_NEW_TOKENS)
    steps = agree = 0
    for sequence, prompt, continuation in zip(sequences, prompts, got):
        expected = sequence[len(prompt):]
        first_difference = next((i for i, (a, b) in enumerate(zip(continuation, expected))
                                 if a != b), len(expected))
        # after a first different token the two runs see different inputs: count up to there,
        # plus that one step as a disagreement
        agree += first_difference
        steps += min(len(expected), first_difference + 1)
    assert agree / steps >= MIN_TOP1_AGREEMENT


def test_embedding_rows_are_dequantized_blocks(loaded) -> None:
    engine = quantized_engine(loaded, 8)
    ids = torch.tensor([0, 17, 49151])
    from gguf import quants
    embed = loaded.weights["model.embed_tokens.weight"]
    expected = torch.from_numpy(quants.dequantize(embed.blocks[ids].numpy().reshape(-1), embed.qtype)
                                .reshape(3, -1))
    torch.testing.assert_close(engine.model._embed(ids), expected)
