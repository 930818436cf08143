"""Test app for structured output, log-probabilities, penalties and probes. argv[0] picks the mode;
the result is JSON."""
import json

import inferlet
from inferlet._wit import Err, forward


def _ctx(prompt: str) -> inferlet.Context:
    ctx = inferlet.Context()
    ctx.fill_user(prompt)
    return ctx


def regex(pattern: str, seed: str) -> dict:
    with _ctx("Give me a phone number.") as ctx:
        sampler = inferlet.sampling.temperature(1.0, seed=int(seed))
        return {"text": ctx.generate(24, sampler, regex=pattern)}


def lark(grammar: str) -> dict:
    with _ctx("Is the sky blue?") as ctx:
        return {"text": ctx.generate(24, grammar=grammar)}


def logprobs(prompt: str) -> dict:
    with inferlet.Context() as ctx:
        ctx.fill(prompt)
        gen = ctx.generation(4, inferlet.Sampler("sample", temperature=0.8, seed=5, logprobs=3)).run()
        return {"token_ids": gen.token_ids,
                "logprobs": [[t.token_id, t.logprob, t.top] for t in gen.logprobs]}


def penalty(prompt: str, frequency: str) -> dict:
    with inferlet.Context() as ctx:
        ctx.fill(prompt)
        sampler = inferlet.Sampler(frequency_penalty=float(frequency),
                                   presence_penalty=float(frequency))
        return {"token_ids": ctx.generate_tokens(12, sampler, stop_token_ids=())}


def entropy(prompt: str) -> dict:
    with inferlet.Context() as ctx:
        ctx.fill(prompt)
        future = ctx.submit(ctx.take_pending(), inferlet.sampling.entropy(),
                            inferlet.sampling.entropy().options_wit())
        (output,) = inferlet.wait_outputs(future, sampled=True)
        ctx.passes_done()
        return {"entropy": output.value}


def bad_grammar() -> dict:
    try:
        forward.create_generation(forward.Grammar_Lark("start: nowhere"))
    except Err as err:
        return {"err": err.value}
    return {"err": None}


def hostile(which: str) -> dict:
    """Misuse the contract: the instance must trap naming the cause."""
    ctx = inferlet.Context()
    ctx.fill("Hello")
    sampler = inferlet.sampling.greedy()
    options = sampler.options_wit()
    if which == "bias":
        options.logit_bias = [(10**6, 1.0)]
    elif which == "generation":
        options.generation = 12345
    elif which == "penalty":
        options.presence_penalty = 9.0
    if which == "verify":
        inferlet.speculative.submit_verify(ctx, ctx.take_pending(), 0, sampler, options)
    else:
        ctx.submit(ctx.take_pending(), sampler, options)
    return {"trapped": False}


MODES = {"hostile": hostile, "regex": regex, "lark": lark, "logprobs": logprobs, "penalty": penalty,
         "entropy": entropy, "bad_grammar": bad_grammar}


@inferlet.main
def main(args: list[str]) -> str:
    return json.dumps(MODES[args[0]](*args[1:]))
