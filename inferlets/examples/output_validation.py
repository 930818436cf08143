"""Output validation: score candidate answers by the model's probability of each, normalised.

    pie run inferlets/examples/output_validation.py -- --prompt "The capital of France is" \
        --candidate " Paris" --candidate " London" --candidate " Rome"

The prompt is computed once; each candidate is a fork that walks the candidate's tokens, one pass
per token, reading the probability of the next candidate token from a `distribution` output (the
--num-top most likely tokens). All candidates' passes of a step are in flight together. A token
outside the top --num-top is counted at the smallest probability listed (an upper bound).
Returns JSON: {candidates: [{text, log_prob, per_token, probability}], best}: `probability` is
P(candidate) / sum over the candidates, `per_token` exp(mean log probability).
"""
import math

import inferlet
from inferlet.generation import wait_outputs


def token_probability(distribution, token_id: int) -> float:
    """P(token_id) from a top-k distribution output (the k-th probability if it is absent)."""
    for listed_id, prob in zip(distribution.token_ids, distribution.probs):
        if listed_id == token_id:
            return prob
    return min(distribution.probs)


def score(prompt: inferlet.Context, candidates: list[list[int]], num_top: int) -> list[float]:
    """Sum of log probabilities of each candidate's tokens after the prompt."""
    sampler = inferlet.sampling.distribution(num_top)
    forks = [prompt.fork() for _ in candidates]
    for fork in forks:
        fork.reopen_last_token()   # its pass yields the distribution of the first candidate token
    log_probs = [0.0] * len(candidates)
    for step in range(max(map(len, candidates))):
        live = [i for i, ids in enumerate(candidates) if step < len(ids)]
        futures = [(i, forks[i].submit(forks[i].take_pending(), sampler)) for i in live]
        for i, future in futures:
            distribution = wait_outputs(future)[0].value
            forks[i].passes_done()
            log_probs[i] += math.log(max(token_probability(distribution, candidates[i][step]), 1e-30))
            forks[i].accept(candidates[i][step])
    for fork in forks:
        fork.close()
    return log_probs


@inferlet.main
def main(args: list[str]) -> dict:
    parser = inferlet.ArgumentParser(prog="output_validation", description="Rank candidate answers.")
    parser.add_argument("--prompt", default="The capital of France is")
    parser.add_argument("--candidate", action="append", help="a candidate answer (repeat)")
    parser.add_argument("--num-top", type=int, default=64)
    opts = parser.parse_args(args)
    texts = opts.candidate or [" Paris", " London", " Rome"]
    candidates = [inferlet.encode(text) for text in texts]
    if not all(candidates) or opts.num_top < 1:
        raise inferlet.InferletError("every candidate needs a token and --num-top must be >= 1")

    prompt = inferlet.Context()
    prompt.fill(opts.prompt)
    log_probs = score(prompt, candidates, opts.num_top)
    prompt.close()
    peak = max(log_probs)
    total = sum(math.exp(lp - peak) for lp in log_probs)
    ranked = sorted(({"text": text, "log_prob": lp, "per_token": math.exp(lp / len(ids)),
                      "probability": math.exp(lp - peak) / total}
                     for text, ids, lp in zip(texts, candidates, log_probs)),
                    key=lambda c: c["probability"], reverse=True)
    return {"candidates": ranked, "best": ranked[0]["text"]}
