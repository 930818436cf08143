"""The fake engine is a test instrument: check that it is page-accurate, validates like the real
engine, and that its tokenizer matches its own chat template."""
from __future__ import annotations

import jinja2
import pytest

from engine.batch import GREEDY, ForwardBatch, ForwardRequest, SamplerSpec, TokenCopy
from engine.protocol import EngineLike, EngineStats
from tests.host.fake_engine import EMPTY_SLOT, FakeEngine, fake_next_token


def request(token_ids, page_ids, last_page_len, mask=None, sampler=GREEDY):
    n = len(token_ids)
    kv_len = (len(page_ids) - 1) * 4 + last_page_len
    return ForwardRequest(tuple(token_ids), tuple(range(kv_len - n, kv_len)), tuple(page_ids),
                          last_page_len, (n - 1,), (sampler,), mask)


def test_implements_the_protocol_and_writes_tail_slots(fake_engine):
    engine: EngineLike = fake_engine
    assert engine.model_config.vocab_size == engine.tokenizer.vocab_size == 259
    (result,) = engine.forward(ForwardBatch((request([1, 2, 3, 4, 5], [3, 7], 1),)))
    assert fake_engine.page_tokens(3) == (1, 2, 3, 4)
    assert fake_engine.page_tokens(7) == (5, EMPTY_SLOT, EMPTY_SLOT, EMPTY_SLOT)
    assert result.outputs == (fake_next_token([1, 2, 3, 4, 5]),)
    (step,) = engine.forward(ForwardBatch((request([6], [3, 7], 2),)))
    assert step.outputs == (fake_next_token([1, 2, 3, 4, 5, 6]),)
    assert engine.statistics() == EngineStats(num_batches=2, num_requests=2, num_input_tokens=6,
                                              num_output_tokens=2)


def test_mask_and_copies_change_what_is_attended(fake_engine):
    fake_engine.forward(ForwardBatch((request([1, 2, 3], [0], 3),)))
    (masked,) = fake_engine.forward(ForwardBatch((request([4], [0], 4, mask=((1, 1, 2),)),)))
    assert masked.outputs == (fake_next_token([1, 3, 4]),)
    fake_engine.copy_tokens([TokenCopy(0, 1, 1, 0, 3)])
    assert fake_engine.page_tokens(1)[:3] == (2, 3, 4)
    assert fake_engine.statistics().num_copied_tokens == 3


def test_samplers_are_deterministic(fake_engine):
    seeded = SamplerSpec(kind="sample", temperature=0.7, seed=3)
    distribution = SamplerSpec(kind="distribution", num_top=3)
    outputs = [fake_engine.forward(ForwardBatch((request([1], [0], 1, sampler=s),)))[0].outputs[0]
               for s in (seeded, seeded, distribution)]
    assert outputs[0] == outputs[1] == fake_next_token([1], seed=3)
    assert outputs[2].token_ids[0] == fake_next_token([1]) and len(outputs[2].probs) == 3
    assert sum(outputs[2].probs) == pytest.approx(1.0)


@pytest.mark.parametrize("bad, message", [
    (request([1], [64], 1), r"request 1: field page_ids: page_ids\[0\]=64 out of range \[0, 64\)"),
    (request([1], [0], 5), "request 1: field last_page_len: last_page_len=5 outside 1..4"),
    (request([1, 2], [0], 1), "request 1: field page_ids: 2 tokens exceed kv length 1"),
    (request([1], [0], 2, mask=((1,),)), "request 1: field mask: mask row 0 must be non-negative runs"),
    (request([300], [0], 1), "request 1: field token_ids: token id 300 outside the vocabulary"),
])
def test_forward_validates_and_loses_nothing(fake_engine, bad, message):
    good = request([9], [5], 1)
    with pytest.raises(ValueError, match=message):
        fake_engine.forward(ForwardBatch((good, bad)))
    assert fake_engine.page_tokens(5)[0] == EMPTY_SLOT
    assert fake_engine.statistics().num_batches == 0


def test_copy_validates(fake_engine):
    with pytest.raises(ValueError, match="copy 1: dst_offset=3 \\+ num_tokens=2 outside a page"):
        fake_engine.copy_tokens([TokenCopy(0, 1, 0, 0, 1), TokenCopy(0, 1, 0, 3, 2)])
    with pytest.raises(ValueError, match="copy 0: src_page_id=-1 out of range"):
        fake_engine.copy_tokens([TokenCopy(-1, 1, 0, 0, 1)])


def test_injected_failure_then_recovers(fake_engine):
    fake_engine.fail_next_batches(1)
    with pytest.raises(RuntimeError, match="injected failure"):
        fake_engine.forward(ForwardBatch((request([1], [0], 1),)))
    assert fake_engine.forward(ForwardBatch((request([1], [0], 1),)))[0].outputs


def test_tokenizer_round_trip_and_chat_template():
    tokenizer = FakeEngine().tokenizer
    text = "<|im_start|>héllo<|im_end|>"
    token_ids = tokenizer.encode(text)
    assert token_ids[0] == 256 and token_ids[-1] == 257 and len(token_ids) == 8
    assert tokenizer.decode(token_ids) == text
    assert tokenizer.decode(token_ids, skip_special_tokens=True) == "héllo"
    assert tokenizer.token_strings()[65] == "A" and len(tokenizer.token_strings()) == 259
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    for prompt in (True, False):
        expected = jinja2.Template(tokenizer.chat_template).render(
            messages=messages, add_generation_prompt=prompt)
        assert tokenizer.render_chat(messages, add_generation_prompt=prompt) == expected
    assert set(tokenizer.stop_token_ids) == {257, 258}
