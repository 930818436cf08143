"""OpenAI request validation, for /v1/completions and /v1/chat/completions.

`parse_request` turns a JSON body into the normalised request the built-in inferlet reads (see
inferlets/builtin/openai_completions.py), or raises `RequestError` naming the field (`param`)
and the HTTP status (400; 404 for an unknown model or adapter). `model` is the served model's
id (or an alias), or "<id>:<adapter>" for one of the tenant's LoRA adapters (`ApiLimits.adapters`):
the request's "adapter" is then that name, else None. The ranges are OpenAI's. Fields not listed
here (user, ...) are accepted and ignored, as OpenAI clients send many. Tools and message
histories are checked in host/server/openai/tools.py.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from host.server.openai.errors import RequestError
from host.server.openai.tools import parse_messages, parse_tools

__all__ = ["RequestError", "ApiLimits", "parse_request", "MAX_N", "MAX_STOP", "MAX_PROMPTS"]

MAX_N = 8
MAX_STOP = 4
MAX_PROMPTS = 16
MAX_TOP_LOGPROBS = 20            # chat
MAX_COMPLETION_LOGPROBS = 5      # completions
MAX_LOGIT_BIAS = 300


@dataclass(frozen=True)
class ApiLimits:
    """What requests are checked against: the served model's names, context and vocabulary."""

    model_ids: frozenset[str]        # the clean id first in `listed_id`, then aliases
    listed_id: str
    max_context: int
    vocab_size: int
    adapters: frozenset[str] = frozenset()   # the tenant's LoRA adapters ("<id>:<adapter>")


def _number(body: dict, name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise RequestError(f"'{name}' must be a number in [{low}, {high}], got {value!r}", name)
    return float(value)


def _integer(body: dict, name: str, default: int | None, low: int, high: int) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise RequestError(f"'{name}' must be an integer in [{low}, {high}], got {value!r}", name)
    return value


def _boolean(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise RequestError(f"'{name}' must be true or false, got {value!r}", name)
    return value


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or len(stops) > MAX_STOP or \
            not all(isinstance(s, str) and s for s in stops):
        raise RequestError(f"'stop' must be a non-empty string or a list of at most {MAX_STOP}, "
                           f"got {stop!r}", "stop")
    return stops


def _prompts(body: dict) -> list[str]:
    prompt = body.get("prompt")
    prompts = [prompt] if isinstance(prompt, str) else prompt
    if not isinstance(prompts, list) or not 0 < len(prompts) <= MAX_PROMPTS or \
            not all(isinstance(p, str) and p for p in prompts):
        raise RequestError(f"'prompt' must be a non-empty string or a list of 1..{MAX_PROMPTS} "
                           f"non-empty strings", "prompt")
    return prompts


def _logit_bias(body: dict, vocab_size: int) -> list[list]:
    bias = body.get("logit_bias")
    if bias is None:
        return []
    if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS:
        raise RequestError(f"'logit_bias' must be an object of at most {MAX_LOGIT_BIAS} "
                           f"token ids", "logit_bias")
    pairs = []
    for key, value in bias.items():
        if not key.isdigit() or int(key) >= vocab_size:
            raise RequestError(f"'logit_bias' key {key!r} is not a token id in [0, {vocab_size})",
                               "logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                not -100 <= value <= 100:
            raise RequestError(f"'logit_bias' value for {key} must be in [-100, 100], got "
                               f"{value!r}", "logit_bias")
        pairs.append([int(key), float(value)])
    return pairs


def _logprobs(body: dict, mode: str) -> int | None:
    """The number of top log-probabilities per token, or None when not asked for."""
    if mode == "completion":
        return _integer(body, "logprobs", None, 0, MAX_COMPLETION_LOGPROBS)
    wanted = _boolean(body, "logprobs")
    top = _integer(body, "top_logprobs", None, 0, MAX_TOP_LOGPROBS)
    if top is not None and not wanted:
        raise RequestError("'top_logprobs' needs 'logprobs' set to true", "top_logprobs")
    return (top or 0) if wanted else None


def _response_format(body: dict) -> dict[str, Any] | None:
    """None (text) or {"schema": <JSON schema>} for json_object / json_schema."""
    fmt = body.get("response_format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"schema": {"type": "object"}}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise RequestError("'response_format.json_schema.schema' must be a JSON schema "
                               "object", "response_format.json_schema.schema")
        return {"schema": schema}
    raise RequestError("'response_format.type' must be text, json_object or json_schema, got "
                       f"{kind!r}", "response_format.type")


def _check_model(body: dict, limits: ApiLimits) -> str | None:
    """The adapter `model` names ("<id>:<adapter>"), None for the base model; RequestError 404
    naming an unknown model or adapter."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise RequestError("'model' must be a non-empty string", "model")
    if model in limits.model_ids:
        return None
    base, colon, adapter = model.rpartition(":")
    if colon and base in limits.model_ids:
        if adapter not in limits.adapters:
            raise RequestError(f"The adapter '{adapter[:100]}' of model '{base}' does not exist: "
                               f"upload it first (upload_adapter)", "model", 404,
                               "model_not_found")
        return adapter
    raise RequestError(f"The model '{model}' does not exist; this server serves "
                       f"'{limits.listed_id}'", "model", 404, "model_not_found")


def _max_tokens(body: dict, default: int, limits: ApiLimits) -> int:
    value = body.get("max_completion_tokens", body.get("max_tokens"))
    name = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    if isinstance(value, int) and not isinstance(value, bool) and value > limits.max_context:
        raise RequestError(f"'{name}' is {value}, but the context length is "
                           f"{limits.max_context} tokens", name, code="context_length_exceeded")
    return _integer({name: value}, name, default, 1, limits.max_context)


def _check_unicode(body: dict) -> None:
    """RequestError naming the first string (value or key) that is not valid Unicode: JSON's
    escapes admit lone surrogates ("\\ud800"), which no tokenizer accepts."""
    stack: list[tuple[str, Any]] = [("", body)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise RequestError(f"'{path}' is not valid Unicode text: it holds a lone "
                                   f"surrogate", path) from None
        elif isinstance(value, dict):
            for key, item in reversed(list(value.items())):
                name = str(key).encode("utf-8", "backslashreplace").decode("utf-8")
                child = f"{path}.{name}" if path else name
                stack.append((child, item))
                stack.append((child, key))
        elif isinstance(value, list):
            stack.extend((f"{path}[{index}]", item)
                         for index, item in reversed(list(enumerate(value))))


def parse_request(body: Any, mode: str, limits: ApiLimits) -> dict[str, Any]:
    """Validate an OpenAI request body ("chat" or "completion" mode); the normalised request."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    _check_unicode(body)
    adapter = _check_model(body, limits)
    request: dict[str, Any] = {"mode": mode, "adapter": adapter}
    if mode == "chat":
        request["messages"] = parse_messages(body.get("messages"))
        request.update(parse_tools(body))
        default_max = 256
    else:
        request["prompts"] = _prompts(body)
        request["echo"] = _boolean(body, "echo")
        default_max = 16
    request["max_tokens"] = _max_tokens(body, default_max, limits)
    request["temperature"] = _number(body, "temperature", 1.0, 0.0, 2.0)
    request["top_p"] = _number(body, "top_p", 1.0, 1e-6, 1.0)
    request["presence_penalty"] = _number(body, "presence_penalty", 0.0, -2.0, 2.0)
    request["frequency_penalty"] = _number(body, "frequency_penalty", 0.0, -2.0, 2.0)
    request["logit_bias"] = _logit_bias(body, limits.vocab_size)
    request["logprobs"] = _logprobs(body, mode)
    request["response_format"] = _response_format(body) if mode == "chat" else None
    request["seed"] = _integer(body, "seed", None, 0, 2**63 - 1)
    request["n"] = _integer(body, "n", 1, 1, MAX_N)
    request["stop"] = _stop(body)
    request["ignore_eos"] = _boolean(body, "ignore_eos")    # vLLM's extension: run to max_tokens
    request["stream"] = _boolean(body, "stream")
    options = body.get("stream_options") or {}
    request["include_usage"] = bool(isinstance(options, dict) and options.get("include_usage"))
    return request


def decode_body(raw: bytes) -> Any:
    """The JSON body, or RequestError for text that is not JSON."""
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise RequestError(f"the request body is not valid JSON: {exc}") from None
