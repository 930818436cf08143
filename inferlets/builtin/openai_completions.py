"""The built-in inferlet behind the server's OpenAI-compatible API (/v1/completions, /v1/chat/...).

The server launches one instance per HTTP request with one argument: the request as JSON, already
validated and normalised by host/server/openai.py:

    {"mode": "chat" | "completion", "messages": [[role, content], ...] | "prompt": str,
     "max_tokens": int, "temperature": float, "top_p": float, "seed": int | null,
     "stop": [str, ...], "n": int, "stream": bool}

While generating with "stream" it sends one message per text delta: {"index": i, "delta": text}.
Its result is {"choices": [{"index", "text", "finish_reason"}], "usage": {"prompt_tokens",
"completion_tokens"}}. n > 1 forks the prompt's KV (computed once) into n contexts that generate
in parallel, each on its own queue, so their passes share batches.
"""
import json

import inferlet
from inferlet import Context, Sampler, encode, generate_parallel, render_chat, send_json

_FINISH_REASONS = {"length": "length", "stop_token": "stop", "stop_string": "stop"}


def _sampler(request: dict, index: int) -> Sampler:
    if request["temperature"] == 0:
        return Sampler()
    seed = request["seed"]
    return Sampler("sample", temperature=request["temperature"], top_p=request["top_p"],
                   seed=None if seed is None else (seed + index) % 2**64)


def _prompt_token_ids(request: dict) -> list[int]:
    if request["mode"] == "chat":
        return encode(render_chat([tuple(m) for m in request["messages"]], True))
    return encode(request["prompt"])


def _contexts(prompt_ids: list[int], num_choices: int) -> list[Context]:
    """One context per choice. Forks share the prompt's KV, computed once; each fork keeps the
    prompt's last token to recompute (`generate` reopens it), so that its first pass samples
    its first token."""
    ctx = Context()
    ctx.fill(prompt_ids)
    if num_choices == 1:
        return [ctx]
    forks = [ctx.fork() for _ in range(num_choices)]
    ctx.close()
    return forks


@inferlet.main
def main(args: list[str]) -> str:
    request = json.loads(args[0])
    prompt_ids = _prompt_token_ids(request)
    num_choices = request["n"]
    contexts = _contexts(prompt_ids, num_choices)
    on_text = None
    if request["stream"]:
        def on_text(index: int, delta: str) -> None:
            send_json({"index": index, "delta": delta})
    generations = generate_parallel(contexts, request["max_tokens"],
                                    [_sampler(request, i) for i in range(num_choices)],
                                    stop=tuple(request["stop"]), on_text=on_text)
    choices = [{"index": i, "text": gen.text, "finish_reason": _FINISH_REASONS[gen.finish_reason]}
               for i, gen in enumerate(generations)]
    usage = {"prompt_tokens": len(prompt_ids),
             "completion_tokens": sum(len(gen.token_ids) for gen in generations)}
    for context in contexts:
        context.close()
    return json.dumps({"choices": choices, "usage": usage})
