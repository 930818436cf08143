"""Graph of thought: proposals generated in parallel, then aggregated in stages (pairs merged
into one), until one remains. Every node is a fork of the task's context (computed once).

    pie run inferlets/examples/graph_of_thought.py -- --task "Name a cafe." --num-proposals 4

Stage 0: --num-proposals proposals (seeded samples, generated together). Each later stage merges
pairs of the previous stage's nodes ("Combine A and B into one better answer"), all merges of a
stage generated together; an odd node out passes on unchanged.
Returns JSON: {nodes: [{id, stage, text, parents}], answer}.
"""
import inferlet


@inferlet.main
def main(args: list[str]) -> dict:
    parser = inferlet.ArgumentParser(prog="graph_of_thought", description="Aggregate proposals.")
    parser.add_argument("--task", default="Suggest a name for a bakery.")
    parser.add_argument("--num-proposals", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    opts = parser.parse_args(args)
    if opts.num_proposals < 1 or opts.max_tokens < 1:
        raise inferlet.InferletError("--num-proposals and --max-tokens must be >= 1")

    task = inferlet.Context()
    task.fill(inferlet.render_chat([("user", opts.task)], True))
    task.flush()
    nodes = []
    forks = [task.fork() for _ in range(opts.num_proposals)]
    samplers = [inferlet.sampling.temperature(0.9, seed=opts.seed + i) for i in range(len(forks))]
    for fork, gen in zip(forks, inferlet.generate_parallel(forks, opts.max_tokens, samplers)):
        nodes.append({"id": len(nodes), "stage": 0, "text": gen.text.strip(), "parents": []})
        fork.close()
    stage_ids, stage = [node["id"] for node in nodes], 0
    while len(stage_ids) > 1:
        stage += 1
        pairs = [stage_ids[i:i + 2] for i in range(0, len(stage_ids) - 1, 2)]
        forks = []
        for a, b in pairs:
            fork = task.fork()
            fork.fill(f"Answer A: {nodes[a]['text']}\nAnswer B: {nodes[b]['text']}\n"
                      f"Combine A and B into one better answer:")
            forks.append(fork)
        next_ids = []
        for (a, b), fork, gen in zip(pairs, forks, inferlet.generate_parallel(forks, opts.max_tokens)):
            nodes.append({"id": len(nodes), "stage": stage, "text": gen.text.strip(), "parents": [a, b]})
            next_ids.append(nodes[-1]["id"])
            fork.close()
        if len(stage_ids) % 2:
            next_ids.append(stage_ids[-1])
        stage_ids = next_ids
    task.close()
    return {"nodes": nodes, "answer": nodes[stage_ids[0]]["text"]}
