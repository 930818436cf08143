"""Research agent: split a question into sub-questions, research each in a child inferlet, merge.

    pie run inferlets/examples/research_agent.py -- --question "Why do cities grow?"

The parent plans (a numbered list of sub-questions), then spawns one child per sub-question:
the same program in its child mode (`--sub-question`), running concurrently with the others in
the host's batches. Each child streams a progress note to its parent (`inferlet.send`) and
returns its finding; the parent merges the findings into one answer. A child that fails is
reported, not fatal. The children end with the parent (none is detached).
Returns JSON: {sub_questions, findings, answer, children}.
"""
import json

import inferlet


def parse_lines(text: str, limit: int) -> list[str]:
    """A numbered or bulleted list's items, without their markers, at most `limit`."""
    items = []
    for line in text.splitlines():
        item = line.strip().lstrip("-*").strip()
        head, _, rest = item.partition(".")
        if head.isdigit():
            item = rest.strip()
        if item:
            items.append(item)
    return items[:limit]


def research(sub_question: str, num_tokens: int) -> str:
    """The child: answer one sub-question briefly; tell the parent when it starts."""
    inferlet.send(json.dumps({"researching": sub_question}))
    ctx = inferlet.Context()
    ctx.fill_system("You are a careful researcher. Answer in one or two factual sentences.")
    ctx.fill_user(sub_question)
    return ctx.generate(num_tokens).strip()


@inferlet.main
def main(args: list[str]) -> str:
    parser = inferlet.ArgumentParser(prog="research_agent", description=__doc__)
    parser.add_argument("--question", default="Why do cities grow?")
    parser.add_argument("--num-sub-questions", type=int, default=3)
    parser.add_argument("--plan-tokens", type=int, default=48)
    parser.add_argument("--finding-tokens", type=int, default=32)
    parser.add_argument("--answer-tokens", type=int, default=48)
    parser.add_argument("--sub-question", default=None, help="child mode: research this one")
    opts = parser.parse_args(args)
    if opts.sub_question is not None:
        return research(opts.sub_question, opts.finding_tokens)

    plan = inferlet.Context()
    plan.fill_user(f"{opts.question}\nList {opts.num_sub_questions} short sub-questions that "
                   f"would answer it, numbered, one per line.")
    sub_questions = parse_lines(plan.generate(opts.plan_tokens), opts.num_sub_questions)
    sub_questions = sub_questions or [opts.question]
    children = [inferlet.spawn("", ["--sub-question", sub, "--finding-tokens",
                                    str(opts.finding_tokens)]) for sub in sub_questions]
    findings, notes = [], []
    for child in children:
        while (note := child.receive()) is not None:
            notes.append(json.loads(note))
        try:
            findings.append(child.result())
        except inferlet.ChildError as exc:
            findings.append(f"(no finding: {exc})")

    merge = inferlet.Context()
    merge.fill_user(f"Question: {opts.question}\nFindings:\n" + "\n".join(
        f"- {sub}: {finding}" for sub, finding in zip(sub_questions, findings))
        + "\nMerge the findings into one short answer.")
    answer = merge.generate(opts.answer_tokens).strip()
    return json.dumps({"sub_questions": sub_questions, "findings": findings, "answer": answer,
                       "children": [child.id for child in children], "notes": notes})
