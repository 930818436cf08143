"""Per-technique rows of bench/apps.py: each example inferlet vs the nearest thing a client can do
over the OpenAI API on the same server (tokens the engine computed, wall time).

The API side replays the same work with the texts the inferlet produced (so both sides generate
from the same prompts), but as independent requests that each resend their whole prompt:
- prefix_tree: 8 completions, one per leaf, each with its full root + path prompt.
- attention_sink: one completion over the whole long input (no window: every page held).
- beam_search: one request with n = beam width samples (the API's n forks the prompt too).
- tree_of_thought: per node, a completion of the path so far, and a 1-token rating completion.
- graph_of_thought: the proposals as one n-sample request, then one completion per merge.
API prompts are plain text (no chat template), so they are a few tokens shorter than the
inferlet's; output_validation has no API row (pie's endpoint returns no log probabilities).
"""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import openai

__all__ = ["run_techniques"]

EXAMPLES = Path(__file__).resolve().parents[1] / "inferlets" / "examples"
TOT_QUESTION = "\nIs this step useful? Answer yes or no:"

TECHNIQUES = {
    "prefix_tree": ["--max-tokens", "8"],
    "attention_sink": ["--num-chunks", "12", "--window", "48", "--max-tokens", "16"],
    "beam_search": ["--prompt", "The best way to learn a language is", "--beam-width", "4",
                    "--max-tokens", "8"],
    "tree_of_thought": ["--breadth", "2", "--depth", "2", "--keep", "1", "--step-tokens", "8"],
    "graph_of_thought": ["--num-proposals", "4", "--max-tokens", "8"],
}


def api_stages(name: str, args: list[str], result) -> list[list[dict]]:
    """The API requests equivalent to one run of `name`: stages run one after the other, the
    requests of a stage concurrently. Each request: {prompt, max_tokens, n}."""
    if name == "prefix_tree":
        root = "Write about nature.\n"
        return [[{"prompt": root + "".join(leaf["path"]), "max_tokens": 8, "n": 1}
                 for leaf in result["leaves"]]]
    if name == "attention_sink":
        text = ("The river ran past the old mill, where the miller counted sacks of grain each "
                "morning and sang to the birds on the roof. ")
        return [[{"prompt": text * 12 + "\nIn short,", "max_tokens": 16, "n": 1}]]
    if name == "beam_search":
        return [[{"prompt": args[1], "max_tokens": 8, "n": 4}]]
    if name == "tree_of_thought":
        problem = "How can a small town reduce traffic? Solve it in short steps."
        stages = []
        for depth, level in enumerate(result["levels"]):
            paths = [problem + "".join(f"\nStep {i + 1}: {s}" for i, s in enumerate(node["steps"][:-1]))
                     + f"\nStep {depth + 1}:" for node in level]
            stages.append([{"prompt": p, "max_tokens": 8, "n": 1} for p in paths])
            stages.append([{"prompt": p + " " + node["steps"][-1] + TOT_QUESTION, "max_tokens": 1,
                            "n": 1} for p, node in zip(paths, level)])
        return stages
    if name == "graph_of_thought":
        task = "Suggest a name for a bakery."
        nodes = result["nodes"]
        stages = [[{"prompt": task, "max_tokens": 8, "n": sum(n["stage"] == 0 for n in nodes)}]]
        for stage in range(1, max(n["stage"] for n in nodes) + 1):
            stages.append([{"prompt": f"{task}\nAnswer A: {nodes[a]['text']}\nAnswer B: "
                            f"{nodes[b]['text']}\nCombine A and B into one better answer:",
                            "max_tokens": 8, "n": 1}
                           for n in nodes if n["stage"] == stage for a, b in [n["parents"]]])
        return stages
    raise KeyError(name)


async def run_stages(url: str, token: str, stages: list[list[dict]]) -> int:
    """Run the requests; returns the completion tokens generated."""
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=token, max_retries=0, timeout=900,
                                http_client=httpx.AsyncClient())
    generated = 0
    for stage in stages:
        responses = await asyncio.gather(*(client.completions.create(
            model="SmolLM2-135M-Instruct", prompt=r["prompt"], max_tokens=r["max_tokens"], n=r["n"], temperature=0)
            for r in stage))
        generated += sum(r.usage.completion_tokens for r in responses)
    await client.close()
    return generated


def run_techniques(server, measure_tokens) -> list[dict]:
    """One row per technique: {technique, inferlet: {computed, wall_s}, api: {...}}."""
    from host.sandbox.build import build_cached
    from host.client import SyncClient
    print(f"\n{'technique':<18} {'computed':>9} {'api':>9} {'wall s':>7} {'api':>7} {'ratio':>6}",
          flush=True)
    rows = []
    with SyncClient(server.url, server.token) as client:
        for name, args in TECHNIQUES.items():
            program = client.upload(build_cached(EXAMPLES / f"{name}.py")[0].read_bytes())
            box = {}

            def run_inferlet() -> None:
                final = client.wait(client.launch(program, args))
                if final.kind != "result":
                    raise RuntimeError(f"{name}: {final.kind}: {final.data}")
                box["result"] = json.loads(final.data)
            pie = measure_tokens(run_inferlet)
            stages = api_stages(name, args, box["result"])
            api = measure_tokens(lambda: asyncio.run(run_stages(server.url, server.token, stages)))
            rows.append({"technique": name, "inferlet": pie, "api": api,
                         "wall_ratio": round(api["wall_s"] / pie["wall_s"], 2)})
            print(f"{name:<18} {pie['computed']:>9} {api['computed']:>9} {pie['wall_s']:>7.2f} "
                  f"{api['wall_s']:>7.2f} {rows[-1]['wall_ratio']:>5.2f}x", flush=True)
    return rows

