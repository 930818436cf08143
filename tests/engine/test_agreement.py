"""The engine agrees with transformers loading the same GGUF (float32), and bf16 ("auto" on a CPU
with native bf16) agrees with float32 on the top-1 token wherever float32's margin is not tiny."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PARAGRAPH = ("The river wound through the valley, past farms and old stone bridges, carrying the "
             "spring rain down from the mountains toward the distant sea. Villagers gathered on its "
             "banks each evening to talk about the harvest, the weather and the news from the city. ")


def prompts(engine) -> dict[str, list[int]]:
    tokenizer = engine.tokenizer
    chat = tokenizer.render_chat([{"role": "user", "content": "What is the capital of France?"}])
    long_ids = tokenizer.encode(PARAGRAPH * 8)[:300]
    return {
        "plain": tokenizer.encode("The capital of France is"),
        "code": tokenizer.encode("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\""),
        "chat": tokenizer.encode(chat),
        "long_300": long_ids,
    }


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM

    from engine.loaders import default_gguf_path

    path = default_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                 dtype=torch.float32)
    model.generation_config.eos_token_id = None    # ours has no EOS stop: compare 32 tokens
    model.generation_config.pad_token_id = 0
    return model.eval()


@pytest.fixture(scope="module")
def cases(real_engine):
    return prompts(real_engine)


def test_prompts_are_as_intended(cases, real_engine):
    assert len(cases["long_300"]) == 300
    assert "<|im_start|>" in real_engine.tokenizer.decode(cases["chat"])


@pytest.mark.parametrize("name", ["plain", "code", "chat", "long_300"])
def test_last_logits_and_32_greedy_tokens_match_transformers(real_engine, hf_model, cases, name):
    ids = cases[name]
    with torch.inference_mode():
        hf_logits = hf_model(torch.tensor([ids])).logits[0, -1]
        hf_tokens = hf_model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids)),
                                      max_new_tokens=32, do_sample=False)[0, len(ids):].tolist()
    ours = real_engine.prompt_logits(ids)
    assert (ours - hf_logits).abs().max() < 2e-3
    assert ours.topk(5).indices.tolist() == hf_logits.topk(5).indices.tolist()
    assert real_engine.generate_greedy(ids, 32) == hf_tokens


@pytest.fixture(scope="module")
def bf16_engine():
    from engine import load_default_engine

    # bfloat16 named explicitly, so the check runs on every CPU (`auto` picks it on a CPU with
    # native bf16 only when the quantized C kernels are not built: engine/dtype_choice.py)
    engine = load_default_engine(num_pages=128, progress=False, seed=0, dtype="bfloat16")
    assert engine.dtype == torch.bfloat16
    return engine


def test_bf16_top1_agrees_where_float32_margin_is_clear(real_engine, bf16_engine, cases):
    num_checked = 0
    for ids in (cases["plain"], cases["chat"], cases["long_300"][:160]):
        exact = real_engine.prompt_logits(ids, all_positions=True)          # [len, vocab]
        approx = bf16_engine.prompt_logits(ids, all_positions=True)
        top2 = exact.topk(2).values
        clear = (top2[:, 0] - top2[:, 1]) > 0.5
        assert torch.equal(approx.argmax(-1)[clear], exact.argmax(-1)[clear])
        num_checked += int(clear.sum())
    assert num_checked > 50


def test_bf16_small_batches_use_int4_weights_and_agree(real_engine, bf16_engine, cases):
    """<= 8 rows take the int4 path (the GGUF's own Q4 weights, repacked): same top-1 where clear."""
    assert bf16_engine.model.layers[0].qkv_proj.uses_int4
    assert not real_engine.model.layers[0].qkv_proj.uses_int4           # float32: exact only
    num_checked = 0
    for start in range(0, 48, 8):
        ids = cases["long_300"][start:start + 8]
        exact = real_engine.prompt_logits(ids, all_positions=True)          # [8, vocab]
        approx = bf16_engine.prompt_logits(ids, all_positions=True)
        top2 = exact.topk(2).values
        clear = (top2[:, 0] - top2[:, 1]) > 0.5
        assert torch.equal(approx.argmax(-1)[clear], exact.argmax(-1)[clear])
        num_checked += int(clear.sum())
    assert num_checked >= 12
