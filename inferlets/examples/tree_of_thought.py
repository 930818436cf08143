"""Tree of thought: propose several next steps per node, let the model rate them, keep the best,
go deeper; every node is a fork of its parent (the path so far is computed once).

    pie run inferlets/examples/tree_of_thought.py -- --problem "Plan a picnic." --breadth 3 --depth 2

Each level: every kept node proposes --breadth steps (seeded samples, generated together); each
step is rated by the model: P(" yes") / (P(" yes") + P(" no")) after "Is this step useful?",
read from one `distribution` pass per step (all in flight together); the --keep best survive.
Returns JSON: {best: [steps], score, levels: [[{steps, score}]], num_nodes}.
"""
import inferlet
from inferlet.generation import wait_outputs

QUESTION = "\nIs this step useful? Answer yes or no:"


def yes_probability(contexts: list, question: str) -> list[float]:
    """P(yes) / (P(yes) + P(no)) of each context's answer to `question` (forks, in parallel)."""
    yes_ids = set(inferlet.encode(" yes") + inferlet.encode(" Yes"))
    no_ids = set(inferlet.encode(" no") + inferlet.encode(" No"))
    sampler = inferlet.sampling.distribution(50)
    forks = [ctx.fork() for ctx in contexts]
    futures = []
    for fork in forks:
        fork.fill(question)
        futures.append(fork.submit(fork.take_pending(), sampler))
    scores = []
    for fork, future in zip(forks, futures):
        dist = wait_outputs(future)[0].value
        fork.passes_done()
        yes = sum(p for t, p in zip(dist.token_ids, dist.probs) if t in yes_ids)
        no = sum(p for t, p in zip(dist.token_ids, dist.probs) if t in no_ids)
        scores.append(yes / (yes + no) if yes + no > 0 else 0.0)
        fork.close()
    return scores


@inferlet.main
def main(args: list[str]) -> dict:
    parser = inferlet.ArgumentParser(prog="tree_of_thought", description="Search a tree of steps.")
    parser.add_argument("--problem", default="How can a small town reduce traffic?")
    parser.add_argument("--breadth", type=int, default=2, help="steps proposed per node")
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--keep", type=int, default=2, help="nodes kept per level")
    parser.add_argument("--step-tokens", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    opts = parser.parse_args(args)
    if min(opts.breadth, opts.depth, opts.keep, opts.step_tokens) < 1:
        raise inferlet.InferletError("--breadth, --depth, --keep and --step-tokens must be >= 1")

    root = inferlet.Context()
    root.fill(inferlet.render_chat([("user", f"{opts.problem} Solve it in short steps.")], True))
    frontier, levels, num_nodes = [(root, [], 1.0)], [], 0
    for depth in range(opts.depth):
        children = []
        for ctx, steps, _ in frontier:
            for _ in range(opts.breadth):
                child = ctx.fork()
                child.fill(f"\nStep {depth + 1}:")
                children.append((child, steps))
        samplers = [inferlet.sampling.temperature(0.8, seed=opts.seed + num_nodes + i)
                    for i in range(len(children))]
        generations = inferlet.generate_parallel([c for c, _ in children], opts.step_tokens,
                                                 samplers, stop="\n")
        num_nodes += len(children)
        scores = yes_probability([c for c, _ in children], QUESTION)
        scored = sorted(((c, steps + [g.text.strip()], s)
                         for (c, steps), g, s in zip(children, generations, scores)),
                        key=lambda node: node[2], reverse=True)
        levels.append([{"steps": steps, "score": s} for _, steps, s in scored])
        for ctx, _, _ in frontier:
            ctx.close()
        for ctx, _, _ in scored[opts.keep:]:
            ctx.close()
        frontier = scored[:opts.keep]
    best_ctx, best_steps, best_score = frontier[0]
    for ctx, _, _ in frontier:
        ctx.close()
    return {"best": best_steps, "score": best_score, "levels": levels, "num_nodes": num_nodes}
