"""Building the server's parts from a ServerConfig: engine, runtime, upload store, tenants, service.

The runtime and engine are imported inside the functions that build them (they are heavy, and
`pie submit` imports the server package without them); `build_context` must run inside trio (the
service binds to the running loop). app.py imports this module, never the other way round.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import trio

from engine.loaders import served_model_name
from host.progress import progress
from host.server.metrics import RuntimeFigures, ServerMetrics
from host.server.server_config import ServerConfig
from host.server.service import PieService
from host.server.spawning import server_spawn_hooks
from host.server.tenants import TenantRegistry, resolve_kv_shares
from host.server.uploads import UploadStore

__all__ = ["ServerContext", "load_engine_for", "build_runtime", "runtime_figures", "build_context",
           "model_info"]


@dataclass(frozen=True)
class ServerContext:
    """Everything the routes need (the mutable parts live in `service`, trio thread only)."""

    config: ServerConfig
    service: PieService
    tenants: TenantRegistry
    metrics: ServerMetrics
    openai: Any = None           # host.server.openai.OpenAIFrontend, when enabled

def load_engine_for(config: ServerConfig) -> Any:
    """Load the configured model (the embedded default when model.path is ""); on CUDA, warm its
    kernels (engine.warm_up, a "pie.engine" log line per step) before the server listens."""
    import logging
    from engine import load_default_engine, load_engine
    from engine.warm_up import needs_warm_up, warm_up

    shown = logging.getLogger("pie.serve").info       # `pie serve` shows it on stderr
    overrides = config.engine.engine_fields()         # EngineSection mirrors EngineConfig
    with progress("", f"loading {config.model.path or 'the default model'}", write=shown):
        if config.model.path:
            engine = load_engine(config.model.path, progress=False, **overrides)
        else:
            engine = load_default_engine(progress=False, **overrides)
    if needs_warm_up(engine):
        with progress("", "warming the engine's kernels", write=shown):
            warm_up(engine, logging.getLogger("pie.engine").info)
    return engine


def build_runtime(config: ServerConfig, engine: Any, model_name: str | None = None) -> Any:
    """A Runtime over `engine` with the configured batching policy and instance limits;
    `model_name`: the name inferlets see in model-info (None: the engine's)."""
    from host.runtime_config import InstanceLimits, RuntimeConfig
    from host.runtime import Runtime
    from host.scheduling.scheduler import SchedulerPolicy

    policy = SchedulerPolicy(kind=config.scheduler.policy, k=config.scheduler.k,
                             t_ms=config.scheduler.t_ms, max_hold_ms=config.scheduler.max_hold_ms,
                             max_batch_tokens=config.engine.max_batch_tokens,
                             max_tokens_per_owner=config.scheduler.max_tokens_per_owner,
                             overlap=config.scheduler.overlap,
                             start_hold_ms=config.scheduler.start_hold_ms,
                             chain_steps=config.scheduler.chain_steps)
    limits = InstanceLimits(memory_mb=config.limits.memory_mb, max_idle_s=config.limits.max_idle_s,
                            max_receive_wait_s=config.limits.max_receive_wait_s,
                            max_spawn_depth=config.limits.max_spawn_depth,
                            max_children=config.limits.max_children,
                            max_spawns=config.limits.max_spawns)
    shares = resolve_kv_shares(config.tenants, engine.num_pages)
    runtime = Runtime(engine, RuntimeConfig(scheduler=policy, limits=limits, kv_shares=shares,
                                            count_linear_memory=config.server.count_linear_memory,
                                            memory_pool_mb=config.server.memory_pool_mb,
                                            memory_pool_idle_s=config.server.memory_pool_idle_s,
                                            start_slots=config.server.start_slots,
                                            swap_mb=config.server.swap_mb,
                                            model_name=model_name,
                                            suspend_deadline_s=config.server.suspend_deadline_s,
                                            restore=config.server.restore,
                                            freeze_heap=True))
    runtime.outbound.set_ca_bundle(config.server.outbound_ca_bundle or None)
    return runtime


def runtime_figures(runtime: Any) -> RuntimeFigures:
    """What /metrics shows, read from `runtime.statistics()`."""
    stats = runtime.statistics()
    pool, scheduler, engine = stats.pages, stats.scheduler, stats.engine
    return RuntimeFigures(
        num_running_instances=stats.num_running,
        num_pages_used=pool.num_used, num_pages_free=pool.num_free,
        num_pages_exported=runtime.exports.num_pages(),
        queue_depth=scheduler.num_pending, num_batches=scheduler.num_batches,
        batch_size_counts=dict(scheduler.batch_size_histogram),
        num_output_tokens=engine.num_output_tokens, num_input_tokens=engine.num_input_tokens,
        num_spare_instances=runtime.spares.num_ready,
        suspensions=stats.suspensions,
        outbound=runtime.outbound.stats.snapshot(), spawns=runtime.spawns.stats())


def model_info(config: ServerConfig, engine: Any, default_model: bool = True) -> dict[str, Any]:
    """The served model: "name" its user-facing name (`served_model_name`; `default_model`:
    the engine was loaded from the embedded default, as an empty model.path says), "path" the
    model file ("" = the embedded default), "metadata_name" the name the model file gives
    itself (GGUF general.name), accepted by the OpenAI API as an alias."""
    return {"name": served_model_name(config.model.path, engine.model_name, default_model),
            "metadata_name": engine.model_name, "page_size": engine.page_size,
            "num_pages": engine.num_pages, "vocab_size": engine.tokenizer.vocab_size,
            "max_batch_tokens": config.engine.max_batch_tokens, "path": config.model.path,
            "max_position": engine.model_config.max_position}


def _tenant_adapters(engine: Any, data_dir: Path) -> Any:
    """The tenants' adapters under data_dir/adapters, those stored before registered with the
    engine; None for an engine without adapters (a test's fake)."""
    store = getattr(engine, "adapters", None)
    if store is None:
        return None
    from host.server.adapters import TenantAdapters
    adapters = TenantAdapters(Path(data_dir) / "adapters", store, engine.model_config)
    adapters.restore()
    return adapters


async def build_context(config: ServerConfig, engine: Any = None) -> ServerContext:
    """Everything `build_app` needs, started in the running trio loop."""
    loaded_here = engine is None
    data_dir = config.server.resolved_data_dir()
    if config.cluster.enabled:        # --ray: a ClusterFront (cluster_setup.py); engine: a factory
        from host.server.cluster_setup import build_front, cluster_adapters, start_ray
        started_ray = start_ray(config)   # on this thread: Ray's processes die with it
        runtime, model, figures = await trio.to_thread.run_sync(build_front, config, engine,
                                                                started_ray)
        adapters = await trio.to_thread.run_sync(cluster_adapters, runtime, data_dir)
    else:
        if engine is None:
            engine = await trio.to_thread.run_sync(load_engine_for, config)
        model = model_info(config, engine, default_model=loaded_here)
        runtime = await trio.to_thread.run_sync(build_runtime, config, engine, model["name"])
        adapters = await trio.to_thread.run_sync(_tenant_adapters, engine, data_dir)
        figures = partial(runtime_figures, runtime)
    store = UploadStore(data_dir)
    tenants = TenantRegistry(config.tenants)
    metrics = ServerMetrics(figures)
    if config.cluster.enabled:        # each replica's figures and the front's on /metrics
        from host.server.cluster_setup import register_cluster_metrics
        register_cluster_metrics(metrics.registry, runtime)
    service = PieService(runtime, store, metrics, limits=runtime.config.limits,
                         max_upload_bytes=config.server.max_upload_bytes,
                         model=model,
                         max_backlog_bytes=config.server.max_client_backlog_bytes,
                         max_tenant_upload_bytes=config.server.max_tenant_upload_bytes,
                         adapters=adapters)
    service.start()
    if hasattr(runtime, "set_spawn_hooks"):        # children.spawn: the tenant's uploads, quotas
        runtime.set_spawn_hooks(server_spawn_hooks(service, tenants,
                                                   trio.lowlevel.current_trio_token()))
    openai = None
    if config.server.openai:
        from host.server.openai import OpenAIFrontend
        openai = await OpenAIFrontend.create(service, tenants, data_dir,
                                             warm_prefixes=config.server.warm_prefixes,
                                             spare_builtins=config.server.spare_builtins)
    return ServerContext(config, service, tenants, metrics, openai)
