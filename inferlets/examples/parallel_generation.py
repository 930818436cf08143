"""Parallel generation: one prefix, computed once, then N forks generated together.

    pie run inferlets/examples/parallel_generation.py -- --prefix "Three facts:" \
        --suffix " Fact 1:" --suffix " Fact 2:"

Each fork shares the prefix's KV pages (copy-on-write of the partial last page) and generates on
its own queue; every step submits all forks' passes before waiting, so they share batches.
Returns JSON: [{suffix, text, token_ids}, ...].
"""
import inferlet


@inferlet.main
def main(args: list[str]) -> list:
    parser = inferlet.ArgumentParser(prog="parallel_generation", description=__doc__)
    parser.add_argument("--prefix", default="Here are some short stories about animals.\n")
    parser.add_argument("--suffix", action="append", default=None,
                        help="one per fork (repeat); default: --num-forks numbered stories")
    parser.add_argument("--num-forks", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=24)
    opts = parser.parse_args(args)
    suffixes = opts.suffix or [f"Story {i + 1}:" for i in range(opts.num_forks)]

    prefix = inferlet.Context()
    prefix.fill(opts.prefix)
    forks = [prefix.fork() for _ in suffixes]   # the first fork computes the prefix
    for fork, suffix in zip(forks, suffixes):
        fork.fill(suffix)
    generations = inferlet.generate_parallel(forks, opts.max_tokens)
    return [{"suffix": s, "text": g.text, "token_ids": g.token_ids}
            for s, g in zip(suffixes, generations)]
