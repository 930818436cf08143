"""Skeleton of thought: outline an answer, then expand every point in parallel, then join.

    pie run inferlets/examples/skeleton_of_thought.py -- --question "How do I start running?"

The outline is generated once; each point is expanded in a fork of the outline's context (the
question and outline are computed once and shared), all forks generated together.
Returns JSON: {skeleton, points, expansions, answer}.
"""
import inferlet


def parse_points(skeleton: str, max_points: int) -> list[str]:
    """The outline's lines, without list markers ("1.", "-", "*"), at most `max_points`."""
    points = []
    for line in skeleton.splitlines():
        text = line.strip().lstrip("-*").strip()
        head, _, rest = text.partition(".")
        if head.isdigit():
            text = rest.strip()
        if text:
            points.append(text)
    return points[:max_points]


@inferlet.main
def main(args: list[str]) -> dict:
    parser = inferlet.ArgumentParser(prog="skeleton_of_thought", description=__doc__)
    parser.add_argument("--question", default="How can I sleep better?")
    parser.add_argument("--num-points", type=int, default=3)
    parser.add_argument("--skeleton-tokens", type=int, default=48)
    parser.add_argument("--point-tokens", type=int, default=24)
    opts = parser.parse_args(args)

    ctx = inferlet.Context()
    ctx.fill_user(f"{opts.question}\nGive only a numbered outline of {opts.num_points} short points.")
    skeleton = ctx.generate(opts.skeleton_tokens)
    points = parse_points(skeleton, opts.num_points) or [opts.question]
    forks = [ctx.fork() for _ in points]
    for fork, point in zip(forks, points):
        fork.fill_user(f"Explain this point in one or two sentences: {point}")
    generations = inferlet.generate_parallel(forks, opts.point_tokens)
    expansions = [g.text.strip() for g in generations]
    answer = "\n".join(f"{i + 1}. {p}: {e}" for i, (p, e) in enumerate(zip(points, expansions)))
    return {"skeleton": skeleton, "points": points, "expansions": expansions, "answer": answer}
