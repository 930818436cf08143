"""Engine.forward: agreement of the tiny model with transformers, batch invariance, forks, masks,
page sizes (real model), and bad input (ValueError naming request and field; engine keeps serving)."""
from __future__ import annotations

import pytest
import torch

from engine.batch import GREEDY, ForwardBatch, ForwardRequest, SamplerSpec, TokenCopy
from engine.errors import RequestError

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TOP10 = SamplerSpec(kind="distribution", num_top=10)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality: the KV pool starts as uninitialized memory, where NaN != NaN."""
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def fill(token_ids, start, page_ids, page_size, outputs=None, samplers=None, mask=None):
    """A request appending `token_ids` at positions start.. into `page_ids` (context included)."""
    end = start + len(token_ids)
    outputs = (len(token_ids) - 1,) if outputs is None else tuple(outputs)
    return ForwardRequest(tuple(token_ids), tuple(range(start, end)), tuple(page_ids),
                          (end - 1) % page_size + 1, outputs,
                          samplers or (GREEDY,) * len(outputs), mask)


# ---- tiny random model vs transformers ---------------------------------------------------------
def test_tiny_chunked_prefill_and_decode_match_transformers(tiny_model, make_tiny_engine):
    engine = make_tiny_engine(page_size=4)
    ids = [5, 17, 3, 88, 42, 9, 1, 60, 33, 21, 7, 2, 64]
    with torch.no_grad():
        expected = torch.softmax(tiny_model(torch.tensor([ids])).logits[0], -1)   # [13, vocab]
    pages = (9, 2, 30, 11)
    chunks = [(0, 6), (6, 9), (9, 10), (10, 11), (11, 13)]          # prefill, fill, decodes, fill
    for start, end in chunks:
        specs = (SamplerSpec(kind="distribution", num_top=97),) * (end - start)
        request = fill(ids[start:end], start, pages[:(end + 3) // 4], 4,
                       outputs=range(end - start), samplers=specs)
        (result,) = engine.forward(ForwardBatch((request,)))
        for row, dist in enumerate(result.outputs):
            ours = torch.zeros(97).index_put_((torch.tensor(dist.token_ids),), torch.tensor(dist.probs))
            torch.testing.assert_close(ours, expected[start + row], atol=1e-5, rtol=1e-4)


# ---- bad input ---------------------------------------------------------------------------------
GOOD = fill([1, 2, 3], 0, (0,), 4)
BAD_REQUESTS = {
    "page_ids": fill([1, 2], 0, (64,), 4),                                   # out of range
    "last_page_len": ForwardRequest((1,), (0,), (0,), 0, (0,), (GREEDY,)),
    "last_page_len ": ForwardRequest((1,), (0,), (0,), 5, (0,), (GREEDY,)),
    "page_ids ": ForwardRequest((1, 2, 3), (0, 1, 2), (0,), 2, (0,), (GREEDY,)),  # 3 tokens, 2 slots
    "positions": ForwardRequest((1, 2), (0,), (0,), 2, (0,), (GREEDY,)),
    "output_indices": ForwardRequest((1, 2), (0, 1), (0,), 2, (2,), (GREEDY,)),
    "samplers": ForwardRequest((1, 2), (0, 1), (0,), 2, (1,), ()),
    "mask": ForwardRequest((1, 2), (0, 1), (0,), 2, (1,), (GREEDY,), mask=((2,),)),  # 1 row
    "mask ": ForwardRequest((1, 2), (0, 1), (0,), 2, (1,), (GREEDY,), mask=((2,), (1,))),  # sum
    "token_ids": ForwardRequest((), (), (0,), 1),
    "token_ids ": ForwardRequest((1, 97), (0, 1), (0,), 2, (1,), (GREEDY,)),      # id >= vocab
}


@pytest.mark.parametrize("field", list(BAD_REQUESTS))
def test_bad_input_names_request_and_field_and_engine_keeps_serving(make_tiny_engine, field):
    engine = make_tiny_engine(page_size=4)
    before = engine.forward(ForwardBatch((GOOD,)))
    pool_before = engine.kv_cache.pool.clone()
    with pytest.raises(RequestError, match=rf"request 1: field {field.strip()}\b") as raised:
        engine.forward(ForwardBatch((fill([4], 0, (5,), 4), BAD_REQUESTS[field])))
    assert (raised.value.request_index, raised.value.field) == (1, field.strip())
    assert same_bytes(engine.kv_cache.pool, pool_before)     # a rejected batch writes nothing
    assert engine.forward(ForwardBatch((GOOD,))) == before


def corrupt_sampler(**fields) -> SamplerSpec:
    """A SamplerSpec whose fields were changed after its constructor checked them: the engine
    must not trust that every SamplerSpec it receives went through the constructor."""
    spec = SamplerSpec(kind="sample", temperature=0.7, seed=1)
    for name, value in fields.items():
        object.__setattr__(spec, name, value)
    return spec


BAD_SAMPLERS = {
    "temperature nan": corrupt_sampler(temperature=float("nan")),
    "temperature inf": corrupt_sampler(temperature=float("inf")),
    "temperature negative": corrupt_sampler(temperature=-1.0),
    "top_p nan": corrupt_sampler(top_p=float("nan")),
    "top_p zero": corrupt_sampler(top_p=0.0),
    "min_p nan": corrupt_sampler(min_p=float("nan")),
    "min_p one": corrupt_sampler(min_p=1.0),
    "top_k negative": corrupt_sampler(top_k=-3),
    "top_k over vocab": corrupt_sampler(top_k=98),
    "top_k float": corrupt_sampler(top_k=2.5),
    "num_top over vocab": corrupt_sampler(kind="distribution", num_top=1 << 31),
    "num_top zero": corrupt_sampler(kind="distribution", num_top=0),
    "seed negative": corrupt_sampler(seed=-1),
    "seed over u64": corrupt_sampler(seed=1 << 64),
    "kind unknown": corrupt_sampler(kind="beam"),
    "not a sampler": "greedy",
}


@pytest.mark.parametrize("case", list(BAD_SAMPLERS))
def test_bad_sampler_fails_only_its_request(make_tiny_engine, case):
    """Whatever sampler the engine receives, it is a RequestError naming that request (so the
    scheduler fails it alone); the same batch without it runs and gives what it gives alone."""
    engine = make_tiny_engine(page_size=4)
    good = fill([4, 5], 0, (5,), 4)
    alone = engine.forward(ForwardBatch((good,)))
    bad = fill([1, 2, 3], 0, (0,), 4, samplers=(BAD_SAMPLERS[case],))
    pool_before = engine.kv_cache.pool.clone()
    with pytest.raises(RequestError) as raised:
        engine.forward(ForwardBatch((good, bad)))
    assert (raised.value.request_index, raised.value.field) == (1, "samplers")
    assert case.split()[0] in str(raised.value) or case == "not a sampler"
    assert same_bytes(engine.kv_cache.pool, pool_before)
    assert engine.forward(ForwardBatch((good,))) == alone


@pytest.mark.parametrize("fields", [{"temperature": float("nan")}, {"top_p": float("inf")},
                                    {"min_p": float("nan")}, {"temperature": float("-inf")},
                                    {"top_k": -1}, {"seed": 1 << 64}])
def test_sampler_spec_constructor_rejects_non_finite_and_out_of_range(fields):
    with pytest.raises(ValueError, match=next(iter(fields))):
        SamplerSpec(kind="sample", **fields)


def test_bad_token_copy_is_rejected_whole(make_tiny_engine):
    engine = make_tiny_engine(page_size=4)
    engine.forward(ForwardBatch((GOOD,)))
    pool_before = engine.kv_cache.pool.clone()
    with pytest.raises(ValueError, match=r"copy 1: field dst_offset"):
        engine.copy_tokens([TokenCopy(0, 1, 0, 0, 2), TokenCopy(0, 1, 0, 3, 2)])
    assert same_bytes(engine.kv_cache.pool, pool_before)


# ---- real model --------------------------------------------------------------------------------
def prompt_ids(engine, text: str) -> list[int]:
    return engine.tokenizer.encode(text)


def test_request_alone_equals_inside_a_batch_of_8(real_engine):
    texts = ["The capital of France is", "Once upon a time", "def fibonacci(n):",
             "Water boils at", "1, 2, 3, 4,", "My favourite colour is blue because",
             "In 1492 Columbus", "The quick brown fox jumps over the lazy dog and then"]
    prompts = [prompt_ids(real_engine, t) for t in texts]
    alone = real_engine.generate_greedy(prompts[5], 12)
    together = real_engine.generate_greedy_batch(prompts, 12)   # prompt 5 gets other pages
    assert together[5] == alone
    assert len({tuple(t) for t in together}) == 8


def test_page_size_1_equals_page_size_16(real_engine, real_engine_page1):
    prompt = prompt_ids(real_engine, "The history of the Roman Empire begins")
    assert real_engine_page1.generate_greedy(prompt, 12) == real_engine.generate_greedy(prompt, 12)


def distribution_at_end(engine, token_ids, start, page_ids, mask=None):
    request = fill(token_ids, start, page_ids, engine.page_size, samplers=(TOP10,), mask=mask)
    return engine.forward(ForwardBatch((request,)))[0].outputs[0]


def assert_same_distribution(ours, expected):
    assert ours.token_ids[:5] == expected.token_ids[:5]
    torch.testing.assert_close(torch.tensor(ours.probs), torch.tensor(expected.probs),
                               atol=1e-4, rtol=1e-3)


def test_fork_sharing_prefix_pages_equals_recomputation(real_engine):
    prefix = prompt_ids(real_engine, "Here is a short story about a small green dragon who loved to read old books "
                        "in the library of the castle.")
    assert 16 < len(prefix) < 32                                 # one full page + a partial one
    distribution_at_end(real_engine, prefix, 0, (100, 101))
    # fork: share full page 100, copy the partial page 101 -> 102 (copy on write)
    tail = len(prefix) - 16
    real_engine.copy_tokens([TokenCopy(101, 102, 0, 0, tail)])
    branch_a = prompt_ids(real_engine, " The dragon")
    branch_b = prompt_ids(real_engine, " One day, a knight")
    got_a = distribution_at_end(real_engine, branch_a, len(prefix), (100, 101))
    got_b = distribution_at_end(real_engine, branch_b, len(prefix), (100, 102))
    for branch, got in ((branch_a, got_a), (branch_b, got_b)):
        full = prefix + branch
        expected = distribution_at_end(real_engine, full, 0, (110, 111, 112)[:(len(full) + 15) // 16])
        assert_same_distribution(got, expected)


def test_mask_hiding_a_span_equals_recomputing_without_it(real_engine):
    head = prompt_ids(real_engine, "My name is Alice.")
    span = prompt_ids(real_engine, " I live in Paris and I love cheese.")
    rest = prompt_ids(real_engine, " My name is")
    full = head + span + rest
    kv_len = len(full)
    mask = tuple((len(head), len(span), kv_len - len(head) - len(span)) for _ in full)
    masked = distribution_at_end(real_engine, full, 0, (120, 121, 122)[:(kv_len + 15) // 16], mask)
    # recompute without the span, keeping the original positions of `rest`
    request_head = fill(head, 0, (130,), 16, samplers=(TOP10,))
    real_engine.forward(ForwardBatch((request_head,)))
    start = len(head) + len(span)
    rest_request = ForwardRequest(tuple(rest), tuple(range(start, start + len(rest))), (130,),
                                  len(head) + len(rest), (len(rest) - 1,), (TOP10,))
    (expected,) = real_engine.forward(ForwardBatch((rest_request,)))
    assert_same_distribution(masked, expected.outputs[0])
    unmasked = distribution_at_end(real_engine, full, 0, (123, 124, 125)[:(kv_len + 15) // 16])
    assert unmasked.probs[0] != pytest.approx(masked.probs[0], abs=1e-3)   # the mask mattered


def test_statistics_count_batches_tokens_outputs_and_copies(make_tiny_engine):
    engine = make_tiny_engine(page_size=4)
    sample = SamplerSpec(kind="sample", temperature=0.8, seed=3)
    engine.forward(ForwardBatch((fill([1, 2, 3], 0, (0,), 4, outputs=(1, 2), samplers=(GREEDY, sample)),
                                 fill([4], 0, (1,), 4, outputs=()))))
    engine.copy_tokens([TokenCopy(0, 2, 0, 0, 3)])
    stats = engine.statistics()
    assert (stats.num_batches, stats.num_requests, stats.num_input_tokens,
            stats.num_output_tokens, stats.num_copied_tokens) == (1, 2, 4, 2, 3)
    assert torch.equal(engine.kv_cache.pool[:, 2, :, :3], engine.kv_cache.pool[:, 0, :, :3])
