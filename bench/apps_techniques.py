"""Per-technique rows of bench/apps.py: each example inferlet vs the nearest thing a client can do
over the OpenAI API on the same server (tokens the engine computed, wall time, and a quality
measure where one applies).

The API side replays the same work with the texts the inferlet produced (so both sides generate
from the same prompts), but as independent requests that each resend their whole prompt:
- prefix_tree: 8 completions, one per leaf, each with its full root + path prompt.
- attention_sink: one completion over the whole long input (no window: every page held).
- beam_search: one request with n = beam width samples (the API's n forks the prompt too).
- tree_of_thought: per node, a completion of the path so far, and a 1-token rating completion.
- graph_of_thought: the proposals as one n-sample request, then one completion per merge.
- recursion_of_thought, json_extractor, speculative, output_validation, watermarking,
  hierarchical_attention: bench/apps_techniques_more.py (its docstring says what each replays,
  and the quality measure each row reports, inferlet and API side by side).
Each inferlet runs once unmeasured first: its first instantiation costs about 10 s (Wasm
compile), and the first schema-constrained run about 2.5 s more, a one-time cost per server
that the API path, run after it, would not pay.
API prompts are plain text (no chat template) unless the inferlet fills a chat turn, so most are
a few tokens shorter than the inferlet's.
"""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import openai

from apps_techniques_more import MORE_TECHNIQUES, more_api_stages, more_quality

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
    **MORE_TECHNIQUES,
}


def api_stages(name: str, args: list[str], result) -> list[list[dict]]:
    """The API requests equivalent to one run of `name`: stages run one after the other, the
    requests of a stage concurrently. Each request: {prompt or messages, max_tokens, n} and
    optionally options (more keyword arguments of the openai call; temperature 0 unless set)."""
    if name in MORE_TECHNIQUES:
        return more_api_stages(name, result)
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


async def run_stages(url: str, token: str, stages: list[list[dict]]) -> list:
    """Run the requests, stage after stage; the responses in request order."""
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=token, max_retries=0, timeout=900,
                                http_client=httpx.AsyncClient())

    def call(request: dict):
        options = {"temperature": 0, **request.get("options", {})}
        if "messages" in request:
            return client.chat.completions.create(
                model="SmolLM2-135M-Instruct", messages=request["messages"],
                max_tokens=request["max_tokens"], n=request["n"], **options)
        return client.completions.create(
            model="SmolLM2-135M-Instruct", prompt=request["prompt"],
            max_tokens=request["max_tokens"], n=request["n"], **options)
    responses = []
    for stage in stages:
        responses += await asyncio.gather(*(call(r) for r in stage))
    await client.close()
    return responses


def run_example(client, program: str, name: str, argv: list[str]):
    """One run of an uploaded example; its result, JSON-decoded where it is JSON."""
    final = client.wait(client.launch(program, argv))
    if final.kind != "result":
        raise RuntimeError(f"{name}: {final.kind}: {final.data}")
    try:
        return json.loads(final.data)
    except json.JSONDecodeError:
        return final.data


def print_row(row: dict) -> None:
    pie, api = row["inferlet"], row["api"]
    quality = json.dumps(row["quality"]) if row.get("quality") else ""
    print(f"{row['technique']:<22} {pie['computed']:>9} {api['computed']:>9} {pie['wall_s']:>7.2f} "
          f"{api['wall_s']:>7.2f} {row['wall_ratio']:>5.2f}x {quality}", flush=True)


def run_techniques(server, measure_tokens) -> list[dict]:
    """One row per technique: {technique, inferlet: {computed, wall_s}, api: {...}, wall_ratio,
    quality (None where no measure applies)}."""
    from host.sandbox.programs.build import build_cached
    from host.client import SyncClient
    print(f"\n{'technique':<22} {'computed':>9} {'api':>9} {'wall s':>7} {'api':>7} {'ratio':>6} "
          "quality", flush=True)
    rows = []
    with SyncClient(server.url, server.token) as client:
        for name, args in TECHNIQUES.items():
            program = client.upload(build_cached(EXAMPLES / f"{name}.py")[0].read_bytes())
            run_example(client, program, name, args)   # warm-up, unmeasured: see the docstring
            box = {}
            pie = measure_tokens(lambda: box.update(
                result=run_example(client, program, name, args)))
            stages = api_stages(name, args, box["result"])
            api = measure_tokens(lambda: box.update(
                responses=asyncio.run(run_stages(server.url, server.token, stages))))
            quality = more_quality(name, box["result"], stages, box["responses"],
                                   lambda argv: run_example(client, program, name, argv)) \
                if name in MORE_TECHNIQUES else None
            rows.append({"technique": name, "inferlet": pie, "api": api,
                         "wall_ratio": round(api["wall_s"] / pie["wall_s"], 2), "quality": quality})
            print_row(rows[-1])
    return rows
