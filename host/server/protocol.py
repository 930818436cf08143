"""The websocket protocol: typed messages structured with cattrs, as JSON or msgpack.

A text frame carries one JSON object, a binary frame one msgpack map; the server answers in the
encoding of the frame it answers. Every message has a `type`; a client message may carry an `id`
(int) that the server copies into its reply or error. See docs/server.md for the whole exchange.

Client -> server: auth, upload_begin, upload_chunk, upload_end, launch, send, terminate,
list_programs, list_instances, logs, model_info, upload_adapter (then upload_chunk / upload_end
carry its weights), list_adapters, delete_adapter.
Server -> client: a reply (`ok` with fields per request), `error` (names the problem), and
`event` (instance_id, kind in message/result/error/trap/terminated, data).
"""
from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass
from typing import Any, Union

import cattrs
import msgpack
from cattrs.v import format_exception, transform_error

__all__ = ["ProtocolError", "JsonNestingError", "loads_bounded", "is_unicode", "MAX_NESTING",
           "Auth", "UploadBegin", "UploadChunk", "UploadEnd", "Launch", "Send",
           "Terminate", "ListPrograms", "ListInstances", "Logs", "GetModelInfo", "UploadAdapter",
           "ListAdapters", "DeleteAdapter", "ClientMessage",
           "CLIENT_MESSAGES", "decode_message", "encode_message", "error_message",
           "event_message", "reply_message", "EVENT_KINDS"]

EVENT_KINDS = ("message", "result", "error", "trap", "terminated")
MAX_NESTING = 8      # deepest nesting of a client frame (the deepest valid message has 2)
MAX_AFFINITY_CHARS = 256   # a launch's affinity (host/cluster/front.py bounds it alike)


class JsonNestingError(ValueError):
    """A JSON / msgpack document nested deeper than allowed; the message names the limit."""


def _check_nesting(value: Any, limit: int) -> None:
    """Raise JsonNestingError when containers in `value` nest deeper than `limit` (iterative:
    a hostile document cannot exhaust the stack here)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item \
            if isinstance(item, list) else None
        if children is None:
            continue
        if depth > limit:
            raise JsonNestingError(f"nested deeper than {limit} levels")
        stack.extend((child, depth + 1) for child in children)


def loads_bounded(text: str | bytes, max_nesting: int) -> Any:
    """json.loads, refusing documents nested deeper than `max_nesting` (JsonNestingError) --
    also those too deep for the parser itself -- and malformed ones (ValueError)."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise JsonNestingError(f"malformed JSON: nested deeper than {max_nesting} levels") from None
    except ValueError as exc:
        raise ValueError(f"malformed JSON: {exc}") from None
    try:
        _check_nesting(value, max_nesting)
    except JsonNestingError as exc:
        raise JsonNestingError(f"malformed JSON: {exc}") from None
    return value


class ProtocolError(ValueError):
    """A client frame that cannot be understood; `request_id` is its `id` when one was readable."""

    def __init__(self, message: str, request_id: int | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id


@dataclass(frozen=True)
class Auth:
    token: str
    id: int | None = None


@dataclass(frozen=True)
class UploadBegin:
    """Start uploading a program of `size` bytes whose sha256 (hex) is `sha256`."""

    sha256: str
    size: int
    id: int | None = None


@dataclass(frozen=True)
class UploadChunk:
    """The next bytes of an upload (bytes in msgpack, base64 text in JSON)."""

    upload_id: str
    data: bytes
    id: int | None = None


@dataclass(frozen=True)
class UploadEnd:
    upload_id: str
    id: int | None = None


@dataclass(frozen=True)
class Launch:
    program: str                       # sha256 hex of an uploaded program
    args: tuple[str, ...] = ()
    kv_pages: int | None = None        # page reservation (default: tenant quota / max instances)
    id: int | None = None
    affinity: str | None = None        # --ray: an export it will import, or a session key

    def __post_init__(self) -> None:
        if self.affinity is not None and not 0 < len(self.affinity) <= MAX_AFFINITY_CHARS:
            raise TypeError(f"affinity must be 1..{MAX_AFFINITY_CHARS} characters, "
                            f"got {len(self.affinity)}")


@dataclass(frozen=True)
class Send:
    instance_id: str
    message: str
    id: int | None = None


@dataclass(frozen=True)
class Terminate:
    instance_id: str
    id: int | None = None


@dataclass(frozen=True)
class ListPrograms:
    id: int | None = None


@dataclass(frozen=True)
class ListInstances:
    id: int | None = None


@dataclass(frozen=True)
class Logs:
    """The log of one of the tenant's instances, running or ended (the newest lines kept)."""

    instance_id: str
    id: int | None = None


@dataclass(frozen=True)
class GetModelInfo:
    id: int | None = None


@dataclass(frozen=True)
class UploadAdapter:
    """Start uploading the tenant's LoRA adapter `name`: `config` the adapter_config.json text,
    then `size` bytes of adapter_model.safetensors whose sha256 (hex) is `sha256`, sent as an
    upload's chunks (upload_chunk, upload_end)."""

    name: str
    config: str
    sha256: str
    size: int
    id: int | None = None


@dataclass(frozen=True)
class ListAdapters:
    id: int | None = None


@dataclass(frozen=True)
class DeleteAdapter:
    name: str
    id: int | None = None


ClientMessage = Union[Auth, UploadBegin, UploadChunk, UploadEnd, Launch, Send, Terminate,
                      ListPrograms, ListInstances, Logs, GetModelInfo, UploadAdapter,
                      ListAdapters, DeleteAdapter]

CLIENT_MESSAGES: dict[str, type] = {
    "auth": Auth, "upload_begin": UploadBegin, "upload_chunk": UploadChunk,
    "upload_end": UploadEnd, "launch": Launch, "send": Send, "terminate": Terminate,
    "list_programs": ListPrograms, "list_instances": ListInstances, "logs": Logs,
    "model_info": GetModelInfo, "upload_adapter": UploadAdapter,
    "list_adapters": ListAdapters, "delete_adapter": DeleteAdapter,
}


def _converter() -> cattrs.Converter:
    """Strict: no coercion of "3" to int, of 1 to bool; base64 text or raw bytes for `bytes`."""
    converter = cattrs.Converter(forbid_extra_keys=True)

    def exact(kind: type):
        def hook(value: Any, _: type) -> Any:
            if isinstance(value, bool) or not isinstance(value, kind):
                raise TypeError(f"expected {kind.__name__}, got {type(value).__name__}")
            return value
        return hook

    def to_bytes(value: Any, _: type) -> bytes:
        if isinstance(value, (bytes, bytearray)):
            return bytes(value)
        if isinstance(value, str):
            try:
                return base64.b64decode(value, validate=True)
            except (binascii.Error, ValueError):
                raise TypeError("expected base64 text") from None
        raise TypeError(f"expected bytes or base64 text, got {type(value).__name__}")

    def text(value: Any, _: type) -> str:
        exact(str)(value, str)
        if not is_unicode(value):
            raise TypeError("expected valid Unicode text, got a string with a lone surrogate")
        return value

    def texts(value: Any, _: type) -> tuple[str, ...]:
        """A list of strings, never a string or an object iterated into its characters / keys."""
        if not isinstance(value, (list, tuple)):
            raise TypeError(f"expected a list of strings, got {type(value).__name__}")
        for index, item in enumerate(value):
            try:
                text(item, str)
            except TypeError as exc:
                raise TypeError(f"item {index}: {exc}") from None
        return tuple(value)

    converter.register_structure_hook(int, exact(int))
    converter.register_structure_hook(str, text)
    converter.register_structure_hook_func(lambda type_: type_ == tuple[str, ...], texts)
    converter.register_structure_hook(bytes, to_bytes)
    return converter


def is_unicode(text: str) -> bool:
    """Whether `text` is valid Unicode: JSON's escapes (and Python's str) admit lone surrogates
    such as "\\ud800", which no UTF-8 text, tokenizer or token comparison accepts."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


_MSGPACK_REASONS = {"FormatError": "a byte that starts no msgpack value",
                    "StackError": "nested too deeply", "ExtraData": "extra bytes after the message",
                    "OutOfData": "the frame ends inside a value"}


def _msgpack_reason(exc: BaseException) -> str:
    """What is wrong with a msgpack frame: msgpack's own message, or (where it gives none) what
    its exception class means."""
    name = type(exc).__name__
    reason = str(exc) or _MSGPACK_REASONS.get(name, "")
    return f"{reason} ({name})" if reason else name


def _format(exc: BaseException, type_: Any) -> str:
    if isinstance(exc, TypeError):
        return str(exc)
    return format_exception(exc, type_)


def _parse_frame(frame: str | bytes) -> Any:
    if isinstance(frame, str):
        try:
            return loads_bounded(frame, MAX_NESTING)
        except ValueError as exc:      # JsonNestingError too
            raise ProtocolError(str(exc)) from None
    try:
        value = msgpack.unpackb(frame, raw=False, strict_map_key=True)
        _check_nesting(value, MAX_NESTING)
        return value
    except JsonNestingError as exc:
        raise ProtocolError(f"malformed msgpack: {exc}") from None
    except (ValueError, msgpack.UnpackException, TypeError, RecursionError) as exc:
        raise ProtocolError(f"malformed msgpack: {_msgpack_reason(exc)}") from None


def decode_message(frame: str | bytes, converter: cattrs.Converter | None = None) -> ClientMessage:
    """One client frame -> a typed message, or ProtocolError naming what is wrong."""
    data = _parse_frame(frame)
    if not isinstance(data, dict):
        raise ProtocolError(f"a message must be an object, got {type(data).__name__}")
    raw_id = data.get("id")
    request_id = raw_id if isinstance(raw_id, int) and not isinstance(raw_id, bool) else None
    kind = data.get("type")
    if not isinstance(kind, str):
        raise ProtocolError("message has no 'type' field (a string)", request_id)
    message_type = CLIENT_MESSAGES.get(kind)
    if message_type is None:
        raise ProtocolError(f"unknown message type {kind!r}; expected one of "
                            f"{sorted(CLIENT_MESSAGES)}", request_id)
    fields = {k: v for k, v in data.items() if k != "type"}
    try:
        return (converter or _converter()).structure(fields, message_type)
    except cattrs.BaseValidationError as exc:
        problems = transform_error(exc, path=kind, format_exception=_format)
        raise ProtocolError("; ".join(problems), request_id) from None


def encode_message(message: dict[str, Any], binary: bool) -> str | bytes:
    """A server message (a plain dict with `type`) -> a msgpack (binary) or JSON (text) frame."""
    if binary:
        return msgpack.packb(message, use_bin_type=True)
    return json.dumps(message, separators=(",", ":"))


def reply_message(request_id: int | None, **fields: Any) -> dict[str, Any]:
    """A successful answer to the request `request_id`."""
    return {"type": "ok", "id": request_id, **fields}


def error_message(message: str, request_id: int | None = None) -> dict[str, Any]:
    """An error answer (or an unsolicited error when request_id is None)."""
    return {"type": "error", "id": request_id, "message": message}


def event_message(instance_id: str, kind: str, data: str) -> dict[str, Any]:
    """An instance event: a message it sent, or how it ended (result/error/trap/terminated)."""
    return {"type": "event", "instance_id": instance_id, "kind": kind, "data": data}
