"""The server's core, owned by its trio thread: programs, instances, tenancy, events, shutdown.

Instance threads touch only the sink's byte count and a handle's `cut_off` flag. The runtime
calls `on_event` from an instance's thread; that callback counts the event's bytes in the sink
(an `EventSink`) of whoever launched the instance (a websocket connection or an OpenAI request),
queues the event onto the trio loop (`TrioToken.run_sync_soon`, the token is taken at `start`),
where it is handed to that sink. A closed sink drops the event. A client that stops reading has
its instance cut off, from the instance's own thread, once an event would put more than
`max_backlog_bytes` in flight to or waiting in its sink: the instance is terminated, that event
and its later messages are dropped, and its one final event (`terminated`, with the reason)
still goes out, last.
Blocking runtime calls (load_program, launch, terminate, wait, close) run in `trio.to_thread`.
"""
from __future__ import annotations

import itertools
import threading
import logging
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import trio

from host.errors import LimitError
from host.server.adapters import AdapterUploadError, StoredAdapter
from host.server.metrics import ServerMetrics
from host.server.sinks import EventSink
from host.server.uploads import UploadStore, StoredProgram, UnknownProgramError
from host.server.tenants import QuotaBook, QuotaExceeded, Tenant

__all__ = ["ServiceError", "InstanceHandle", "PieService", "FINAL_KINDS"]

_log = logging.getLogger("pie.server")

FINAL_KINDS = frozenset({"result", "error", "trap", "terminated"})
MAX_ENDED_KEPT = 4096     # ended instances whose owner is remembered (their logs: `logs`)


class ServiceError(Exception):
    """A request the server refuses; the message is sent to the client as is."""


@dataclass(eq=False)
class InstanceHandle:
    """The server's record of one instance (trio thread only)."""

    key: str                                 # reservation key, known before the instance id
    tenant: str
    program: str
    sink: EventSink | None
    kv_pages: int
    instance_id: str = ""
    cut_off: bool = False                    # its client stopped reading: messages dropped
    final_kind: str = ""
    final_data: str = ""
    done: trio.Event = field(default_factory=trio.Event)


class PieService:
    """Programs, instances and tenancy over one Runtime. Call `start()` inside trio first."""

    def __init__(self, runtime: Any, store: UploadStore, metrics: ServerMetrics, *,
                 limits: Any, max_upload_bytes: int, model: dict[str, Any],
                 max_backlog_bytes: int = 16 * 1024 * 1024,
                 max_tenant_upload_bytes: int = 256 * 1024 * 1024, adapters: Any = None) -> None:
        self.runtime = runtime
        self.adapters = adapters                # host.server.adapters.TenantAdapters, or None
        self._model = dict(model)
        self.store = store
        self.metrics = metrics
        self.limits = limits                    # host.runtime_config.InstanceLimits of every instance
        self.max_upload_bytes = max_upload_bytes
        self.max_backlog_bytes = max_backlog_bytes  # event bytes waiting per sink
        self.max_tenant_upload_bytes = max_tenant_upload_bytes  # declared sizes in flight
        self._upload_bytes: dict[str, int] = {}       # tenant -> declared bytes in flight
        self.quotas = QuotaBook()
        self.closing = trio.Event()
        self._programs: dict[str, Any] = {}     # sha256 -> compiled Program
        self._handles: dict[str, InstanceHandle] = {}   # by reservation key
        self._ended: OrderedDict[str, str] = OrderedDict()   # instance id -> tenant, newest last
        self._keys = itertools.count()
        self._token: trio.lowlevel.TrioToken | None = None
        self._spare_programs: dict[str, tuple[str, Any]] = {}   # tenant -> (sha256, Program)
        self._spares_lock = threading.Lock()    # the runtime's spares follow _spare_programs

    def model_info(self) -> dict[str, Any]:
        """The served model: name, page_size, num_pages, vocab_size, max_batch_tokens."""
        return dict(self._model)

    def start(self) -> None:
        """Bind to the running trio loop (instance threads report through it)."""
        self._token = trio.lowlevel.current_trio_token()

    # ---- programs ---------------------------------------------------------------------------

    async def add_program(self, tenant: Tenant, data: bytes, sha256: str) -> StoredProgram:
        """Validate (compile) and store an uploaded program whose hash was checked; adding one
        the tenant already holds is a no-op."""
        if await trio.to_thread.run_sync(self.store.owns, tenant.name, sha256):
            return StoredProgram(sha256, len(data))
        used = await trio.to_thread.run_sync(self.store.tenant_bytes, tenant.name)
        if used + len(data) > tenant.max_program_bytes:
            raise ServiceError(f"tenant {tenant.name!r}: program quota: {len(data)} bytes more "
                               f"would exceed {tenant.max_program_bytes} (using {used})")
        program = await self._compile(data)
        count = getattr(self.runtime, "count_program", None)   # --ray: across every front
        if count is not None:
            try:
                await trio.to_thread.run_sync(count, tenant.name, sha256, len(data))
            except Exception as exc:  # ReservationError: the quota across the cluster
                raise ServiceError(str(exc)) from None
        result = await trio.to_thread.run_sync(self.store.put, tenant.name, data)
        self._programs[result.sha256] = program
        return result

    def reserve_upload(self, tenant: Tenant, size: int) -> None:
        """Count an upload of `size` declared bytes against the tenant's in-flight bound
        (ServiceError when it would pass server.max_tenant_upload_bytes)."""
        used = self._upload_bytes.get(tenant.name, 0)
        if used + size > self.max_tenant_upload_bytes:
            raise ServiceError(f"upload_begin: tenant {tenant.name!r} has {used} bytes of uploads "
                               f"in progress; {size} more would pass "
                               f"server.max_tenant_upload_bytes ({self.max_tenant_upload_bytes})")
        self._upload_bytes[tenant.name] = used + size

    def release_upload(self, tenant_name: str, size: int) -> None:
        """An upload counted by `reserve_upload` ended (stored, refused or abandoned)."""
        left = self._upload_bytes.get(tenant_name, 0) - size
        if left > 0:
            self._upload_bytes[tenant_name] = left
        else:
            self._upload_bytes.pop(tenant_name, None)

    def upload_bytes_in_flight(self, tenant: Tenant) -> int:
        return self._upload_bytes.get(tenant.name, 0)

    async def owns_program(self, tenant: Tenant, sha256: str) -> bool:
        return await trio.to_thread.run_sync(self.store.owns, tenant.name, sha256)

    async def _compile(self, data: bytes) -> Any:
        try:
            return await trio.to_thread.run_sync(self.runtime.load_program, data)
        except Exception as exc:  # ProgramError and whatever wasmtime raises on bad bytes
            raise ServiceError(f"not a valid inferlet component: {exc}") from None

    async def program_for(self, tenant: Tenant, sha256: str) -> Any:
        """The compiled program `sha256` of this tenant (ServiceError when it has none)."""
        if not await trio.to_thread.run_sync(self.store.owns, tenant.name, sha256):
            raise ServiceError(f"unknown program {sha256!r}: upload it first")
        if sha256 not in self._programs:
            try:
                data = await trio.to_thread.run_sync(self.store.read, tenant.name, sha256)
            except UnknownProgramError as exc:
                raise ServiceError(str(exc)) from None
            self._programs[sha256] = await self._compile(data)
        return self._programs[sha256]

    def list_programs(self, tenant: Tenant) -> list[StoredProgram]:
        return self.store.list(tenant.name)

    # ---- adapters ---------------------------------------------------------------------------

    def _tenant_adapters(self) -> Any:
        if self.adapters is None:
            raise ServiceError("this server's engine takes no LoRA adapters")
        return self.adapters

    async def add_adapter(self, tenant: Tenant, name: str, config: bytes, weights: Any,
                          weights_sha256: str) -> StoredAdapter:
        """Check and keep the tenant's adapter `name` (host/server/adapters.py: TenantAdapters.add);
        `weights` the uploaded safetensors file, its sha256 checked."""
        adapters = self._tenant_adapters()
        try:
            return await trio.to_thread.run_sync(partial(
                adapters.add, tenant.name, tenant.max_adapter_bytes, name, config, weights,
                weights_sha256))
        except AdapterUploadError as error:
            raise ServiceError(str(error)) from None

    async def list_adapters(self, tenant: Tenant) -> list[StoredAdapter]:
        if self.adapters is None:
            return []
        return await trio.to_thread.run_sync(self.adapters.list, tenant.name)

    async def delete_adapter(self, tenant: Tenant, name: str) -> None:
        adapters = self._tenant_adapters()
        try:
            await trio.to_thread.run_sync(adapters.delete, tenant.name, name)
        except AdapterUploadError as error:
            raise ServiceError(str(error)) from None

    # ---- instances --------------------------------------------------------------------------

    async def launch(self, tenant: Tenant, program: Any, sha256: str, args: tuple[str, ...],
                     sink: EventSink | None, kv_pages: int | None = None,
                     affinity: str | None = None, keep_spares: bool = False) -> InstanceHandle:
        """Launch `program` for `tenant`; its events go to `sink`. Returns the handle.
        `affinity` (an export it will import, or a session key) places it on a cluster
        (`pie serve --ray`); one process has nowhere else to place it and ignores it.
        `keep_spares` (an upload's launch): from now on the tenant's spare_instances are of
        this program."""
        if self.closing.is_set():
            raise ServiceError("server is shutting down: no new instances")
        pages = tenant.default_kv_pages if kv_pages is None else kv_pages
        try:
            self.quotas.check_launch(tenant, pages, self.runtime.num_lingering(tenant.name))
        except QuotaExceeded as exc:
            raise ServiceError(str(exc)) from None
        handle = InstanceHandle(f"r{next(self._keys)}", tenant.name, sha256, sink, pages)
        self.quotas.add(tenant, handle.key, pages)
        self._handles[handle.key] = handle
        limits = replace(self.limits, page_quota=pages, outbound=tenant.outbound)
        if tenant.max_receive_wait_s is not None:
            limits = replace(limits, max_receive_wait_s=tenant.max_receive_wait_s)
        placement = ({"affinity": affinity} if affinity is not None
                     and getattr(self.runtime, "places_by_affinity", False) else {})
        try:
            handle.instance_id = await trio.to_thread.run_sync(partial(
                self.runtime.launch, program, tuple(args), tenant=tenant.name, limits=limits,
                on_event=partial(self._on_event_threaded, handle), **placement))
        except Exception as exc:
            self._forget(handle)
            raise ServiceError(f"launch failed: {exc}") from None
        self.metrics.instances_launched.inc()
        kept = self._spare_programs.get(tenant.name)
        if keep_spares and tenant.spare_instances and (kept is None or kept[0] != sha256):
            # a tenant's launches differ only in page_quota, which spares do not fix: the same
            # program's spares are already kept
            await trio.to_thread.run_sync(self._keep_spares, tenant, program, sha256, limits)
        return handle

    def _keep_spares(self, tenant: Tenant, program: Any, sha256: str, limits: Any) -> None:
        """On a worker thread: keep the tenant's spare_instances spares of `program` for its
        launches with `limits` (whatever their page reservation), and none of the program they
        were of before. A refusal is logged: the launch stands, its successors instantiate."""
        with self._spares_lock:
            previous = self._spare_programs.get(tenant.name)
            try:
                if previous is not None and previous[0] != sha256:
                    self.runtime.keep_spares(previous[1], 0, limits=limits, owner=tenant.name)
                self.runtime.keep_spares(program, tenant.spare_instances, limits=limits,
                                         owner=tenant.name)
            except Exception as exc:                # ValueError, ClusterError: no spares
                _log.warning("tenant %s: no spares of program %s: %s", tenant.name,
                             sha256[:12], exc)
                return
            self._spare_programs[tenant.name] = (sha256, program)

    def _on_event_threaded(self, handle: InstanceHandle, event: Any) -> None:
        """Runtime callback, on the instance's thread (a final event may come from the thread
        that abandoned it): count the event in the sink, then queue it for the trio thread.

        `run_sync_soon` does not wait for the trio loop, so an instance never stalls on a busy
        server (callbacks run in FIFO order: events stay in order); the bytes on their way are
        bounded by the cut-off here, however far behind the loop is."""
        final = event.kind in FINAL_KINDS
        if handle.cut_off and not final:
            return                          # cut off: its later messages are dropped
        sink = handle.sink
        if sink is not None:
            num_bytes = sink.reserve(event)
            if not final and num_bytes > self.max_backlog_bytes:
                sink.release(event)
                self._cut_off(handle, event.instance_id, num_bytes)
                return
        try:
            self._token.run_sync_soon(self._deliver, handle, event, sink)
        except trio.RunFinishedError:
            pass  # the server is gone; nobody is listening

    def _cut_off(self, handle: InstanceHandle, instance_id: str, num_bytes: int) -> None:
        """The client is not reading: terminate the instance (on its own thread), drop its later
        messages (its final event still goes out). `instance_id` comes from the event: the
        launching task may not have seen `launch` return yet (handle.instance_id still empty)."""
        handle.cut_off = True
        try:
            self.runtime.terminate(instance_id, (
                f"client not reading: {num_bytes} bytes of events waiting, over "
                f"server.max_client_backlog_bytes ({self.max_backlog_bytes})"))
        except KeyError:
            pass  # it ended and was forgotten meanwhile: nothing left to cut off

    def _deliver(self, handle: InstanceHandle, event: Any, sink: EventSink | None) -> None:
        """Hand an event counted in `sink` to it (trio thread). Never raises: it runs as a trio
        `run_sync_soon` callback, where an exception would stop the whole server."""
        try:
            self._deliver_counted(handle, event, sink)
        except Exception:  # noqa: BLE001 -- a bug here must not stop the server
            _log.exception("instance %s: delivering a %s event failed", event.instance_id,
                           event.kind)

    def _deliver_counted(self, handle: InstanceHandle, event: Any, sink: EventSink | None) -> None:
        if handle.final_kind:               # one final event, and nothing after it
            if sink is not None:
                sink.release(event)
            return
        self.metrics.count_event(event.kind, event.data)
        final = event.kind in FINAL_KINDS
        if final:
            handle.final_kind, handle.final_data = event.kind, event.data
        if sink is not None:
            if handle.sink is not sink:     # detached meanwhile: its client is gone
                sink.release(event)
            else:
                try:
                    sink.put(event)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    handle.sink = None
        if final:
            self._forget(handle)

    def _forget(self, handle: InstanceHandle) -> None:
        self.quotas.remove(handle.key)
        self._handles.pop(handle.key, None)
        if handle.instance_id:
            self._ended[handle.instance_id] = handle.tenant
            while len(self._ended) > MAX_ENDED_KEPT:
                self._ended.popitem(last=False)
        handle.done.set()

    def find(self, tenant: Tenant, instance_id: str) -> InstanceHandle:
        """The tenant's live instance `instance_id` (ServiceError when it has none)."""
        for handle in self._handles.values():
            if handle.instance_id == instance_id and handle.tenant == tenant.name:
                return handle
        raise ServiceError(f"unknown instance {instance_id!r}")

    def list_instances(self, tenant: Tenant) -> list[InstanceHandle]:
        return [h for h in self._handles.values() if h.tenant == tenant.name and h.instance_id]

    def list_children(self, tenant: Tenant) -> list[Any]:
        """The running children (host.spawns.ChildInfo) of the tenant's instances, at every
        depth (none on a runtime without child inferlets)."""
        spawns = getattr(self.runtime, "spawns", None)
        return [] if spawns is None else spawns.children(tenant.name)

    def find_child(self, tenant: Tenant, instance_id: str) -> Any:
        """The tenant's running child `instance_id` (ServiceError when it has none)."""
        spawns = getattr(self.runtime, "spawns", None)
        child = None if spawns is None else spawns.child_of(tenant.name, instance_id)
        if child is None:
            raise ServiceError(f"unknown instance {instance_id!r}")
        return child

    async def terminate_child(self, tenant: Tenant, instance_id: str, reason: str) -> None:
        """End the tenant's child `instance_id` (its parent sees it end; no event here)."""
        child = self.find_child(tenant, instance_id)
        try:
            await trio.to_thread.run_sync(self.runtime.terminate, child.instance_id, reason)
        except KeyError:
            pass                            # it ended meanwhile

    def waiting_for_input(self, handle: InstanceHandle | str) -> bool:
        """Whether the instance (a handle, or a child's id) waits in a receive with no client
        message queued for it."""
        instance_id = handle if isinstance(handle, str) else handle.instance_id
        return self.runtime.hub.waiting_for_client(instance_id)

    def logs(self, tenant: Tenant, instance_id: str) -> tuple[str, ...]:
        """The log of the tenant's instance `instance_id`, running or ended: its newest lines,
        as the runtime bounds them (InstanceLimits.max_log_chars while it runs,
        RuntimeConfig.finished_log_chars once ended). ServiceError when the tenant has no such
        instance, or its log is no longer kept."""
        owner = next((h.tenant for h in self._handles.values()
                      if h.instance_id == instance_id), None) or self._ended.get(instance_id)
        if owner != tenant.name:
            raise ServiceError(f"unknown instance {instance_id!r}")
        try:
            return self.runtime.instance_log(instance_id)
        except KeyError:
            raise ServiceError(f"instance {instance_id!r}: its log is no longer kept (the "
                               f"runtime keeps the newest ended instances only)") from None

    def send(self, tenant: Tenant, instance_id: str, message: str) -> None:
        handle = self.find(tenant, instance_id)
        try:
            delivered = self.runtime.send(handle.instance_id, message)
        except LimitError as error:          # the instance's unread client messages are full
            raise ServiceError(str(error)) from None
        if not delivered:
            raise ServiceError(f"instance {instance_id!r} has ended")

    async def terminate(self, handle: InstanceHandle, reason: str) -> None:
        """Ask the runtime to end the instance (its final event follows)."""
        if handle.instance_id and not handle.done.is_set():
            await trio.to_thread.run_sync(self.runtime.terminate, handle.instance_id, reason)

    async def terminate_and_wait(self, handles: list[InstanceHandle], reason: str, *,
                                 detach: bool = True) -> None:
        """Terminate instances and wait until the runtime has released them (pages returned).
        `detach`: drop their remaining events (their client is gone)."""
        for handle in handles:
            if detach:
                handle.sink = None
            await self.terminate(handle, reason)
        for handle in handles:
            if handle.instance_id:
                await trio.to_thread.run_sync(self.runtime.wait, handle.instance_id)
            await handle.done.wait()

    # ---- shutdown ---------------------------------------------------------------------------

    async def shutdown(self, grace_s: float) -> None:
        """Refuse new work, let instances finish for `grace_s`, terminate the rest, close."""
        self.closing.set()
        with trio.move_on_after(grace_s):
            while self._handles:
                await next(iter(self._handles.values())).done.wait()
        await self.terminate_and_wait(list(self._handles.values()), "server shutting down")
        await trio.to_thread.run_sync(self.runtime.close)

