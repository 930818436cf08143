"""One websocket connection: authenticate, upload, launch, send, terminate, list, logs, model info,
LoRA adapters (upload, list, delete).

Frames are read one at a time and answered in order (an answer carries the request's `id`).
Instance events arrive on the connection's event channel and are written by a second task; a
lock keeps the two writers' frames whole. Any malformed or unauthorized frame gets an `error`
naming the problem and the connection stays up. When the connection ends (client gone, or the
server shutting down after its grace period) its instances are terminated and waited for, so
every page they held is back in the pool before the handler returns.
"""
from __future__ import annotations

import itertools
import logging
from typing import Any

import trio
from starlette.websockets import WebSocket, WebSocketDisconnect

from host.server import protocol as p
from host.server.service import PieService, ServiceError
from host.server.sinks import EventSink
from engine.adapters import AdapterError, check_adapter_name
from host.server.adapters import MAX_CONFIG_BYTES
from host.server.uploads import PendingUpload, is_sha256
from host.server.tenants import Tenant, TenantRegistry

__all__ = ["Connection", "MAX_UPLOADS_PER_CONNECTION"]

_log = logging.getLogger(__name__)
MAX_UPLOADS_PER_CONNECTION = 4


class Connection:
    """The state of one client connection (trio thread only)."""

    def __init__(self, websocket: WebSocket, service: PieService, tenants: TenantRegistry, *,
                 max_chunk_bytes: int, grace_s: float) -> None:
        self.websocket = websocket
        self.service = service
        self.tenants = tenants
        self.max_chunk_bytes = max_chunk_bytes
        self.grace_s = grace_s
        self.tenant: Tenant | None = None
        self.binary = False
        self._uploads: dict[str, PendingUpload] = {}
        self._adapter_uploads: dict[str, tuple[str, bytes]] = {}   # upload id -> (name, config)
        self._upload_ids = itertools.count(1)
        self._handles: list = []
        self._send_lock = trio.Lock()
        self._writer_done = trio.Event()
        self._events = EventSink()   # the service bounds the bytes waiting here

    async def run(self) -> None:
        """Serve the connection until the client leaves or the server shuts down."""
        await self.websocket.accept()
        self._authenticate_header()
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._write_events)
                nursery.start_soon(self._close_on_shutdown, nursery.cancel_scope)
                await self._read_frames()
                nursery.cancel_scope.cancel()
        finally:
            with trio.CancelScope(shield=True):
                self._events.close()   # later events are dropped
                for upload_id in list(self._uploads):
                    self._drop_upload(upload_id)
                await self.service.terminate_and_wait(self._live_handles(), "client disconnected")

    def _authenticate_header(self) -> None:
        header = self.websocket.headers.get("authorization", "")
        if header.lower().startswith("bearer "):
            self.tenant = self.tenants.authenticate(header[7:].strip())

    def _live_handles(self) -> list:
        self._handles = [h for h in self._handles if not h.done.is_set()]
        return self._handles

    async def _read_frames(self) -> None:
        while True:
            try:
                message = await self.websocket.receive()
            except WebSocketDisconnect:
                return
            if message["type"] == "websocket.disconnect":
                return
            frame = message.get("bytes") if message.get("bytes") is not None else message.get("text")
            self.binary = isinstance(frame, bytes)
            try:
                request = p.decode_message(frame)
            except p.ProtocolError as exc:
                await self._send(p.error_message(str(exc), exc.request_id))
                continue
            try:
                await self._handle(request)
            except ServiceError as exc:
                await self._send(p.error_message(str(exc), request.id))
            except Exception as exc:  # noqa: BLE001 -- a bug must not take the connection down
                _log.exception("websocket: %s failed", type(request).__name__)
                await self._send(p.error_message(
                    f"internal error handling {type(request).__name__}: {exc}", request.id))

    async def _send(self, message: dict[str, Any]) -> None:
        frame = p.encode_message(message, self.binary)
        async with self._send_lock:
            try:
                if isinstance(frame, bytes):
                    await self.websocket.send_bytes(frame)
                else:
                    await self.websocket.send_text(frame)
            except (WebSocketDisconnect, RuntimeError, OSError):
                pass  # the client is gone; the reader sees the disconnect

    async def _write_events(self) -> None:
        async for event in self._events:
            await self._send(p.event_message(event.instance_id, event.kind, event.data))
        self._writer_done.set()

    async def _close_on_shutdown(self, cancel_scope: trio.CancelScope) -> None:
        """On server shutdown: grace period, terminate the rest (their final events still go
        out), flush the events, say why, close."""
        await self.service.closing.wait()
        with trio.move_on_after(self.grace_s):
            for handle in self._live_handles():
                await handle.done.wait()
        await self.service.terminate_and_wait(self._live_handles(), "server shutting down",
                                              detach=False)
        await self._events.close_sending()  # no launches now: the writer drains and returns
        await self._writer_done.wait()
        await self._send(p.error_message("server shutting down"))
        try:
            await self.websocket.close(code=1001)
        except (RuntimeError, OSError):
            pass
        cancel_scope.cancel()

    # ---- requests ---------------------------------------------------------------------------

    async def _handle(self, request: p.ClientMessage) -> None:
        if isinstance(request, p.Auth):
            self.tenant = self.tenants.authenticate(request.token)
            if self.tenant is None:
                raise ServiceError("authentication failed: invalid token")
            await self._send(p.reply_message(request.id, tenant=self.tenant.name))
            return
        if self.tenant is None:
            raise ServiceError(f"not authenticated: send an 'auth' message (or connect with an "
                               f"'Authorization: Bearer' header) before {type(request).__name__}")
        handler = getattr(self, f"_on_{type(request).__name__}")
        await handler(self.tenant, request)

    async def _on_UploadBegin(self, tenant: Tenant, request: p.UploadBegin) -> None:
        if not is_sha256(request.sha256):
            raise ServiceError(f"upload_begin: sha256 must be 64 lower-case hex digits, "
                               f"got {request.sha256!r}")
        limit = self.service.max_upload_bytes
        if not 0 < request.size <= limit:
            raise ServiceError(f"upload_begin: size {request.size} out of range (1..{limit} bytes)")
        if await self.service.owns_program(tenant, request.sha256):
            await self._send(p.reply_message(request.id, exists=True, sha256=request.sha256))
            return
        if len(self._uploads) >= MAX_UPLOADS_PER_CONNECTION:
            raise ServiceError(f"upload_begin: at most {MAX_UPLOADS_PER_CONNECTION} uploads "
                               f"in progress per connection")
        upload_id = f"u{next(self._upload_ids)}"
        self.service.reserve_upload(tenant, request.size)
        try:
            self._uploads[upload_id] = self.service.store.begin(tenant.name, request.sha256,
                                                                request.size)
        except OSError as exc:
            self.service.release_upload(tenant.name, request.size)
            raise ServiceError(f"upload_begin: cannot spill the upload to disk: {exc}") from None
        await self._send(p.reply_message(request.id, exists=False, upload_id=upload_id,
                                         max_chunk_bytes=self.max_chunk_bytes))

    def _upload(self, upload_id: str) -> PendingUpload:
        upload = self._uploads.get(upload_id)
        if upload is None:
            raise ServiceError(f"unknown upload {upload_id!r}")
        return upload

    def _drop_upload(self, upload_id: str) -> PendingUpload:
        """Forget an upload: its file is closed, its bytes no longer count for the tenant."""
        upload = self._uploads.pop(upload_id)
        self._adapter_uploads.pop(upload_id, None)
        upload.close()
        self.service.release_upload(upload.tenant, upload.size)
        return upload

    async def _on_UploadChunk(self, tenant: Tenant, request: p.UploadChunk) -> None:
        upload = self._upload(request.upload_id)
        if len(request.data) > self.max_chunk_bytes:
            self._drop_upload(request.upload_id)
            raise ServiceError(f"upload {request.upload_id}: chunk of {len(request.data)} bytes "
                               f"exceeds {self.max_chunk_bytes}; upload aborted")
        if upload.num_received + len(request.data) > upload.size:
            self._drop_upload(request.upload_id)
            raise ServiceError(f"upload {request.upload_id}: more than the declared {upload.size} "
                               f"bytes; upload aborted")
        await trio.to_thread.run_sync(upload.write, request.data)
        if request.id is not None:
            await self._send(p.reply_message(request.id, received=upload.num_received))

    async def _on_UploadEnd(self, tenant: Tenant, request: p.UploadEnd) -> None:
        upload = self._upload(request.upload_id)
        try:
            if upload.num_received != upload.size:
                raise ServiceError(f"upload {request.upload_id}: got {upload.num_received} "
                                   f"bytes, declared {upload.size}")
            digest = upload.hexdigest()
            if digest != upload.sha256:
                raise ServiceError(f"upload {request.upload_id}: sha256 mismatch: declared "
                                   f"{upload.sha256}, received bytes hash to {digest}")
            adapter = self._adapter_uploads.get(request.upload_id)
            if adapter is not None:
                stored = await self.service.add_adapter(tenant, *adapter, upload.file, digest)
                await self._send(p.reply_message(request.id, **stored.as_dict()))
                return
            data = await trio.to_thread.run_sync(upload.read_all)
        finally:
            self._drop_upload(request.upload_id)
        stored = await self.service.add_program(tenant, data, digest)
        await self._send(p.reply_message(request.id, sha256=stored.sha256, size=stored.size))

    async def _on_Launch(self, tenant: Tenant, request: p.Launch) -> None:
        program = await self.service.program_for(tenant, request.program)
        handle = await self.service.launch(tenant, program, request.program, request.args,
                                           self._events, request.kv_pages, request.affinity,
                                           keep_spares=True)
        self._handles.append(handle)
        await self._send(p.reply_message(request.id, instance_id=handle.instance_id,
                                         kv_pages=handle.kv_pages))

    async def _on_Send(self, tenant: Tenant, request: p.Send) -> None:
        self.service.send(tenant, request.instance_id, request.message)
        await self._send(p.reply_message(request.id))

    async def _on_Terminate(self, tenant: Tenant, request: p.Terminate) -> None:
        try:
            handle = self.service.find(tenant, request.instance_id)
        except ServiceError:                # not launched by a client: a child of one, or none
            await self.service.terminate_child(tenant, request.instance_id,
                                               "terminated by client")
        else:
            await self.service.terminate(handle, "terminated by client")
        await self._send(p.reply_message(request.id))

    async def _on_ListPrograms(self, tenant: Tenant, request: p.ListPrograms) -> None:
        programs = await trio.to_thread.run_sync(self.service.list_programs, tenant)
        await self._send(p.reply_message(request.id, programs=[
            {"sha256": prog.sha256, "size": prog.size} for prog in programs]))

    async def _on_ListInstances(self, tenant: Tenant, request: p.ListInstances) -> None:
        launched = [{"instance_id": h.instance_id, "program": h.program, "kv_pages": h.kv_pages,
                     "waiting_for_input": self.service.waiting_for_input(h),
                     "parent_id": None, "depth": 0}
                    for h in self.service.list_instances(tenant)]
        children = [{"instance_id": c.instance_id, "program": c.program_hash,
                     "kv_pages": c.page_quota,
                     "waiting_for_input": self.service.waiting_for_input(c.instance_id),
                     "parent_id": c.parent_id, "depth": c.depth}
                    for c in self.service.list_children(tenant)]
        await self._send(p.reply_message(request.id, instances=launched + children))

    async def _on_Logs(self, tenant: Tenant, request: p.Logs) -> None:
        await self._send(p.reply_message(request.id, lines=list(
            self.service.logs(tenant, request.instance_id))))

    async def _on_GetModelInfo(self, tenant: Tenant, request: p.GetModelInfo) -> None:
        await self._send(p.reply_message(request.id, **self.service.model_info()))

    async def _on_UploadAdapter(self, tenant: Tenant, request: p.UploadAdapter) -> None:
        """Begin an adapter upload: its config now, its weights as the upload's chunks; checked
        and kept at upload_end (PieService.add_adapter)."""
        adapters = self.service.adapters
        if adapters is None:
            raise ServiceError("upload_adapter: this server's engine takes no LoRA adapters")
        try:
            check_adapter_name(request.name)
        except AdapterError as error:
            raise ServiceError(f"upload_adapter: {error}") from None
        if not is_sha256(request.sha256):
            raise ServiceError(f"upload_adapter: sha256 must be 64 lower-case hex digits, "
                               f"got {request.sha256!r}")
        config = request.config.encode("utf-8")
        if not 0 < len(config) <= MAX_CONFIG_BYTES:
            raise ServiceError(f"upload_adapter: config of {len(config)} bytes out of range "
                               f"(1..{MAX_CONFIG_BYTES})")
        limit = tenant.max_adapter_bytes - len(config)
        if not 0 < request.size <= limit:
            raise ServiceError(f"upload_adapter: size {request.size} out of range (1..{limit} "
                               f"bytes: the tenant's max_adapter_bytes less the config)")
        if len(self._uploads) >= MAX_UPLOADS_PER_CONNECTION:
            raise ServiceError(f"upload_adapter: at most {MAX_UPLOADS_PER_CONNECTION} uploads "
                               f"in progress per connection")
        upload_id = f"u{next(self._upload_ids)}"
        self.service.reserve_upload(tenant, request.size)
        try:
            file = adapters.begin()
        except OSError as exc:
            self.service.release_upload(tenant.name, request.size)
            raise ServiceError(f"upload_adapter: cannot spill the upload to disk: {exc}") from None
        self._uploads[upload_id] = PendingUpload(tenant.name, request.sha256, request.size, file)
        self._adapter_uploads[upload_id] = (request.name, config)
        await self._send(p.reply_message(request.id, upload_id=upload_id,
                                         max_chunk_bytes=self.max_chunk_bytes))

    async def _on_ListAdapters(self, tenant: Tenant, request: p.ListAdapters) -> None:
        adapters = await self.service.list_adapters(tenant)
        await self._send(p.reply_message(request.id, adapters=[a.as_dict() for a in adapters]))

    async def _on_DeleteAdapter(self, tenant: Tenant, request: p.DeleteAdapter) -> None:
        await self.service.delete_adapter(tenant, request.name)
        await self._send(p.reply_message(request.id))
