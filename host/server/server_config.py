"""The server's TOML configuration: frozen dataclasses, validated once at load with clear errors.

A minimal `pie.toml`:

    [server]
    port = 8080

    [[tenants]]
    name = "alice"
    token = "secret-a"

Every section is optional except at least one tenant. Unknown keys, wrong types and out-of-range
values are rejected with a `ConfigError` naming the file and the field, e.g.
"pie.toml: tenants[1].max_instances must be positive, got 0".
"""
from __future__ import annotations

import dataclasses
import os
import ssl
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import cattrs
from cattrs.v import format_exception, transform_error

from host.runtime_config import OutboundLimits, RuntimeConfig

__all__ = ["ConfigError", "ServerSection", "ModelSection", "EngineSection", "SchedulerSection",
           "LimitsSection", "TenantConfig", "ServerConfig", "ClusterSection", "load_config",
           "parse_config"]

NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.")


class ConfigError(ValueError):
    """The configuration file is unreadable or invalid; the message names the file and field."""


def _positive(section: str, **values: float) -> None:
    for name, value in values.items():
        if value <= 0:
            raise ValueError(f"{section}.{name} must be positive, got {value}")


def _check_ca_bundle(path: str) -> None:
    """ValueError naming server.outbound_ca_bundle when `path` holds no PEM CA certificate."""
    try:
        ssl.create_default_context(cafile=path)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"server.outbound_ca_bundle {path!r}: not a readable PEM bundle of CA "
                         f"certificates ({exc})") from None


@dataclass(frozen=True)
class ServerSection:
    """Where to listen, where to keep uploads, and the per-connection limits."""

    host: str = "127.0.0.1"
    port: int = 8080
    data_dir: str = ""                       # program store; "" -> $PIE_DATA_DIR or ~/.local/share/pie
    max_upload_bytes: int = 64 * 1024 * 1024  # one program
    max_chunk_bytes: int = 1024 * 1024        # one upload chunk (decoded)
    max_message_bytes: int = 4 * 1024 * 1024  # one websocket frame
    max_client_backlog_bytes: int = 16 * 1024 * 1024   # events waiting for one client
    max_tenant_upload_bytes: int = 256 * 1024 * 1024   # one tenant's uploads in progress
    shutdown_grace_s: float = 10.0            # running instances may finish within this
    openai: bool = True                       # serve /v1/* through the built-in inferlet
    warm_prefixes: bool = True                # sharing tenants' default chat prefix at start
    count_linear_memory: bool = True          # name memory_mb whenever an instance hits it
    memory_pool_mb: int = 1024                # ended instances' memories kept for reuse (0: none)
    memory_pool_idle_s: float = 600.0         # a pooled memory unused this long is unmapped
    start_slots: int | None = None            # instances starting at once; unset: 2 x cores
    spare_builtins: int = 8                   # built-in instances instantiated ahead (0: none)
    swap_mb: int = 4096                       # host memory for suspended instances' KV pages
    suspend_deadline_s: float = 600.0         # a suspension longer than this ends the instance
    restore: str = "auto"                     # suspended pages back: auto, swap, recompute
    outbound_ca_bundle: str = ""              # PEM CAs instances' HTTPS trusts besides the default

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"server.port must be in 0..65535, got {self.port}")
        _positive("server", max_upload_bytes=self.max_upload_bytes,
                  max_chunk_bytes=self.max_chunk_bytes, max_message_bytes=self.max_message_bytes,
                  max_client_backlog_bytes=self.max_client_backlog_bytes,
                  max_tenant_upload_bytes=self.max_tenant_upload_bytes)
        if self.shutdown_grace_s < 0:
            raise ValueError(f"server.shutdown_grace_s must be >= 0, got {self.shutdown_grace_s}")
        if not 0 <= self.memory_pool_mb <= 1 << 20:
            raise ValueError(f"server.memory_pool_mb must be in 0..{1 << 20}, "
                             f"got {self.memory_pool_mb}")
        if not 0 < self.memory_pool_idle_s <= 86_400:
            raise ValueError(f"server.memory_pool_idle_s must be in (0, 86400], "
                             f"got {self.memory_pool_idle_s}")
        max_spares = RuntimeConfig.max_spare_instances    # the runtime's bound on them
        if not isinstance(self.spare_builtins, int) \
                or not 0 <= self.spare_builtins <= max_spares:
            raise ValueError(f"server.spare_builtins must be an int in 0..{max_spares}, "
                             f"got {self.spare_builtins!r}")
        if not isinstance(self.swap_mb, int) or not 0 <= self.swap_mb <= 1 << 24:
            raise ValueError(f"server.swap_mb must be an int in 0..{1 << 24}, "
                             f"got {self.swap_mb!r}")
        if not 0 < self.suspend_deadline_s <= 86_400:
            raise ValueError(f"server.suspend_deadline_s must be in (0, 86400], "
                             f"got {self.suspend_deadline_s}")
        if self.restore not in ("auto", "swap", "recompute"):
            raise ValueError(f"server.restore must be 'auto', 'swap' or 'recompute', "
                             f"got {self.restore!r}")
        if self.start_slots is not None and not 0 <= self.start_slots <= 4096:
            raise ValueError(f"server.start_slots must be in 0..4096, got {self.start_slots}")
        if self.outbound_ca_bundle:
            _check_ca_bundle(self.outbound_ca_bundle)

    def resolved_data_dir(self) -> Path:
        """The program store directory (created by the store, not here)."""
        if self.data_dir:
            return Path(self.data_dir).expanduser()
        env = os.environ.get("PIE_DATA_DIR")
        return Path(env).expanduser() if env else Path.home() / ".local" / "share" / "pie"


@dataclass(frozen=True)
class ModelSection:
    """Which model to serve. `path` "" = the embedded default model (SmolLM2-135M-Instruct)."""

    path: str = ""


@dataclass(frozen=True)
class EngineSection:
    """Engine memory and batch size (mirrors engine.engine_config.EngineConfig)."""

    page_size: int = 16
    kv_memory_mb: int = 512
    num_pages: int | None = None
    max_batch_tokens: int = 4096
    device: str = "auto"    # cpu | cuda | auto (cuda when available)
    dtype: str = "auto"
    kv_dtype: str = "auto"  # auto | float32 | float16 (CPU)
    max_pass_tokens: int | None = None   # longer batches: consecutive passes (None: 256 on a CPU)
    act8: bool = True                    # GGUF blocks: 8-bit activation blocks where faster
    cuda_graphs: bool = True             # CUDA: replay pure decode steps from captured graphs
    cuda_graph_batch_sizes: tuple[int, ...] | None = None   # padded sizes captured (None: the
                                                           # engine's ladder, 1 .. 256)

    def __post_init__(self) -> None:
        self.to_engine_config()  # EngineConfig validates; errors are prefixed "engine."

    def engine_fields(self) -> dict[str, Any]:
        """The EngineConfig keyword arguments this section sets (an unset ladder: the engine's)."""
        return {name: value for name, value in dataclasses.asdict(self).items()
                if not (name == "cuda_graph_batch_sizes" and value is None)}

    def to_engine_config(self) -> Any:
        """The engine's own frozen config (ValueError on invalid values, prefixed "engine.")."""
        from engine.engine_config import EngineConfig
        try:
            return EngineConfig(**self.engine_fields())
        except ValueError as exc:
            raise ValueError(f"engine.{exc}") from None


@dataclass(frozen=True)
class SchedulerSection:
    """Batching policy: "adaptive" (fire when the engine is idle; right after a batch, hold the
    next one until the instances it answered have resubmitted, at most max_hold_ms) or "k-or-t"."""

    policy: str = "adaptive"
    k: int = 8                 # k-or-t: fire at k pending passes ...
    t_ms: float = 5.0          # ... or after t milliseconds
    max_hold_ms: float = 10.0  # adaptive: longest hold after a batch (0 = fire at once)
    start_hold_ms: float | None = None  # adaptive: first passes wait for instances starting,
                                        # at most this long; unset: 500 on a CPU, 0 on a GPU
    max_tokens_per_owner: int = 512   # one instance's input tokens per batch while others wait
    overlap: bool | None = None       # overlapped batches; unset: on for a GPU engine, off on a CPU
    chain_steps: int | None = None    # engine steps a batch of host loops runs before the host
                                      # resolves it; unset: 64 on a CPU, 1 with overlap

    def __post_init__(self) -> None:
        if self.policy not in ("adaptive", "k-or-t"):
            raise ValueError(f"scheduler.policy must be 'adaptive' or 'k-or-t', got {self.policy!r}")
        _positive("scheduler", k=self.k, t_ms=self.t_ms,
                  max_tokens_per_owner=self.max_tokens_per_owner)
        if self.max_hold_ms < 0:
            raise ValueError(f"scheduler.max_hold_ms must be >= 0, got {self.max_hold_ms}")
        if self.start_hold_ms is not None and not self.start_hold_ms >= 0:
            raise ValueError(f"scheduler.start_hold_ms must be >= 0, got {self.start_hold_ms}")
        if self.chain_steps is not None and (type(self.chain_steps) is not int
                                             or not 1 <= self.chain_steps <= 64):
            raise ValueError(f"scheduler.chain_steps must be an int in 1..64, "
                             f"got {self.chain_steps!r}")


@dataclass(frozen=True)
class LimitsSection:
    """Limits of every instance: memory, the longest compute without a host call, the
    longest wait in a receive (a tenant's own max_receive_wait_s overrides it), and its child
    inferlets (InstanceLimits.max_spawn_depth / max_children / max_spawns)."""

    memory_mb: int = 256
    max_idle_s: float = 10.0
    max_receive_wait_s: float = 300.0
    max_spawn_depth: int = 4
    max_children: int = 16
    max_spawns: int = 256

    def __post_init__(self) -> None:
        _positive("limits", memory_mb=self.memory_mb, max_idle_s=self.max_idle_s,
                  max_receive_wait_s=self.max_receive_wait_s)
        for name in ("max_spawn_depth", "max_children", "max_spawns"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"limits.{name} must be an int >= 0, got {value!r}")


@dataclass(frozen=True)
class ClusterSection:
    """`pie serve --ray` (docs/server.md, "Scale out"): `replicas` engine replicas as Ray actors,
    each with `num_cpus` / `num_gpus` Ray resources and `torch_threads` torch threads, restarted
    by Ray up to `max_restarts` times; `address`: the Ray cluster to join ("" starts one on
    this machine, "auto" finds the running one). Off unless `enabled` (or `--ray`)."""

    enabled: bool = False
    address: str = ""
    replicas: int = 2
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    torch_threads: int = 1
    max_restarts: int = 4

    def __post_init__(self) -> None:
        if not 1 <= self.replicas <= 1024:
            raise ValueError(f"cluster.replicas must be 1..1024, got {self.replicas}")
        if not (self.num_cpus >= 0 and self.num_gpus >= 0):
            raise ValueError(f"cluster.num_cpus and cluster.num_gpus must be >= 0, got "
                             f"{self.num_cpus} and {self.num_gpus}")
        _positive("cluster", torch_threads=self.torch_threads)
        if self.max_restarts < -1:
            raise ValueError(f"cluster.max_restarts must be >= -1 (-1: forever), "
                             f"got {self.max_restarts}")
        if len(self.address) > 512:
            raise ValueError("cluster.address must be at most 512 characters")


DEFAULT_PREFIX_CACHE_PAGES = 32   # TenantConfig.prefix_cache_pages when unset


@dataclass(frozen=True)
class TenantConfig:
    """One tenant: its name (a namespace), its API token and its quotas."""

    name: str
    token: str = ""
    token_env: str = ""        # read the token from this environment variable instead
    max_instances: int = 16    # concurrent instances
    max_kv_pages: int = 4096   # KV pages held by all its instances together
    max_program_bytes: int = 256 * 1024 * 1024  # stored programs, all together
    max_adapter_bytes: int = 256 * 1024 * 1024  # stored LoRA adapters' files, all together
    kv_share_pages: int | None = None  # guaranteed KV pages; None = an equal part of the rest
    # KV pages the built-in's shared chat prefixes may hold (0: off; None: the default below)
    prefix_cache_pages: int | None = None
    max_receive_wait_s: float | None = None   # its instances' wait in a receive (None: [limits])
    # instances of its latest launched upload instantiated ahead, made while nothing runs and
    # taken by its launches and their children of that program (0: none)
    spare_instances: int = 0
    # what its instances may reach outside the host ([tenants.outbound]: allow_hosts, limits,
    # [[tenants.outbound.mcp_servers]]); nothing by default
    outbound: OutboundLimits = field(default_factory=OutboundLimits)

    def __post_init__(self) -> None:
        if self.max_receive_wait_s is not None and not self.max_receive_wait_s > 0:
            raise ValueError(f"tenant {self.name!r}: max_receive_wait_s must be positive, "
                             f"got {self.max_receive_wait_s}")
        if self.kv_share_pages is not None and self.kv_share_pages < 0:
            raise ValueError(f"tenant {self.name!r}: kv_share_pages must be >= 0, "
                             f"got {self.kv_share_pages}")
        cache_pages = self.prefix_cache_pages
        if cache_pages is not None and not 0 <= cache_pages <= self.max_kv_pages:
            raise ValueError(f"tenant {self.name!r}: prefix_cache_pages must be in 0.."
                             f"{self.max_kv_pages} (max_kv_pages), got {cache_pages}")
        max_spares = RuntimeConfig.max_spare_instances
        if not isinstance(self.spare_instances, int) \
                or not 0 <= self.spare_instances <= max_spares:
            raise ValueError(f"tenant {self.name!r}: spare_instances must be an int in "
                             f"0..{max_spares}, got {self.spare_instances!r}")
        if not self.name or not set(self.name) <= NAME_CHARS:
            raise ValueError(f"tenants: name must be non-empty letters, digits, '_-.', "
                             f"got {self.name!r}")
        if bool(self.token) == bool(self.token_env):
            raise ValueError(f"tenant {self.name!r}: give exactly one of token, token_env")
        _positive(f"tenant {self.name!r}", max_instances=self.max_instances,
                  max_kv_pages=self.max_kv_pages, max_program_bytes=self.max_program_bytes,
                  max_adapter_bytes=self.max_adapter_bytes)

    @property
    def resolved_prefix_cache_pages(self) -> int:
        """`prefix_cache_pages`, or by default 32 pages but at most 1/16 of max_kv_pages."""
        if self.prefix_cache_pages is not None:
            return self.prefix_cache_pages
        return min(DEFAULT_PREFIX_CACHE_PAGES, self.max_kv_pages // 16)

    def resolved_token(self) -> str:
        """The token, read from the environment when `token_env` is set."""
        if self.token:
            return self.token
        value = os.environ.get(self.token_env, "")
        if not value:
            raise ConfigError(f"tenant {self.name!r}: environment variable {self.token_env} "
                              f"is unset or empty")
        return value


@dataclass(frozen=True)
class ServerConfig:
    """The whole configuration of `pie serve`."""

    server: ServerSection = field(default_factory=ServerSection)
    model: ModelSection = field(default_factory=ModelSection)
    engine: EngineSection = field(default_factory=EngineSection)
    scheduler: SchedulerSection = field(default_factory=SchedulerSection)
    limits: LimitsSection = field(default_factory=LimitsSection)
    tenants: tuple[TenantConfig, ...] = ()
    cluster: ClusterSection = field(default_factory=ClusterSection)

    def __post_init__(self) -> None:
        if not self.tenants:
            raise ValueError("tenants: at least one [[tenants]] entry is needed")
        names = [t.name for t in self.tenants]
        if len(set(names)) != len(names):
            raise ValueError(f"tenants: duplicate tenant name in {names}")
        tokens = [t.token for t in self.tenants if t.token]
        if len(set(tokens)) != len(tokens):
            raise ValueError("tenants: two tenants share one token")
        num_spares = self.server.spare_builtins + sum(t.spare_instances for t in self.tenants)
        if num_spares > RuntimeConfig.max_spare_instances:
            raise ValueError(f"server.spare_builtins and the tenants' spare_instances add up to "
                             f"{num_spares}, past the {RuntimeConfig.max_spare_instances} spare "
                             f"instances a runtime keeps")


def _strict_converter() -> cattrs.Converter:
    """A converter that refuses type coercion ("3" is not an int, 1 is not a bool)."""
    converter = cattrs.Converter(forbid_extra_keys=True)

    def exact(kind: type, accepted: tuple[type, ...]):
        def hook(value: Any, _: type) -> Any:
            if isinstance(value, bool) and kind is not bool or not isinstance(value, accepted):
                raise TypeError(f"expected {kind.__name__}, got {type(value).__name__} {value!r}")
            return kind(value)
        return hook

    converter.register_structure_hook(int, exact(int, (int,)))
    converter.register_structure_hook(float, exact(float, (int, float)))
    converter.register_structure_hook(bool, exact(bool, (bool,)))
    converter.register_structure_hook(str, exact(str, (str,)))

    def string_tuple(value: Any, _: type) -> tuple[str, ...]:
        if not isinstance(value, (list, tuple)):
            raise TypeError(f"expected a list of strings, got {type(value).__name__} {value!r}")
        return tuple(converter.structure(item, str) for item in value)

    converter.register_structure_hook_func(lambda kind: kind == tuple[str, ...], string_tuple)
    return converter


def _format(exc: BaseException, type_: Any) -> str:
    if isinstance(exc, (ValueError, TypeError)) and not isinstance(exc, cattrs.BaseValidationError):
        return str(exc)
    return format_exception(exc, type_)


def parse_config(data: dict[str, Any], source: str = "pie.toml") -> ServerConfig:
    """Structure a parsed TOML document into a validated ServerConfig (ConfigError if invalid)."""
    try:
        return _strict_converter().structure(data, ServerConfig)
    except cattrs.BaseValidationError as exc:
        messages = transform_error(exc, path=source, format_exception=_format)
        raise ConfigError("; ".join(messages)) from None
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"{source}: {exc}") from None


def load_config(path: str | os.PathLike[str]) -> ServerConfig:
    """Read and validate a TOML config file (ConfigError naming the file and the field)."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML: {exc}") from None
    return parse_config(data, source=str(path))
