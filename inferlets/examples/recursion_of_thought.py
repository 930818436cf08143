"""Recursion of thought: a question is split into sub-questions, each answered recursively (in a
fork of the instructions' context, computed once), then the answers are combined.

    pie run inferlets/examples/recursion_of_thought.py -- --question "How do bees make honey?" --depth 2

At depth 0 a question is answered directly; above, the model lists at most --num-subquestions
sub-questions ("1. ...", "2. ..."), every sub-question is solved at depth - 1 (the direct answers
of one level generated together), and a final pass answers the question from the sub-answers.
Returns JSON: the root node {question, answer, subproblems: [node, ...]} and num_calls.
"""
import inferlet


def parse_questions(text: str, limit: int) -> list[str]:
    """The numbered lines of `text` ("1. ..."), without their numbers, at most `limit`."""
    questions = []
    for line in text.splitlines():
        head, _, rest = line.strip().partition(".")
        if head.isdigit() and rest.strip():
            questions.append(rest.strip())
    return questions[:limit]


class Solver:
    """Answers questions in forks of `base` (the shared instructions)."""

    def __init__(self, base: inferlet.Context, opts) -> None:
        self.base, self.opts, self.num_calls = base, opts, 0

    def generate(self, prompts: list[str], max_tokens: int) -> list[str]:
        """One fork of the base per prompt, all generated together."""
        forks = [self.base.fork() for _ in prompts]
        for fork, prompt in zip(forks, prompts):
            fork.fill(prompt)
        texts = [g.text.strip() for g in inferlet.generate_parallel(forks, max_tokens)]
        for fork in forks:
            fork.close()
        self.num_calls += len(prompts)
        return texts

    def solve(self, questions: list[str], depth: int) -> list[dict]:
        """Nodes {question, answer, subproblems} of `questions`, solved at `depth`."""
        if depth == 0:
            answers = self.generate([f"Question: {q}\nShort answer:" for q in questions],
                                    self.opts.answer_tokens)
            return [{"question": q, "answer": a, "subproblems": []} for q, a in zip(questions, answers)]
        splits = self.generate([f"Question: {q}\nList {self.opts.num_subquestions} simpler "
                                f"questions that help answer it.\n1." for q in questions],
                               self.opts.split_tokens)
        nodes = []
        for question, split in zip(questions, splits):
            subquestions = parse_questions("1." + split, self.opts.num_subquestions)
            nodes.append({"question": question, "subproblems": self.solve(subquestions, depth - 1)
                          if subquestions else []})
        prompts = ["".join(f"Q: {s['question']}\nA: {s['answer']}\n" for s in node["subproblems"])
                   + f"Question: {node['question']}\nShort answer:" for node in nodes]
        for node, answer in zip(nodes, self.generate(prompts, self.opts.answer_tokens)):
            node["answer"] = answer
        return nodes


@inferlet.main
def main(args: list[str]) -> dict:
    parser = inferlet.ArgumentParser(prog="recursion_of_thought", description=__doc__)
    parser.add_argument("--question", default="How can I learn to cook?")
    parser.add_argument("--depth", type=int, default=1)
    parser.add_argument("--num-subquestions", type=int, default=2)
    parser.add_argument("--split-tokens", type=int, default=32)
    parser.add_argument("--answer-tokens", type=int, default=16)
    opts = parser.parse_args(args)
    if not 0 <= opts.depth <= 3 or opts.num_subquestions < 1:
        raise inferlet.InferletError("--depth must be 0..3 and --num-subquestions >= 1")

    base = inferlet.Context()
    base.fill("You answer questions briefly and break hard ones into simpler ones.\n\n")
    solver = Solver(base, opts)
    (root,) = solver.solve([opts.question], opts.depth)
    base.close()
    return {**root, "num_calls": solver.num_calls}
