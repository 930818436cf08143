"""Chat messages and tools of an OpenAI request: validation and normalisation.

Messages become {"role", "content"} dicts, plus "tool_calls" [{"id", "name", "arguments"}] on an
assistant turn that called tools and "tool_call_id" on a `tool` turn. Tools become
{"name", "description", "parameters"}; tool_choice becomes "none", "auto", "required" or
{"name": ...} (a forced call). The built-in inferlet renders them through the chat template.
"""
from __future__ import annotations

import json
import re
from typing import Any

from host.server.openai.errors import RequestError

__all__ = ["parse_messages", "parse_tools", "MAX_TOOLS"]

MAX_TOOLS = 64
_ROLES = ("system", "user", "assistant", "tool")
_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")


def _error(message: str, param: str) -> RequestError:
    return RequestError(message, param)


def _text(content: Any, param: str, allow_none: bool) -> str:
    if content is None and allow_none:
        return ""
    if isinstance(content, list):   # content parts: only text is supported
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" \
                    or not isinstance(part.get("text"), str):
                raise _error(f"'{param}': only text parts are supported", param)
            texts.append(part["text"])
        content = "".join(texts)
    if not isinstance(content, str):
        raise _error(f"'{param}' must be a string, got {content!r}", param)
    return content


def _tool_calls(calls: Any, param: str) -> list[dict[str, str]]:
    if not isinstance(calls, list) or not calls:
        raise _error(f"'{param}' must be a non-empty list", param)
    normalised = []
    for index, call in enumerate(calls):
        where = f"{param}[{index}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) \
                or not isinstance(function.get("arguments"), str) \
                or not isinstance(call.get("id"), str):
            raise _error(f"'{where}' must have an id and a function with a name and arguments "
                         f"(a JSON string)", where)
        normalised.append({"id": call["id"], "name": function["name"],
                           "arguments": function["arguments"]})
    return normalised


def _message(message: Any, index: int) -> dict[str, Any]:
    param = f"messages[{index}]"
    if not isinstance(message, dict):
        raise _error(f"'{param}' must be an object, got {type(message).__name__}", param)
    role = "system" if message.get("role") == "developer" else message.get("role")
    if role not in _ROLES:
        raise _error(f"'{param}.role' must be one of {_ROLES}, got {role!r}", f"{param}.role")
    calls = message.get("tool_calls") if role == "assistant" else None
    normalised: dict[str, Any] = {"role": role, "content": _text(
        message.get("content"), f"{param}.content", allow_none=calls is not None)}
    if calls is not None:
        normalised["tool_calls"] = _tool_calls(calls, f"{param}.tool_calls")
    if role == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise _error(f"'{param}.tool_call_id' must be a non-empty string",
                         f"{param}.tool_call_id")
        normalised["tool_call_id"] = call_id
    return normalised


def parse_messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise _error("'messages' must be a non-empty list", "messages")
    return [_message(m, i) for i, m in enumerate(messages)]


def _tool(tool: Any, index: int) -> dict[str, Any]:
    param = f"tools[{index}]"
    function = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
        raise _error(f"'{param}' must be {{'type': 'function', 'function': {{...}}}}", param)
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise _error(f"'{param}.function.name' must match [a-zA-Z0-9_-]{{1,64}}, got {name!r}",
                     f"{param}.function.name")
    parameters = function.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(parameters, dict):
        raise _error(f"'{param}.function.parameters' must be a JSON schema object",
                     f"{param}.function.parameters")
    description = function.get("description", "")
    return {"name": name, "description": description if isinstance(description, str) else "",
            "parameters": parameters}


def parse_tools(body: dict) -> dict[str, Any]:
    """{"tools": [...], "tool_choice": ...} of a chat request (no tools: choice "none")."""
    tools = body.get("tools") or []
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise _error(f"'tools' must be a list of at most {MAX_TOOLS} tools", "tools")
    parsed = [_tool(t, i) for i, t in enumerate(tools)]
    names = [t["name"] for t in parsed]
    if len(set(names)) != len(names):
        raise _error("'tools' names must be unique", "tools")
    choice = body.get("tool_choice", "auto" if parsed else "none")
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" \
            else None
        if name not in names:
            raise _error(f"'tool_choice' names a function not in 'tools': {name!r}",
                         "tool_choice")
        choice = {"name": name}
    elif choice not in ("none", "auto", "required"):
        raise _error(f"'tool_choice' must be none, auto, required or a function, got "
                     f"{json.dumps(choice)}", "tool_choice")
    elif choice == "required" and not parsed:
        raise _error("'tool_choice' is required but 'tools' is empty", "tool_choice")
    return {"tools": parsed, "tool_choice": choice}
