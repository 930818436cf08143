"""OpenAI request validation and response shapes, for /v1/completions and /v1/chat/completions.

`parse_request` turns a JSON body into the normalised request the built-in inferlet reads (see
inferlets/builtin/openai_completions.py), or raises `RequestError` naming the field. Fields not
listed here (user, logprobs=false, ...) are accepted and ignored, as OpenAI clients send many.
"""
from __future__ import annotations

from typing import Any

__all__ = ["RequestError", "parse_request", "completion_response", "stream_chunk",
           "usage_object", "MAX_N", "MAX_STOP"]

MAX_N = 8
MAX_STOP = 4
_ROLES = ("system", "user", "assistant")


class RequestError(ValueError):
    """A request the API refuses (HTTP 400); the message names the field."""


def _number(body: dict, name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise RequestError(f"'{name}' must be a number in [{low}, {high}], got {value!r}")
    return float(value)


def _integer(body: dict, name: str, default: int | None, low: int, high: int) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise RequestError(f"'{name}' must be an integer in [{low}, {high}], got {value!r}")
    return value


def _content(message: Any, index: int) -> tuple[str, str]:
    if not isinstance(message, dict):
        raise RequestError(f"'messages[{index}]' must be an object, got {type(message).__name__}")
    role, content = message.get("role"), message.get("content")
    if role == "developer":
        role = "system"
    if role not in _ROLES:
        raise RequestError(f"'messages[{index}].role' must be one of {_ROLES}, got {role!r}")
    if isinstance(content, list):   # content parts: only text is supported
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" \
                    or not isinstance(part.get("text"), str):
                raise RequestError(f"'messages[{index}].content': only text parts are supported")
            texts.append(part["text"])
        content = "".join(texts)
    if not isinstance(content, str):
        raise RequestError(f"'messages[{index}].content' must be a string, got {content!r}")
    return role, content


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or len(stops) > MAX_STOP or \
            not all(isinstance(s, str) and s for s in stops):
        raise RequestError(f"'stop' must be a non-empty string or a list of at most {MAX_STOP}, "
                           f"got {stop!r}")
    return stops


def parse_request(body: Any, mode: str, max_context: int) -> dict[str, Any]:
    """Validate an OpenAI request body ("chat" or "completion" mode); the normalised request."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    request: dict[str, Any] = {"mode": mode}
    if mode == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError("'messages' must be a non-empty list")
        request["messages"] = [_content(m, i) for i, m in enumerate(messages)]
        default_max = 256
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            raise RequestError("'prompt' must be a non-empty string")
        request["prompt"] = prompt
        default_max = 16
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    request["max_tokens"] = _integer({"max_tokens": max_tokens}, "max_tokens", default_max,
                                     1, max_context)
    request["temperature"] = _number(body, "temperature", 1.0, 0.0, 2.0)
    request["top_p"] = _number(body, "top_p", 1.0, 1e-6, 1.0)
    request["seed"] = _integer(body, "seed", None, 0, 2**63 - 1)
    request["n"] = _integer(body, "n", 1, 1, MAX_N)
    request["stop"] = _stop(body)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError(f"'stream' must be true or false, got {stream!r}")
    request["stream"] = stream
    options = body.get("stream_options") or {}
    request["include_usage"] = bool(isinstance(options, dict) and options.get("include_usage"))
    return request


def usage_object(usage: dict[str, int]) -> dict[str, int]:
    prompt, completion = usage["prompt_tokens"], usage["completion_tokens"]
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def completion_response(mode: str, response_id: str, model: str, created: int,
                        result: dict[str, Any]) -> dict[str, Any]:
    """The non-streamed answer, from the built-in inferlet's result."""
    if mode == "chat":
        choices = [{"index": c["index"], "finish_reason": c["finish_reason"], "logprobs": None,
                    "message": {"role": "assistant", "content": c["text"]}}
                   for c in result["choices"]]
        kind = "chat.completion"
    else:
        choices = [{"index": c["index"], "text": c["text"], "finish_reason": c["finish_reason"],
                    "logprobs": None} for c in result["choices"]]
        kind = "text_completion"
    return {"id": response_id, "object": kind, "created": created, "model": model,
            "choices": choices, "usage": usage_object(result["usage"])}


def stream_chunk(mode: str, response_id: str, model: str, created: int, index: int | None,
                 text: str | None = None, finish_reason: str | None = None, *,
                 first: bool = False, usage: dict[str, int] | None = None) -> dict[str, Any]:
    """One SSE chunk: a text delta or a finish of choice `index`, or (index None) the usage."""
    choices: list[dict[str, Any]] = []
    if index is not None and mode == "chat":
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if text is not None:
            delta["content"] = text
        choices = [{"index": index, "delta": delta, "finish_reason": finish_reason,
                    "logprobs": None}]
    elif index is not None:
        choices = [{"index": index, "text": text or "", "finish_reason": finish_reason,
                    "logprobs": None}]
    chunk = {"id": response_id, "object": "chat.completion.chunk" if mode == "chat"
             else "text_completion", "created": created, "model": model, "choices": choices}
    if usage is not None:
        chunk["usage"] = usage_object(usage)
    return chunk
