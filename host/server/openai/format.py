"""OpenAI response shapes, from the built-in inferlet's result.

A result choice is {"index", "text", "finish_reason", "logprobs": [token entries] | None,
"tool_calls": [{"id", "name", "arguments"}] | None}; a token entry is {"token", "logprob",
"bytes", "top": [[token, logprob, bytes], ...]}.
"""
from __future__ import annotations

from typing import Any

__all__ = ["completion_response", "stream_chunk", "usage_object", "chat_logprobs",
           "completion_logprobs", "tool_calls_delta"]


def usage_object(usage: dict[str, int]) -> dict[str, int]:
    prompt, completion = usage["prompt_tokens"], usage["completion_tokens"]
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def chat_logprobs(entries: list[dict] | None) -> dict[str, Any] | None:
    """Chat's {"content": [{token, logprob, bytes, top_logprobs}]}."""
    if entries is None:
        return None
    return {"content": [{"token": e["token"], "logprob": e["logprob"], "bytes": e["bytes"],
                         "top_logprobs": [{"token": t, "logprob": lp, "bytes": b}
                                          for t, lp, b in e["top"]]} for e in entries],
            "refusal": None}


def completion_logprobs(entries: list[dict] | None, offset: int = 0) -> dict[str, Any] | None:
    """Completions' {"tokens", "token_logprobs", "top_logprobs", "text_offset"}."""
    if entries is None:
        return None
    offsets = []
    for entry in entries:
        offsets.append(offset)
        offset += len(entry["token"])
    return {"tokens": [e["token"] for e in entries],
            "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{t: lp for t, lp, _ in e["top"]} for e in entries],
            "text_offset": offsets}


def _tool_calls(calls: list[dict]) -> list[dict[str, Any]]:
    return [{"id": c["id"], "type": "function",
             "function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls]


def tool_calls_delta(calls: list[dict]) -> list[dict[str, Any]]:
    """Streamed tool calls (each whole, in one chunk)."""
    return [{"index": i, **call} for i, call in enumerate(_tool_calls(calls))]


def _chat_choice(choice: dict) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": choice["text"], "refusal": None}
    if choice.get("tool_calls"):
        message["content"] = None
        message["tool_calls"] = _tool_calls(choice["tool_calls"])
    return {"index": choice["index"], "finish_reason": choice["finish_reason"],
            "logprobs": chat_logprobs(choice.get("logprobs")), "message": message}


def completion_response(mode: str, response_id: str, model: str, created: int,
                        result: dict[str, Any]) -> dict[str, Any]:
    """The non-streamed answer, from the built-in inferlet's result."""
    if mode == "chat":
        choices = [_chat_choice(c) for c in result["choices"]]
        kind = "chat.completion"
    else:
        choices = [{"index": c["index"], "text": c["text"], "finish_reason": c["finish_reason"],
                    "logprobs": completion_logprobs(c.get("logprobs"), c.get("offset", 0))}
                   for c in result["choices"]]
        kind = "text_completion"
    return {"id": response_id, "object": kind, "created": created, "model": model,
            "choices": choices, "usage": usage_object(result["usage"])}


def stream_chunk(mode: str, response_id: str, model: str, created: int, index: int | None,
                 text: str | None = None, finish_reason: str | None = None, *,
                 first: bool = False, usage: dict[str, int] | None = None,
                 choice: dict | None = None) -> dict[str, Any]:
    """One SSE chunk: a text delta or the finish of choice `index` (`choice`: its result, for
    the log-probabilities and tool calls sent with the finish), or (index None) the usage."""
    choices: list[dict[str, Any]] = []
    entries = choice.get("logprobs") if choice else None
    if index is not None and mode == "chat":
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if text is not None:
            delta["content"] = text
        if choice and choice.get("tool_calls"):
            delta["tool_calls"] = tool_calls_delta(choice["tool_calls"])
        choices = [{"index": index, "delta": delta, "finish_reason": finish_reason,
                    "logprobs": chat_logprobs(entries)}]
    elif index is not None:
        choices = [{"index": index, "text": text or "", "finish_reason": finish_reason,
                    "logprobs": completion_logprobs(entries, choice.get("offset", 0))
                    if choice else None}]
    chunk = {"id": response_id, "object": "chat.completion.chunk" if mode == "chat"
             else "text_completion", "created": created, "model": model, "choices": choices}
    if usage is not None:
        chunk["usage"] = usage_object(usage)
    return chunk
