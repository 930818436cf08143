"""Best-of-n by log-probability: sample n answers in parallel, keep the most likely one.

    pie run inferlets/examples/best_of_n.py -- --prompt "Give a name for a cat." --n 4

The prompt's KV is computed once and forked; each fork samples with `logprobs=0` (the host returns
every sampled token's log-probability, log-softmax of the float32 logits, with no extra pass or
distribution request); the answer with the highest mean log-probability wins. --json returns
every candidate with its score.
"""
import inferlet


@inferlet.main
def main(args: list[str]) -> str:
    parser = inferlet.ArgumentParser(prog="best_of_n", description="Best of n samples.")
    parser.add_argument("--prompt", default="Give a name for a cat.")
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="return every candidate and score")
    opts = parser.parse_args(args)

    root = inferlet.Context()
    root.fill_user(opts.prompt)
    root.fill_generation_prompt()
    forks = [root.fork() for _ in range(opts.n)]
    samplers = [inferlet.Sampler("sample", temperature=opts.temperature, seed=opts.seed + i,
                                 logprobs=0) for i in range(opts.n)]
    generations = inferlet.generate_parallel(forks, opts.max_tokens, samplers)
    candidates = [{"text": g.text, "mean_logprob": g.mean_logprob,
                   "logprobs": [t.logprob for t in g.logprobs], "token_ids": g.token_ids}
                  for g in generations]
    for ctx in forks + [root]:
        ctx.close()
    best = max(candidates, key=lambda c: c["mean_logprob"])
    return {"best": best, "candidates": candidates} if opts.json else best["text"]
