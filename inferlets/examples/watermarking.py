"""Watermarking: a green list keyed by the previous token biases every sampled token, and a
detector counts green tokens (Kirchenbauer et al.'s scheme).

    pie run inferlets/examples/watermarking.py -- --prompt "The weather today" --max-tokens 48
    pie run inferlets/examples/watermarking.py -- --detect "some text"

The SDK cannot bias logits on the host, so the bias is applied to the top-k distribution the host
returns (`sampling.distribution(--top-k)`): green tokens' probabilities are multiplied by
e^--delta, renormalised, and the inferlet draws the token itself (seeded by --seed). A token is
green when a hash of (--key, previous token, token) falls below --gamma of its range.
Returns JSON: {text, token_ids, num_green, z_score}; with --detect TEXT only
{num_tokens, num_green, z_score} of TEXT's tokens (z above ~4: watermarked).
"""
import math
import random

import inferlet
from inferlet.generation import wait_outputs


def is_green(key: int, previous_id: int, token_id: int, gamma: float) -> bool:
    """Whether `token_id` is on the green list seeded by `previous_id` (a 32-bit mix hash)."""
    h = (key * 0x9E3779B1 ^ previous_id * 0x85EBCA77 ^ token_id * 0xC2B2AE3D) & 0xFFFFFFFF
    h = ((h ^ (h >> 16)) * 0x45D9F3B) & 0xFFFFFFFF
    h ^= h >> 16
    return h < gamma * 2**32


def z_score(key: int, token_ids: list[int], gamma: float) -> tuple[int, float]:
    """(green tokens among token_ids[1:], their z-score against a fraction gamma by chance)."""
    num = len(token_ids) - 1
    green = sum(is_green(key, a, b, gamma) for a, b in zip(token_ids, token_ids[1:]))
    return green, (green - gamma * num) / math.sqrt(max(num, 1) * gamma * (1 - gamma))


def draw(distribution, previous_id: int, opts, rng: random.Random) -> int:
    """A token from the biased, renormalised top-k distribution."""
    bias = math.exp(opts.delta)
    weights = [p * (bias if is_green(opts.key, previous_id, t, opts.gamma) else 1.0)
               for t, p in zip(distribution.token_ids, distribution.probs)]
    return rng.choices(list(distribution.token_ids), weights=weights)[0]


@inferlet.main
def main(args: list[str]) -> dict:
    parser = inferlet.ArgumentParser(prog="watermarking", description="Watermarked generation.")
    parser.add_argument("--prompt", default="Here is a short story about a lighthouse keeper.")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--key", type=int, default=42)
    parser.add_argument("--gamma", type=float, default=0.5, help="green share of the vocabulary")
    parser.add_argument("--delta", type=float, default=2.0, help="log-bias of green tokens (0: off)")
    parser.add_argument("--top-k", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--detect", default=None, help="only detect: the text to test")
    opts = parser.parse_args(args)
    if not 0 < opts.gamma < 1 or opts.top_k < 1 or opts.delta < 0:
        raise inferlet.InferletError("need 0 < --gamma < 1, --top-k >= 1 and --delta >= 0")
    if opts.detect is not None:
        token_ids = inferlet.encode(opts.detect)
        green, z = z_score(opts.key, token_ids, opts.gamma)
        return {"num_tokens": len(token_ids), "num_green": green, "z_score": z}

    ctx = inferlet.Context()
    ctx.fill(opts.prompt)
    rng, sampler = random.Random(opts.seed), inferlet.sampling.distribution(opts.top_k)
    token_ids = []
    while len(token_ids) < opts.max_tokens:
        distribution = wait_outputs(ctx.submit(ctx.take_pending(), sampler))[0].value
        ctx.passes_done()
        token_id = draw(distribution, ctx.token_ids[-1], opts, rng)
        if token_id in ctx.stop_token_ids:
            break
        token_ids.append(token_id)
        ctx.accept(token_id)
    ctx.close()
    green, z = z_score(opts.key, token_ids, opts.gamma)
    return {"text": inferlet.decode(token_ids), "token_ids": token_ids, "num_green": green,
            "z_score": z}
