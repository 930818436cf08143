"""Frozen configuration of the runtime and of each instance, validated once here (ValueError)."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from host.scheduling.types import SchedulerPolicy

__all__ = ["InstanceLimits", "McpServer", "MessageLimits", "OutboundLimits", "RuntimeConfig",
           "default_cache_dir", "split_host_rule"]

_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.")
_HOST_CHARS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789-.:")


def default_cache_dir() -> Path:
    """`$PIE_CACHE_DIR`, else ~/.cache/pie."""
    configured = os.environ.get("PIE_CACHE_DIR")
    return Path(configured) if configured else Path.home() / ".cache" / "pie"


@dataclass(frozen=True)
class McpServer:
    """An MCP server an instance may reach (host/outbound/mcp.py), named as the guest names it.

    name:    the name `mcp.tools(name)` / `mcp.call(name, ...)` give.
    url:     a streamable HTTP endpoint (http:// or https://), or "".
    command: a stdio server: the program and its arguments, run by the host (the operator's
             command, never the tenant's); exactly one of url, command.
    """

    name: str
    url: str = ""
    command: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "command", tuple(self.command))
        if not self.name or not set(self.name) <= _NAME_CHARS or len(self.name) > 64:
            raise ValueError(f"McpServer.name must be 1..64 letters, digits, '_-.', got "
                             f"{self.name!r}")
        if bool(self.url) == bool(self.command):
            raise ValueError(f"MCP server {self.name!r}: give exactly one of url, command")
        if self.url and not self.url.startswith(("http://", "https://")):
            raise ValueError(f"MCP server {self.name!r}: url must start with http:// or "
                             f"https://, got {self.url!r}")
        if any(not isinstance(part, str) or not part for part in self.command):
            raise ValueError(f"MCP server {self.name!r}: command parts must be non-empty "
                             f"strings, got {self.command!r}")


@dataclass(frozen=True)
class OutboundLimits:
    """What one instance may reach outside the host: HTTP (host/outbound/) and MCP servers.
    Nothing by default.

    allow_hosts:    "HOST[:PORT]" (exactly that host) or ".SUFFIX[:PORT]" (the suffix's
                    subdomains and itself); no port = 80 and 443. A name that resolves to a
                    loopback, link-local, private or otherwise non-global address is refused;
                    only an IP literal listed here (e.g. "127.0.0.1:8080") reaches one.
    timeout_s:      longest one request may take, every redirect and the whole body included.
    max_request_bytes: body of one request.
    max_response_bytes: body of one response, read as it streams: a longer one is cut at the
                    cap and the request fails naming it.
    requests_per_minute: requests of one tenant in any 60 s (shared by its instances).
    max_concurrent: requests of one instance in flight or answered but not yet read.
    max_redirects:  redirects one request follows (each hop checked as the first).
    mcp_servers:    the MCP servers the instance may call.
    mcp_timeout_s:  longest an MCP call (or listing) may take, connecting included.
    max_mcp_result_chars: characters of one MCP answer (the JSON text the guest gets).
    """

    allow_hosts: tuple[str, ...] = ()
    timeout_s: float = 10.0
    max_request_bytes: int = 1 << 20
    max_response_bytes: int = 4 << 20
    requests_per_minute: int = 120
    max_concurrent: int = 8
    max_redirects: int = 5
    mcp_servers: tuple[McpServer, ...] = ()
    mcp_timeout_s: float = 30.0
    max_mcp_result_chars: int = 1 << 20

    def __post_init__(self) -> None:
        object.__setattr__(self, "allow_hosts", tuple(self.allow_hosts))
        object.__setattr__(self, "mcp_servers", tuple(self.mcp_servers))
        for rule in self.allow_hosts:
            _check_host_rule(rule)
        for name, low, high in (("max_request_bytes", 0, 1 << 30),
                                ("max_response_bytes", 1, 1 << 30),
                                ("requests_per_minute", 1, 1_000_000),
                                ("max_concurrent", 1, 4096), ("max_redirects", 0, 64),
                                ("max_mcp_result_chars", 1, 1 << 30)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
                raise ValueError(f"OutboundLimits.{name} must be in {low}..{high}, got {value!r}")
        for name in ("timeout_s", "mcp_timeout_s"):
            value = getattr(self, name)
            if not 0 < value <= 3600:
                raise ValueError(f"OutboundLimits.{name} must be in (0, 3600], got {value!r}")
        names = [server.name for server in self.mcp_servers]
        if len(set(names)) != len(names):
            raise ValueError(f"OutboundLimits.mcp_servers: a name is given twice in {names}")


def _check_host_rule(rule: str) -> None:
    """ValueError unless `rule` is HOST[:PORT] or .SUFFIX[:PORT] (IPv6: [ADDR][:PORT])."""
    host, port = split_host_rule(rule)
    if not host.lstrip(".") or not set(host.lstrip(".")) <= _HOST_CHARS or ".." in host \
            or (port is not None and not 1 <= port <= 65535):
        raise ValueError(f"allow_hosts: {rule!r} is not HOST[:PORT] or .SUFFIX[:PORT]")


def split_host_rule(rule: str) -> tuple[str, int | None]:
    """("host", port or None) of an allow_hosts entry, the host lowercased (ValueError when
    the port is not a number)."""
    if not isinstance(rule, str):
        raise ValueError(f"allow_hosts: {rule!r} is not a string")
    text = rule.strip().lower()
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port_text = rest[1:] if rest.startswith(":") else (None if not rest else "x")
    elif text.count(":") == 1:
        host, port_text = text.split(":")
    else:
        host, port_text = text, None
    if port_text is None:
        return host, None
    if not port_text.isdigit():
        raise ValueError(f"allow_hosts: {rule!r}: the port must be a number")
    return host, int(port_text)


@dataclass(frozen=True)
class InstanceLimits:
    """What one instance may use.

    memory_mb:      the guest's linear memory in total, all its memories together (a Python guest
                    needs >= 13 MiB to start): counted exactly with
                    RuntimeConfig.count_linear_memory (the default), else each of max_memories
                    memories may grow to memory_mb / max_memories.
    max_memories:   linear memories the instance may create (a componentize-py or wit-bindgen
                    component has one; more are refused at instantiation); they share memory_mb.
    max_tables:     tables the instance may create (componentize-py: 2).
    max_table_elements: elements of each table (8 bytes each: at most
                    max_tables * max_table_elements * 8 bytes of tables in all).
    max_core_instances: core module instances of the component (componentize-py: 15).
    max_log_chars:  characters of the instance's log kept while it runs (its newest lines; each
                    line at most 8,192 characters).
    max_result_chars: characters of the string `run` returns; a longer one ends the instance
                    with a trap naming the limit.
    max_idle_s:     longest the guest may compute without calling the host before it traps with
                    "no host call for N s" (time blocked in the host does not count).
    page_quota:     most KV pages held at once; None = the whole pool.
    max_blocking_s: longest one blocking host call (future get, receive, synchronize) may wait;
                    None = until the instance is terminated.
    max_receive_wait_s: longest a receive (a client message, or a topic's) may wait: an
                    instance blocked there longer traps with "messaging.receive: no message
                    within N s (max_receive_wait_s)", so one whose client went quiet does not
                    hold its pages and thread for ever. None = no bound but max_blocking_s.
    outbound:       what it may reach outside the host (HTTP, MCP servers): OutboundLimits;
                    nothing by default.
    max_spawn_depth: how deep children may nest (children.spawn): a launched instance is at
                    depth 0, its children at 1; a spawn that would pass it is refused naming
                    it. 0 = no children.
    max_children:   children one instance may have alive at once (its fan-out).
    max_spawns:     children spawned in all by one tree of instances (a launched instance, its
                    children, theirs, ...), alive or ended: what stops a fork bomb within a
                    tenant's instance quota, and a loop of spawns in `pie run`.
    """

    memory_mb: int = 256
    max_memories: int = 1
    max_tables: int = 8
    max_table_elements: int = 65_536
    max_core_instances: int = 64
    max_log_chars: int = 1 << 20
    max_result_chars: int = 4 << 20
    max_idle_s: float = 10.0
    page_quota: int | None = None
    max_blocking_s: float | None = None
    max_receive_wait_s: float | None = 300.0
    outbound: OutboundLimits = field(default_factory=OutboundLimits)
    max_spawn_depth: int = 4
    max_children: int = 16
    max_spawns: int = 256

    def __post_init__(self) -> None:
        if self.memory_mb <= 0 or self.memory_mb > 4096:
            raise ValueError(f"InstanceLimits.memory_mb must be in 1..4096, got {self.memory_mb}")
        for name, low, high in (("max_memories", 1, 16), ("max_tables", 1, 1024),
                                ("max_table_elements", 1, 1 << 24),
                                ("max_core_instances", 1, 10_000),
                                ("max_log_chars", 1, 1 << 30), ("max_result_chars", 1, 1 << 30),
                                ("max_spawn_depth", 0, 64), ("max_children", 0, 4096),
                                ("max_spawns", 0, 1_000_000)):
            value = getattr(self, name)
            if not isinstance(value, int) or not low <= value <= high:
                raise ValueError(f"InstanceLimits.{name} must be in {low}..{high}, got {value!r}")
        if not self.max_idle_s > 0:
            raise ValueError(f"InstanceLimits.max_idle_s must be > 0, got {self.max_idle_s}")
        if self.page_quota is not None and self.page_quota < 0:
            raise ValueError(f"InstanceLimits.page_quota must be >= 0, got {self.page_quota}")
        if self.max_blocking_s is not None and not self.max_blocking_s > 0:
            raise ValueError(f"InstanceLimits.max_blocking_s must be > 0 or None, "
                             f"got {self.max_blocking_s}")
        if self.max_receive_wait_s is not None and not self.max_receive_wait_s > 0:
            raise ValueError(f"InstanceLimits.max_receive_wait_s must be > 0 or None, "
                             f"got {self.max_receive_wait_s}")
        if not isinstance(self.outbound, OutboundLimits):
            raise ValueError(f"InstanceLimits.outbound must be OutboundLimits, "
                             f"got {self.outbound!r}")


@dataclass(frozen=True)
class MessageLimits:
    """What the messages of a runtime may hold (characters: a str of N characters holds at most
    4N bytes). Each bound is per tenant or per instance, so one cannot fill the host for others.

    store_max_keys:         keys of one tenant's key-value store.
    store_max_chars:        characters of one tenant's store, keys and values together; a
                            store-set past it traps naming the limit.
    topic_max_messages:     unread broadcasts of one subscription; past it the oldest is dropped.
    topic_max_chars:        characters of unread broadcasts of one subscription; past it the
                            oldest are dropped (counted in Inbox.num_dropped).
    max_subscriptions:      topics one instance may subscribe to (a subscribe past it traps).
    client_max_chars:       characters of client messages queued to one instance that it has not
                            read; a send past it is refused (host.errors.LimitError) and the
                            queued messages stay.
    """

    store_max_keys: int = 10_000
    store_max_chars: int = 8 << 20
    topic_max_messages: int = 1024
    topic_max_chars: int = 4 << 20
    max_subscriptions: int = 64
    client_max_chars: int = 4 << 20

    def __post_init__(self) -> None:
        for name in ("store_max_keys", "store_max_chars", "topic_max_messages",
                     "topic_max_chars", "max_subscriptions", "client_max_chars"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"MessageLimits.{name} must be a positive int, got {value!r}")


@dataclass(frozen=True)
class RuntimeConfig:
    """How the runtime is set up.

    cache_dir:     where compiled components are kept (keyed by sha256 + wasmtime + engine config).
    scheduler:     the batching policy; None = host.scheduling.types.SchedulerPolicy() (adaptive).
    limits:        the default InstanceLimits of a launch.
    messages:      the MessageLimits of the runtime's message hub.
    epoch_tick_ms: how often the epoch ticker advances the Wasmtime epoch while some guest may
                   run Wasm (none while every instance waits in a host call, or none runs:
                   host/sandbox/guest_activity.py).
    kv_shares:     (tenant, pages) guaranteed to each named tenant (host/kv/contention.py); the
                   tenants not named split what is left equally. Their sum must fit the pool
                   (checked by the Runtime, which knows the pool).
    finished_log_chars: characters of log kept for each ended instance (its newest lines).
    max_finished_chars: characters kept for ended instances in all (their logs and results);
                   past it, or past 4,096 instances, the oldest are forgotten.
    compile_timeout_s: longest the compilation of one component may take (in a child process,
                   killed at the limit; the program is refused naming it).
    compile_memory_mb: address space of that child process.
    count_linear_memory: the host creates every linear memory and charges it to its instance
                   (host/sandbox/linear_memory.py): memory_mb is then the exact total of its
                   memories and an instance that hit it is told so whatever the guest reports
                   (the default: Wasmtime says nothing of a refused growth, and a CPython guest
                   then fails with an unrelated error). A componentize-py instance's heap
                   image is then mapped copy-on-write from one sealed file per program
                   (host/sandbox/image_files.py), as Wasmtime's own images are: an instance
                   holds only the pages it wrote. False: Wasmtime's memories,
                   memory_mb split evenly over max_memories, the limit named when the guest's
                   own report shows it (MemoryError, an allocation failure).
    memory_pool_mb: with count_linear_memory, the ended instances' linear memories kept for
                   the next instances, at most this many MiB in all (each at most 64 MiB;
                   host/sandbox/memory_pool.py): a new instance then gets pages already
                   mapped, zeroed by the host, instead of fresh ones. 0 = off.
    memory_pool_idle_s: how long a pooled memory is kept unused before it is unmapped (0 <
                   it <= 86,400). Fresh pages can cost far more than their zeroing (on a VM
                   with a balloon driver most of all), so a pool that empties between bursts
                   costs each burst that.
    start_slots:   instances that start at once (from their Store to their guest's first host
                   wait; host/sandbox/start_gate.py); a start past them waits for one, or for a
                   start that has held its slot 50 ms. None = twice the cores this process may
                   run on; 0 = no gate. Instances launched together, many more than the
                   cores, reach their first forward sooner through the gate.
    freeze_heap:   at the end of the Runtime's construction, collect garbage, then move every
                   Python object alive (the model's, the engine's, the runtime's) out of the
                   garbage collector's reach (gc.freeze, process-wide): a full collection then
                   walks only what was made since, not the model's and engine's objects too
                   (each full collection pauses every host thread). For a
                   process built around one Runtime (`pie serve`, `pie run`); objects alive then
                   that later become cyclic garbage are never collected.
    max_spare_instances: instances instantiated ahead of their launch (Runtime.keep_spares) the
                   runtime holds at most, all programs together; each holds its Store and linear
                   memory (a componentize-py guest ~13 MiB), the host's until a launch takes it
                   (host/sandbox/spare_instances.py).
    swap_mb:       host memory, MiB, that suspended instances' KV pages may occupy, all tenants
                   together; each tenant at most its share of the pool's fraction of it
                   (host/kv/swap.py). A victim whose pages do not fit is terminated ("swap space
                   full"). 0 = no suspension: the contention policy terminates, as before.
    suspend_deadline_s: longest an instance may stay suspended waiting for pages; past it, it
                   is terminated naming the deadline.
    restore:       how a suspended instance's pages come back: "swap" (always copied), "auto"
                   (swapped, or recomputed by a prefill when every page can be and that is
                   cheaper on this device, measured with a few passes on the engine when the
                   runtime starts: host/restore_costs.py; `pie serve`'s default), "recompute"
                   (recomputed whenever every page can be).
    """

    cache_dir: Path = field(default_factory=default_cache_dir)
    scheduler: "SchedulerPolicy | None" = None
    limits: InstanceLimits = field(default_factory=InstanceLimits)
    messages: MessageLimits = field(default_factory=MessageLimits)
    epoch_tick_ms: int = 10
    kv_shares: tuple[tuple[str, int], ...] = ()
    finished_log_chars: int = 16_384
    max_finished_chars: int = 64 << 20
    compile_timeout_s: float = 300.0
    compile_memory_mb: int = 4096
    count_linear_memory: bool = True
    memory_pool_mb: int = 1024
    memory_pool_idle_s: float = 600.0
    start_slots: int | None = None
    freeze_heap: bool = False
    max_spare_instances: int = 64
    swap_mb: int = 4096
    suspend_deadline_s: float = 600.0
    restore: str = "swap"
    model_name: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "kv_shares", tuple((str(t), int(n)) for t, n in self.kv_shares))
        names = [tenant for tenant, _ in self.kv_shares]
        if len(set(names)) != len(names):
            raise ValueError(f"RuntimeConfig.kv_shares: a tenant is named twice in {names}")
        for tenant, num_pages in self.kv_shares:
            if num_pages < 0:
                raise ValueError(f"RuntimeConfig.kv_shares: tenant {tenant!r} share must be "
                                 f">= 0 pages, got {num_pages}")
        object.__setattr__(self, "cache_dir", Path(self.cache_dir))
        if not 1 <= self.epoch_tick_ms <= 1000:
            raise ValueError(f"RuntimeConfig.epoch_tick_ms must be in 1..1000, "
                             f"got {self.epoch_tick_ms}")
        if not self.compile_timeout_s > 0:
            raise ValueError(f"RuntimeConfig.compile_timeout_s must be > 0, "
                             f"got {self.compile_timeout_s}")
        if not isinstance(self.compile_memory_mb, int) or self.compile_memory_mb < 256:
            raise ValueError(f"RuntimeConfig.compile_memory_mb must be an int >= 256, "
                             f"got {self.compile_memory_mb!r}")
        if not isinstance(self.messages, MessageLimits):
            raise ValueError(f"RuntimeConfig.messages must be MessageLimits, got {self.messages!r}")
        for name in ("finished_log_chars", "max_finished_chars"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"RuntimeConfig.{name} must be an int >= 0, got {value!r}")
        if not isinstance(self.memory_pool_mb, int) or not 0 <= self.memory_pool_mb <= 1 << 20:
            raise ValueError(f"RuntimeConfig.memory_pool_mb must be an int in 0..{1 << 20}, "
                             f"got {self.memory_pool_mb!r}")
        if self.model_name is not None and not (isinstance(self.model_name, str)
                                                and self.model_name.strip()):
            raise ValueError(f"RuntimeConfig.model_name must be a non-empty string or None, "
                             f"got {self.model_name!r}")
        if not isinstance(self.swap_mb, int) or not 0 <= self.swap_mb <= 1 << 24:
            raise ValueError(f"RuntimeConfig.swap_mb must be an int in 0..{1 << 24}, "
                             f"got {self.swap_mb!r}")
        if not 0 < self.suspend_deadline_s <= 86_400:
            raise ValueError(f"RuntimeConfig.suspend_deadline_s must be in (0, 86400], "
                             f"got {self.suspend_deadline_s!r}")
        if self.restore not in ("auto", "swap", "recompute"):
            raise ValueError(f"RuntimeConfig.restore must be 'auto', 'swap' or 'recompute', "
                             f"got {self.restore!r}")
        if not isinstance(self.max_spare_instances, int) \
                or not 0 <= self.max_spare_instances <= 4096:
            raise ValueError(f"RuntimeConfig.max_spare_instances must be an int in 0..4096, "
                             f"got {self.max_spare_instances!r}")
        if self.start_slots is not None and (not isinstance(self.start_slots, int)
                                             or not 0 <= self.start_slots <= 4096):
            raise ValueError(f"RuntimeConfig.start_slots must be None or an int in 0..4096, "
                             f"got {self.start_slots!r}")
        if not 0 < self.memory_pool_idle_s <= 86_400:
            raise ValueError(f"RuntimeConfig.memory_pool_idle_s must be in (0, 86400], "
                             f"got {self.memory_pool_idle_s!r}")
        if not isinstance(self.limits, InstanceLimits):
            raise ValueError(f"RuntimeConfig.limits must be InstanceLimits, got {self.limits!r}")
