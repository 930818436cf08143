"""The async (trio) client of `pie serve`'s websocket protocol.

    async with connect("ws://127.0.0.1:8080/ws", token) as client:
        program = await client.upload(wasm_bytes)           # sha256 hex; no-op if already there
        await client.upload_adapter("tone", "path/to/peft")   # the tenant's LoRA adapter "tone"
        instance = await client.launch(program, ["--n", "3"])
        async for event in instance.events():               # message ... then one final event
            print(event.kind, event.data)

A reader task dispatches answers to the request that is waiting for them (matched by `id`) and
instance events to a per-instance channel, which exists as soon as the first event arrives, so no
event is lost when an instance speaks before its launch answer is read.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import math
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator

import msgpack
import trio
from trio_websocket import ConnectionClosed, open_websocket_url

__all__ = ["PieError", "Event", "Instance", "PieClient", "connect", "websocket_url",
           "FINAL_KINDS"]

FINAL_KINDS = frozenset({"result", "error", "trap", "terminated"})


class PieError(Exception):
    """The server answered a request with an error (the message is the server's)."""


@dataclass(frozen=True)
class Event:
    """An instance event: kind in message/result/error/trap/terminated."""

    instance_id: str
    kind: str
    data: str

    @property
    def is_final(self) -> bool:
        return self.kind in FINAL_KINDS


def websocket_url(server: str) -> str:
    """"http://h:p", "h:p" or "ws://h:p/ws" -> the websocket URL of the server."""
    if server.startswith(("ws://", "wss://")):
        return server if server.rstrip("/").endswith("/ws") else server.rstrip("/") + "/ws"
    if server.startswith("http://"):
        server = "ws://" + server[len("http://"):]
    elif server.startswith("https://"):
        server = "wss://" + server[len("https://"):]
    else:
        server = "ws://" + server
    return server.rstrip("/") + "/ws"


class Instance:
    """A launched instance as the client sees it."""

    def __init__(self, client: "PieClient", instance_id: str) -> None:
        self.client = client
        self.id = instance_id
        self.final: Event | None = None

    async def next_event(self) -> Event:
        """The next event (after the final one: PieError)."""
        if self.final is not None:
            raise PieError(f"instance {self.id} has ended ({self.final.kind})")
        try:
            event = await self.client._channel(self.id)[1].receive()
        except trio.EndOfChannel:
            raise PieError(f"connection closed before instance {self.id} ended") from None
        if event.is_final:
            self.final = event
        return event

    async def events(self) -> AsyncIterator[Event]:
        """Every event until (and including) the final one."""
        while self.final is None:
            yield await self.next_event()

    async def wait(self) -> Event:
        """Skip messages until the final event; return it."""
        async for event in self.events():
            pass
        assert self.final is not None
        return self.final

    async def send(self, message: str) -> None:
        """Send a client message to the instance (what its `receive()` returns)."""
        await self.client.request("send", instance_id=self.id, message=message)

    async def terminate(self) -> None:
        """Ask the server to end the instance; its final event ("terminated") follows."""
        await self.client.request("terminate", instance_id=self.id)

    async def logs(self) -> list[str]:
        """The instance's log lines (see PieClient.logs)."""
        return await self.client.logs(self.id)


class PieClient:
    """One authenticated websocket connection. Use `connect(...)` to make one."""

    def __init__(self, websocket: Any, binary: bool) -> None:
        self._ws = websocket
        self.binary = binary
        self._ids = itertools.count(1)
        self._waiting: dict[int, trio.MemorySendChannel] = {}
        self._channels: dict[str, tuple[trio.MemorySendChannel, trio.MemoryReceiveChannel]] = {}
        self.notices: list[str] = []      # errors the server sent without a request id
        self.tenant = ""

    def _channel(self, instance_id: str) -> tuple[trio.MemorySendChannel, trio.MemoryReceiveChannel]:
        if instance_id not in self._channels:
            self._channels[instance_id] = trio.open_memory_channel(math.inf)
        return self._channels[instance_id]

    async def send_raw(self, frame: str | bytes) -> None:
        """Send a frame as is (tests use this to send malformed frames)."""
        await self._ws.send_message(frame)

    async def request(self, kind: str, **fields: Any) -> dict[str, Any]:
        """Send one request and wait for its answer; PieError when the server refuses it."""
        request_id = next(self._ids)
        send, receive = trio.open_memory_channel(1)
        self._waiting[request_id] = send
        message = {"type": kind, "id": request_id, **fields}
        await self._ws.send_message(msgpack.packb(message, use_bin_type=True) if self.binary
                                    else json.dumps(message))
        try:
            answer = await receive.receive()
        except trio.EndOfChannel:
            raise PieError("connection closed before the server answered") from None
        finally:
            self._waiting.pop(request_id, None)
        if answer["type"] == "error":
            raise PieError(answer["message"])
        return answer

    async def _read(self) -> None:
        try:
            while True:
                frame = await self._ws.get_message()
                self._dispatch(msgpack.unpackb(frame, raw=False) if isinstance(frame, bytes)
                               else json.loads(frame))
        except ConnectionClosed:
            pass
        finally:
            for send in list(self._waiting.values()):
                send.close()
            for send, _ in self._channels.values():
                send.close()

    def _dispatch(self, message: dict[str, Any]) -> None:
        if message["type"] == "event":
            event = Event(message["instance_id"], message["kind"], message["data"])
            self._channel(event.instance_id)[0].send_nowait(event)
        elif message.get("id") in self._waiting:
            self._waiting[message["id"]].send_nowait(message)
        elif message["type"] == "error":
            self.notices.append(message["message"])

    async def authenticate(self, token: str) -> str:
        """Authenticate the connection; returns the tenant name."""
        self.tenant = (await self.request("auth", token=token))["tenant"]
        return self.tenant

    async def upload(self, data: bytes, chunk_bytes: int | None = None) -> str:
        """Upload a program (chunked); returns its sha256. A program already there is not sent."""
        sha256 = hashlib.sha256(data).hexdigest()
        begin = await self.request("upload_begin", sha256=sha256, size=len(data))
        if begin["exists"]:
            return sha256
        step = min(chunk_bytes or begin["max_chunk_bytes"], begin["max_chunk_bytes"])
        for start in range(0, len(data), step):
            chunk = data[start:start + step]
            await self.request("upload_chunk", upload_id=begin["upload_id"],
                               data=chunk if self.binary else _b64(chunk))
        return (await self.request("upload_end", upload_id=begin["upload_id"]))["sha256"]

    async def launch(self, program: str, args: list[str] | tuple[str, ...] = (), *,
                     kv_pages: int | None = None, affinity: str | None = None) -> Instance:
        """Launch an uploaded program; returns the Instance (read its events). `affinity`: on
        a server of several replicas (`pie serve --ray`), the name of an export it will
        import, or a session key: it is placed where that export lies, or by that key."""
        fields: dict[str, Any] = {"program": program, "args": list(args)}
        if kv_pages is not None:
            fields["kv_pages"] = kv_pages
        if affinity is not None:
            fields["affinity"] = affinity
        answer = await self.request("launch", **fields)
        return Instance(self, answer["instance_id"])

    async def send(self, instance_id: str, message: str) -> None:
        """Send a client message to a running instance of this connection's tenant (launched
        on any of its connections); PieError when it has ended or its unread messages are full."""
        await self.request("send", instance_id=instance_id, message=message)

    async def terminate(self, instance_id: str) -> None:
        """Ask the server to end an instance of this tenant; its final event goes to the
        connection that launched it."""
        await self.request("terminate", instance_id=instance_id)

    async def list_programs(self) -> list[dict[str, Any]]:
        """The tenant's stored programs: [{"sha256", "size"}]."""
        return (await self.request("list_programs"))["programs"]

    async def list_instances(self) -> list[dict[str, Any]]:
        """The tenant's running instances (of every connection): [{"instance_id", "program",
        "kv_pages", "waiting_for_input"}]; waiting_for_input: blocked in `receive()` with no
        message queued for it."""
        return (await self.request("list_instances"))["instances"]

    async def logs(self, instance_id: str) -> list[str]:
        """The log of an instance of this tenant, running or ended: its `inferlet.log` lines
        ("log: ...") and its stdout / stderr ("stdout: ..."), the newest kept (1 MiB of characters while it
        runs, 16 KiB once ended, by default)."""
        return (await self.request("logs", instance_id=instance_id))["lines"]

    async def upload_adapter(self, name: str, directory: str | Path,
                             chunk_bytes: int | None = None) -> dict[str, Any]:
        """Upload the LoRA adapter in `directory` (PEFT: adapter_config.json +
        adapter_model.safetensors) as this tenant's adapter `name`, replacing one of that name.
        Returns it as list_adapters does; PieError naming the cause (the tensor at fault, the
        quota) when the server refuses it."""
        directory = Path(directory)
        config = (directory / "adapter_config.json").read_text(encoding="utf-8")
        weights = directory / "adapter_model.safetensors"
        size = weights.stat().st_size
        digest = hashlib.sha256()
        with open(weights, "rb") as file:
            for block in iter(lambda: file.read(1 << 20), b""):
                digest.update(block)
        begin = await self.request("upload_adapter", name=name, config=config,
                                   sha256=digest.hexdigest(), size=size)
        step = min(chunk_bytes or begin["max_chunk_bytes"], begin["max_chunk_bytes"])
        with open(weights, "rb") as file:
            for chunk in iter(lambda: file.read(step), b""):
                await self.request("upload_chunk", upload_id=begin["upload_id"],
                                   data=chunk if self.binary else _b64(chunk))
        answer = await self.request("upload_end", upload_id=begin["upload_id"])
        return {k: v for k, v in answer.items() if k not in ("type", "id")}

    async def list_adapters(self) -> list[dict[str, Any]]:
        """The tenant's adapters: [{"name", "sha256", "size", "rank", "alpha",
        "target_modules"}], by name."""
        return (await self.request("list_adapters"))["adapters"]

    async def delete_adapter(self, name: str) -> None:
        """Delete the tenant's adapter `name` (PieError when it has none)."""
        await self.request("delete_adapter", name=name)

    async def model_info(self) -> dict[str, Any]:
        answer = await self.request("model_info")
        return {k: v for k, v in answer.items() if k not in ("type", "id")}


def _b64(data: bytes) -> str:
    import base64
    return base64.b64encode(data).decode("ascii")


@asynccontextmanager
async def connect(server: str, token: str | None, *, binary: bool = True,
                  max_message_bytes: int = 16 * 1024 * 1024) -> AsyncIterator[PieClient]:
    """Open a connection to `server` (URL or host:port) and authenticate with `token`
    (None: stay unauthenticated, for tests of the refusal). A single error inside (PieError,
    ConnectionClosed, ...) is raised as itself, not wrapped in exception groups."""
    try:
        async with open_websocket_url(websocket_url(server),
                                      max_message_size=max_message_bytes) as websocket:
            client = PieClient(websocket, binary)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(client._read)
                try:
                    if token is not None:
                        await client.authenticate(token)
                    yield client
                finally:
                    nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        leaves = _leaves(group)
        if len(leaves) == 1 and isinstance(leaves[0], Exception):
            raise leaves[0] from None
        raise


def _leaves(group: BaseExceptionGroup) -> list[BaseException]:
    found: list[BaseException] = []
    for exc in group.exceptions:
        found.extend(_leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    return found
