"""The API requests, and the quality measures, of six more technique rows of
bench/apps_techniques.py: recursion_of_thought, json_extractor, speculative, output_validation,
watermarking and hierarchical_attention.

Each builder replays one inferlet run as OpenAI requests with the inferlet's own texts (the
arguments below are passed to the inferlet explicitly, so both sides use the same constants):
- recursion_of_thought: the same calls in the same order (split, the sub-answers, the combining
  answer), each a completion that resends the instructions (the inferlet forks their KV).
- json_extractor: one chat request with `response_format` json_schema (the endpoint constrains
  it on the host too); quality: the answer parses and validates against the schema.
- speculative: one greedy chat completion of as many tokens as the inferlet produced
  (ignore_eos); one forward pass per token, against the inferlet's verify passes.
- output_validation: pie's /v1/completions returns log probabilities of generated tokens only
  (`echo` prepends the prompt's text, not its log probabilities), so a candidate's tokens cannot
  be scored as prompt tokens: per candidate token, a 1-token completion of the prompt plus the
  candidate's earlier tokens, forced onto that token by `logit_bias` +100 (the log probability
  reported is of the raw logits, before the bias): exact, one request per candidate token.
- watermarking: plain sampling (temperature 1, the same seed): a client cannot key a bias to the
  previous token; quality: the example's detector z-score of both texts.
- hierarchical_attention: one completion of the whole document as plain text (causal attention).
"""
from __future__ import annotations

import json
import math

__all__ = ["MORE_TECHNIQUES", "more_api_stages", "more_quality"]

ROT_BASE = "You answer questions briefly and break hard ones into simpler ones.\n\n"
ROT_QUESTION = "How can I learn to cook?"
JSON_TEXT = "Ada Lovelace is 36 years old and lives in London."
SPEC_TEXT = ("The quick brown fox jumps over the lazy dog near the river bank, while the old cat "
             "sleeps in the sun.")
OV_PROMPT = "The capital of France is"
OV_CANDIDATES = (" Paris", " London", " Rome", " the city of Lyon")
WM_PROMPT = "Here is a short story about a lighthouse keeper."
HA_SECTIONS = ("Cats|Cats sleep most of the day.|Cats purr.",
               "Dogs|Dogs bark at strangers.|Dogs love walks.")
HA_QUESTION = "Which pet purrs?"

MORE_TECHNIQUES = {
    "recursion_of_thought": ["--question", ROT_QUESTION, "--depth", "1", "--num-subquestions",
                             "2", "--split-tokens", "24", "--answer-tokens", "12"],
    "json_extractor": ["--text", JSON_TEXT, "--max-tokens", "80"],
    "speculative": ["--text", SPEC_TEXT, "--max-tokens", "48", "--json"],
    "output_validation": ["--prompt", OV_PROMPT,
                          *[arg for c in OV_CANDIDATES for arg in ("--candidate", c)]],
    "watermarking": ["--prompt", WM_PROMPT, "--max-tokens", "32", "--seed", "0"],
    "hierarchical_attention": ["--title", "Pets", *[arg for s in HA_SECTIONS
                                                    for arg in ("--section", s)],
                               "--question", HA_QUESTION, "--max-tokens", "16"],
}


def rot_stages(nodes: list[dict], depth: int) -> list[list[dict]]:
    """recursion_of_thought's calls for `nodes` solved at `depth`, in the inferlet's order."""
    def ask(prompt: str, max_tokens: int) -> dict:
        return {"prompt": ROT_BASE + prompt, "max_tokens": max_tokens, "n": 1}
    if depth == 0:
        return [[ask(f"Question: {n['question']}\nShort answer:", 12) for n in nodes]]
    stages = [[ask(f"Question: {n['question']}\nList 2 simpler questions that help answer it.\n1.",
                   24) for n in nodes]]
    for node in nodes:
        if node["subproblems"]:
            stages += rot_stages(node["subproblems"], depth - 1)
    stages.append([ask("".join(f"Q: {s['question']}\nA: {s['answer']}\n" for s in n["subproblems"])
                       + f"Question: {n['question']}\nShort answer:", 12) for n in nodes])
    return stages


def person_schema() -> dict:
    """json_extractor.py's PERSON schema, read from the example's source (no second copy)."""
    import ast
    from apps_techniques import EXAMPLES
    tree = ast.parse((EXAMPLES / "json_extractor.py").read_text())
    (value,) = [node.value for node in tree.body if isinstance(node, ast.Assign)
                and any(getattr(t, "id", None) == "PERSON" for t in node.targets)]
    return ast.literal_eval(value)


def output_validation_stages() -> list[list[dict]]:
    """One forced 1-token completion per candidate token (tokenized as the inferlet does)."""
    from engine.loaders import default_gguf_path
    from engine.loaders.gguf import read_gguf
    from engine.tokenizer import Tokenizer
    tokenizer = Tokenizer.from_gguf_fields(read_gguf(default_gguf_path()).fields)
    requests = []
    for index, text in enumerate(OV_CANDIDATES):
        token_ids = tokenizer.encode(text)
        for step, token_id in enumerate(token_ids):
            requests.append({"prompt": OV_PROMPT + tokenizer.decode(token_ids[:step]),
                             "max_tokens": 1, "n": 1, "candidate": index,
                             "options": {"logprobs": 0, "logit_bias": {str(token_id): 100}}})
    return [requests]


def more_api_stages(name: str, result) -> list[list[dict]]:
    """The API requests equivalent to one run of `name` (see apps_techniques.api_stages)."""
    if name == "recursion_of_thought":
        return rot_stages([result], 1)
    if name == "json_extractor":
        fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": person_schema()}}
        return [[{"messages": [{"role": "system", "content": "Extract the fields as JSON."},
                               {"role": "user", "content": JSON_TEXT}],
                  "max_tokens": 80, "n": 1, "options": {"response_format": fmt}}]]
    if name == "speculative":
        return [[{"messages": [{"role": "user", "content": f"Repeat this text exactly:\n{SPEC_TEXT}"}],
                  "max_tokens": len(result["token_ids"]), "n": 1,
                  "options": {"extra_body": {"ignore_eos": True}}}]]
    if name == "output_validation":
        return output_validation_stages()
    if name == "watermarking":
        return [[{"prompt": WM_PROMPT, "max_tokens": 32, "n": 1,
                  "options": {"temperature": 1.0, "seed": 0}}]]
    if name == "hierarchical_attention":
        document = "# Pets\n" + "".join(
            f"## {heading}\n" + "".join(f"{p}\n" for p in paragraphs)
            for heading, *paragraphs in (s.split("|") for s in HA_SECTIONS))
        return [[{"prompt": f"{document}Question: {HA_QUESTION}\nAnswer:", "max_tokens": 16,
                  "n": 1, "options": {"stop": ["\n"]}}]]
    raise KeyError(name)


def schema_errors(value, schema: dict) -> list[str]:
    """What breaks a flat object schema (type, required, additionalProperties, integer bounds,
    maxLength): the subset PERSON uses."""
    if not isinstance(value, dict):
        return ["not an object"]
    properties = schema.get("properties", {})
    errors = [f"missing {key}" for key in schema.get("required", ()) if key not in value]
    if schema.get("additionalProperties") is False:
        errors += [f"extra {key}" for key in value if key not in properties]
    for key, rule in properties.items():
        item = value.get(key)
        if key not in value:
            continue
        if rule.get("type") == "integer" and (not isinstance(item, int) or isinstance(item, bool)
                                              or not rule.get("minimum", -math.inf) <= item
                                              <= rule.get("maximum", math.inf)):
            errors.append(f"{key} not an integer in range")
        if rule.get("type") == "string" and (not isinstance(item, str)
                                             or len(item) > rule.get("maxLength", math.inf)):
            errors.append(f"{key} not a string within maxLength")
    return errors


def json_quality(text: str) -> dict:
    """{parses, valid} of an answer against PERSON."""
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, TypeError):
        return {"parses": False, "valid": False}
    return {"parses": True, "valid": not schema_errors(value, person_schema())}


def api_probabilities(stage: list[dict], responses: list) -> list[float]:
    """Normalised P(candidate) from the forced 1-token completions."""
    log_probs = [0.0] * len(OV_CANDIDATES)
    for request, response in zip(stage, responses):
        log_probs[request["candidate"]] += response.choices[0].logprobs.token_logprobs[0]
    peak = max(log_probs)
    total = sum(math.exp(lp - peak) for lp in log_probs)
    return [math.exp(lp - peak) / total for lp in log_probs]


def more_quality(name: str, result, stages: list[list[dict]], responses: list,
                 run_example) -> dict | None:
    """The row's quality measure, inferlet vs API; `responses` are the API's, in request order;
    `run_example(argv)` runs the technique's inferlet once more (the watermark detector)."""
    texts = [c.message.content if hasattr(c, "message") else c.text
             for r in responses for c in r.choices]
    if name == "json_extractor":
        answer = result if isinstance(result, str) else json.dumps(result)
        return {"inferlet": json_quality(answer), "api": json_quality(texts[0])}
    if name == "speculative":
        return {"passes": result["num_verify_passes"], "api_passes": len(result["token_ids"]),
                "drafted": result["num_drafted"], "accepted": result["num_accepted"],
                "same_text": texts[0] == result["text"]}
    if name == "output_validation":
        probabilities = api_probabilities(stages[0], responses)
        inferlet = {c["text"]: round(c["probability"], 4) for c in result["candidates"]}
        api = {text: round(p, 4) for text, p in zip(OV_CANDIDATES, probabilities)}
        return {"best": result["best"], "api_best": max(api, key=api.get),
                "probabilities": inferlet, "api_probabilities": api}
    if name == "watermarking":
        detected = run_example(["--detect", texts[0]])
        return {"z_score": round(result["z_score"], 2), "api_z_score": round(detected["z_score"], 2)}
    if name == "hierarchical_attention":
        return {"answer": result["answer"], "api_answer": texts[0].strip()}
    return None
