"""ForwardBatch.fed_from: a pass whose input token is the output of a pass of the batch before
(overlapped decode loops) computes what the same pass with that token written in computes."""
from __future__ import annotations

import dataclasses

import pytest

from engine.batch import (GREEDY, ForwardBatch, ForwardRequest, ForwardResult, SamplerSpec,
                          TokenLogprobs, output_token_id)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PAGE_SIZE = 4
PROMPTS = ([5, 9, 13, 2, 7], [11, 3, 8])
LOGPROBS = SamplerSpec(num_logprobs=2)


def _prompt_pass(prompt: list[int], page_ids: tuple[int, ...]) -> ForwardRequest:
    return ForwardRequest(tuple(prompt), tuple(range(len(prompt))), page_ids,
                          (len(prompt) - 1) % PAGE_SIZE + 1, (len(prompt) - 1,), (LOGPROBS,))


def _decode_pass(token_id: int, position: int, page_ids: tuple[int, ...]) -> ForwardRequest:
    return ForwardRequest((token_id,), (position,), page_ids, position % PAGE_SIZE + 1, (0,),
                          (GREEDY,))


def _two_steps(engine, feed: bool) -> list[ForwardResult]:
    """Each prompt's pass, then a decode pass of its output (fed, or written in), then one
    more fed from that (a decode pass's int output)."""
    page_ids = [(0, 1), (2,)]
    first = engine.forward(ForwardBatch(tuple(_prompt_pass(prompt, pages)
                                              for prompt, pages in zip(PROMPTS, page_ids))))
    placeholder = [0 if feed else output_token_id(result) for result in first]
    second = engine.forward(ForwardBatch(
        tuple(_decode_pass(token, len(prompt), pages)
              for token, prompt, pages in zip(placeholder, PROMPTS, page_ids)),
        tuple(first) if feed else None))
    third = engine.forward(ForwardBatch(
        tuple(_decode_pass(0, len(prompt) + 1, pages) for prompt, pages in zip(PROMPTS, page_ids)),
        tuple(second)))
    return [*first, *second, *third]


def test_a_fed_token_computes_what_the_written_token_computes(make_tiny_engine) -> None:
    fed = _two_steps(make_tiny_engine(page_size=PAGE_SIZE), feed=True)
    written = _two_steps(make_tiny_engine(page_size=PAGE_SIZE), feed=False)
    assert isinstance(fed[0].outputs[0], TokenLogprobs)        # fed from a TokenLogprobs
    assert [r.outputs for r in fed] == [r.outputs for r in written]


def test_with_fed_tokens_puts_each_token_in_and_leaves_the_others() -> None:
    own = _decode_pass(42, 3, (0,))
    fed = _decode_pass(0, 3, (1,))
    batch = ForwardBatch((own, fed), (None, ForwardResult((TokenLogprobs(17, -0.5, (), ()),))))
    applied = batch.with_fed_tokens()
    assert applied.fed_from is None
    assert [r.token_ids for r in applied.requests] == [(42,), (17,)]
    assert applied.requests[0] is own and applied.requests[1].positions == fed.positions
    plain = ForwardBatch((own,))
    assert plain.with_fed_tokens() is plain


def test_the_fast_decode_request_constructors_make_what_init_and_replace_make() -> None:
    """ForwardRequest.decode_step and .with_token skip the frozen dataclass's __init__: the
    requests are equal, hash alike, print alike and stay frozen."""
    made = ForwardRequest.decode_step(42, 17, (3, 8), 2, LOGPROBS)
    expected = ForwardRequest((42,), (17,), (3, 8), 2, (0,), (LOGPROBS,))
    assert made == expected and hash(made) == hash(expected) and repr(made) == repr(expected)
    fed = expected.with_token(7)
    assert fed == dataclasses.replace(expected, token_ids=(7,)) and expected.token_ids == (42,)
    assert hash(fed) == hash(dataclasses.replace(expected, token_ids=(7,)))
    with pytest.raises(dataclasses.FrozenInstanceError):
        made.token_ids = (1,)
    with pytest.raises(dataclasses.FrozenInstanceError):
        fed.positions = (1,)
