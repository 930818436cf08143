"""The built-in inferlet behind the server's OpenAI-compatible API (/v1/completions, /v1/chat/...).

The server launches one instance per HTTP request with one argument: the request as JSON, already
validated and normalised by host/server/openai/schema.py:

    {"mode": "chat" | "completion", "messages": [{"role", "content", "tool_calls"?,
     "tool_call_id"?}] | "prompts": [str], "echo": bool, "max_tokens", "temperature", "top_p",
     "presence_penalty", "frequency_penalty", "logit_bias": [[id, bias]], "logprobs": int | null,
     "response_format": {"schema"} | null, "tools": [{"name", "description", "parameters"}],
     "tool_choice": "none" | "auto" | "required" | {"name"}, "seed", "stop", "n", "stream",
     "adapter": str | null, "prefix_cache_pages"}

While generating with "stream" it sends one message per text delta: {"index": i, "delta": text}.
Its result is {"choices": [{"index", "text", "finish_reason", "logprobs", "tool_calls", "offset"}],
"usage": {"prompt_tokens", "completion_tokens"}}. Each prompt's KV is computed once and forked
into its n choices, which generate in parallel, each on its own queue. A chat's leading part (the
template's text up to the first non-system message's content: the system prompt, or the one the
template adds) is shared between the tenant's requests, to the token: kept as a persistent
export named by its tokens' hash (inferlet.prefix_context), at most MAX_PREFIX_EXPORTS of them,
each of at most prefix_cache_pages / MAX_PREFIX_EXPORTS pages (the tenant's setting; 0: off).
A request naming one of the tenant's LoRA adapters ("adapter") runs every pass with it and shares
no prefix (an export's KV was computed without the adapter, or with another one).
Every request decodes on host loops (the SDK's default; a streamed one reads them one token
at a time and sends each delta, so its guest wakes once per token but no pass waits for it).
Measured against stepping token by token (bench/load.py vs vLLM, 32 streaming clients, 2 vCPUs):
~12% more tokens/s (batches of 31.7 rows on average against 19), TTFT p50 ~2.5x (1.2-1.3 s
against 0.5; vLLM's 1.3-1.7): the bench's clients send equal requests in a closed loop, so
loops keep them in step and the next prompts arrive together and share one long batch.

Tools are described in a system message and rendered with the chat template; earlier calls and
results become <tool_call> / <tool_response> turns. A forced call (tool_choice a function, or
"required") is generated under a JSON schema of {"name", "arguments"}, so it always parses and
matches the function's parameters; with "auto" a <tool_call> block in the answer is parsed back.
"""
import json

import inferlet
from inferlet import (Context, Sampler, decode, encode, generate_parallel, model_info,
                      prefix_context, render_chat, send_json)

MAX_PREFIX_EXPORTS = 4     # chat prefixes a tenant keeps computed (inferlet.prefix_context)
_FINISH_REASONS = {"length": "length", "stop_token": "stop", "stop_string": "stop"}
TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"


def _sampler(request: dict, index: int) -> Sampler:
    options = {"logprobs": request["logprobs"],
               "logit_bias": tuple((t, b) for t, b in request["logit_bias"]),
               "presence_penalty": request["presence_penalty"],
               "frequency_penalty": request["frequency_penalty"]}
    if request["temperature"] == 0:
        return Sampler(**options)
    seed = request["seed"]
    return Sampler("sample", temperature=request["temperature"], top_p=request["top_p"],
                   seed=None if seed is None else (seed + index) % 2**64, **options)


def _tools_prompt(tools: list) -> str:
    described = "\n".join(json.dumps(t) for t in tools)
    return ("You can call functions. To call one, answer with only\n"
            f'{TOOL_OPEN}{{"name": <function name>, "arguments": <JSON object>}}{TOOL_CLOSE}\n'
            f"The functions:\n{described}")


def _rendered_message(message: dict) -> tuple:
    content = message["content"]
    for call in message.get("tool_calls", ()):
        try:
            arguments = json.loads(call["arguments"])
        except ValueError:
            arguments = call["arguments"]
        content += TOOL_OPEN + json.dumps({"name": call["name"], "arguments": arguments}) + TOOL_CLOSE
    if message["role"] == "tool":
        content = f"<tool_response>{content}</tool_response>"
    return message["role"], content


def _chat_text(request: dict) -> str:
    messages = [_rendered_message(m) for m in request["messages"]]
    if request["tools"] and request["tool_choice"] != "none":
        tools_text = _tools_prompt(request["tools"])
        if messages[0][0] == "system":
            messages[0] = ("system", messages[0][1] + "\n\n" + tools_text)
        else:
            messages.insert(0, ("system", tools_text))
    return render_chat(messages, True)


def _call_schema(request: dict):
    """The JSON schema a forced call must match, or None when calls are not forced."""
    def call_of(tool: dict) -> dict:
        return {"type": "object", "properties": {"name": {"const": tool["name"]},
                                                 "arguments": tool["parameters"]},
                "required": ["name", "arguments"], "additionalProperties": False}
    choice = request.get("tool_choice", "none")
    if isinstance(choice, dict):
        return call_of(next(t for t in request["tools"] if t["name"] == choice["name"]))
    if choice == "required":
        return {"anyOf": [call_of(t) for t in request["tools"]]}
    return None


def _tool_calls(text: str, request: dict, forced: bool, choice_index: int):
    """The calls in an answer ([{"id", "name", "arguments"}]), or None when it has none."""
    names = {t["name"] for t in request.get("tools", ())}
    blocks = [text] if forced else [part.split(TOOL_CLOSE)[0] for part in text.split(TOOL_OPEN)[1:]]
    calls = []
    for block in blocks:
        try:
            call = json.loads(block)
        except ValueError:
            continue
        if isinstance(call, dict) and call.get("name") in names:
            calls.append({"id": f"call_{inferlet.instance_id()[:12]}_{choice_index}_{len(calls)}",
                          "name": call["name"], "arguments": json.dumps(call.get("arguments", {}))})
    return calls or None


def _spelled(token_id: int) -> tuple:
    text = decode([token_id])
    return text, list(text.encode("utf-8"))


def _token_entry(token_logprob) -> dict:
    """A token's log-probability entry: its text, bytes and the top alternatives."""
    token, raw = _spelled(token_logprob.token_id)
    top = [[*_spelled(token_id), logprob] for token_id, logprob in token_logprob.top]
    return {"token": token, "logprob": token_logprob.logprob, "bytes": raw,
            "top": [[text, logprob, raw_top] for text, raw_top, logprob in top]}


def _prompts(request: dict) -> list:
    if request["mode"] == "chat":
        return [_chat_text(request)]
    return request["prompts"]


def _num_shared(request: dict, prompt_ids: list) -> int:
    """Leading tokens of a chat prompt that every request with the same leading system messages
    shares: the template's text up to the first other message's content (found by rendering
    the chat again with that content changed), less one token for the boundary, at most
    prefix_cache_pages / MAX_PREFIX_EXPORTS pages; 0 if none. Not rounded to whole pages: an
    importer copies the partial last page's tokens into a page of its own, the exporter's is
    copied on write, and each is cheaper than computing those tokens again."""
    max_pages = request.get("prefix_cache_pages", 0) // MAX_PREFIX_EXPORTS
    if request["mode"] != "chat" or max_pages == 0:
        return 0
    messages = request["messages"]
    first = next((i for i, m in enumerate(messages) if m["role"] != "system"), None)
    if first is None:
        return 0
    content = "\x02" if messages[first]["content"].startswith("\x01") else "\x01"
    probe = dict(request, messages=[*messages[:first], dict(messages[first], content=content),
                                    *messages[first + 1:]])
    probe_ids = encode(_chat_text(probe))
    common = next((i for i, (a, b) in enumerate(zip(prompt_ids, probe_ids)) if a != b),
                  min(len(prompt_ids), len(probe_ids)))
    page_size = model_info().page_size
    return max(0, min(common - 1, len(prompt_ids) - 1, max_pages * page_size))


def _contexts(prompt_ids: list, num_choices: int, num_shared: int, adapter) -> list:
    """One context per choice; forks share the prompt's KV, computed once (its first
    `num_shared` tokens' once per tenant while their export lasts; with an `adapter` nothing
    is shared: every pass of the context and its forks runs with it)."""
    if adapter is None:
        ctx = prefix_context(prompt_ids, num_shared, MAX_PREFIX_EXPORTS)
    else:
        ctx = Context(adapter=adapter)
        ctx.fill(prompt_ids)
    if num_choices == 1:
        return [ctx]
    forks = [ctx.fork() for _ in range(num_choices)]
    ctx.close()
    return forks


def _choice(request: dict, index: int, gen, prompt: str, call_schema) -> dict:
    text = gen.text
    calls = _tool_calls(text, request, call_schema is not None, index) \
        if request.get("tool_choice", "none") != "none" else None
    echo = request.get("echo", False)
    return {"index": index, "text": "" if calls else (prompt + text if echo else text),
            "finish_reason": "tool_calls" if calls else _FINISH_REASONS[gen.finish_reason],
            "logprobs": None if request["logprobs"] is None
            else [_token_entry(t) for t in gen.logprobs],
            "tool_calls": calls, "offset": len(prompt) if echo else 0}


@inferlet.main
def main(args: list) -> str:
    request = json.loads(args[0])
    num_choices = request["n"]
    prompts = _prompts(request)
    prompt_ids = [encode(p) for p in prompts]
    adapter = request.get("adapter")
    num_shared = 0 if adapter else _num_shared(request, prompt_ids[0])
    contexts = [c for ids in prompt_ids for c in _contexts(ids, num_choices, num_shared, adapter)]
    call_schema = _call_schema(request)
    fmt = request.get("response_format")
    schema = call_schema or (fmt["schema"] if fmt else None)
    on_text = None
    if request["stream"] and call_schema is None:
        if request.get("echo"):
            for index in range(len(contexts)):
                send_json({"index": index, "delta": prompts[index // num_choices]})

        def on_text(index: int, delta: str) -> None:
            send_json({"index": index, "delta": delta})
    samplers = [_sampler(request, i) for i in range(len(contexts))]
    ignore_eos = {"stop_token_ids": ()} if request.get("ignore_eos") else {}
    generations = generate_parallel(contexts, request["max_tokens"], samplers,
                                    stop=tuple(request["stop"]), on_text=on_text, schema=schema,
                                    **ignore_eos)
    choices = [_choice(request, i, gen, prompts[i // num_choices], call_schema)
               for i, gen in enumerate(generations)]
    usage = {"prompt_tokens": sum(len(ids) for ids in prompt_ids),
             "completion_tokens": sum(len(gen.token_ids) for gen in generations)}
    for context in contexts:
        context.close()
    return json.dumps({"choices": choices, "usage": usage})
