"""`pie serve --ray`: the server's runtime is a ClusterFront over engine replicas on Ray.

`build_front` joins (or starts) Ray, starts the cluster's Directory (the configured tenants'
quotas, across the cluster) and `cluster.replicas` EngineReplica actors, each building the
configured engine and the Runtime `build_runtime` would build in one process, and returns the
front with the served model's description and the /metrics figures summed over the replicas.
The front holds the served engine's description and tokenizer (from a replica), so the OpenAI
API counts prompts and checks contexts as in one process; `cluster_adapters` the tenants'
adapters over every replica. Imported by setup.py only when the mode is on (Ray is an
optional dependency).
"""
from __future__ import annotations

import dataclasses
import logging
import os
import statistics
from functools import partial
from types import SimpleNamespace
from typing import Any, Callable

import ray
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from host.cluster.cluster import ClusterConfig, init_ray, shutdown_ray, start_cluster, stop_cluster
from host.cluster.directory import TenantQuota
from host.cluster.front import ClusterFront
from host.cluster.replica import ReplicaDescription, ReplicaSpec
from host.runtime_config import RuntimeConfig
from host.server.metrics import RuntimeFigures
from host.server.server_config import ServerConfig
from host.server.setup import build_runtime, load_engine_for, model_info

__all__ = ["start_ray", "build_front", "cluster_adapters", "cluster_figures",
           "register_cluster_metrics"]

_log = logging.getLogger("pie.serve")


def _replica_runtime(config: ServerConfig, default_model: bool, engine: Any) -> Any:
    """In a replica's process: the Runtime one-process `pie serve` would build over `engine`."""
    return build_runtime(config, engine, model_info(config, engine, default_model)["name"])


def start_ray(config: ServerConfig) -> bool:
    """Join the configured Ray cluster, or start one here (cluster.address ""); True when this
    process started or joined it (and shuts it down at close), False when Ray was up already.
    Call it on a thread that lives as long as the server (the main one): the processes Ray
    starts here end with the thread that started them (their parent-death signal)."""
    if ray.is_initialized():
        return False
    section = config.cluster
    init_ray(address=section.address or None, include_dashboard=False, log_to_driver=False,
             namespace="pie",
             runtime_env={"env_vars": {"OMP_NUM_THREADS": str(section.torch_threads)}})
    return True


def build_front(config: ServerConfig, engine_factory: Callable[[], Any] | None = None,
                started_ray: bool = False
                ) -> tuple[ClusterFront, dict[str, Any], Callable[[], RuntimeFigures]]:
    """(the front, the served model as `model_info` describes it, the /metrics reader), over
    a Ray already up (`start_ray`; `started_ray`: what it answered). `engine_factory`: what
    each replica builds its engine with (None: the configured model)."""
    section = config.cluster
    default_model = engine_factory is None and not config.model.path
    factory = engine_factory or partial(load_engine_for, config)
    # on a cluster of its own (address ""), the actors end with this process; on a shared one
    # they are detached and named, so every front given that address serves the same replicas
    cluster = ClusterConfig(num_replicas=section.replicas, num_cpus=section.num_cpus,
                            num_gpus=section.num_gpus, max_restarts=section.max_restarts,
                            detached=bool(section.address),
                            name_prefix="pie" if section.address else f"pie{os.getpid()}")
    quotas = tuple(TenantQuota(t.name, t.max_instances, t.max_kv_pages, t.max_program_bytes)
                   for t in config.tenants)
    make_runtime = partial(_replica_runtime, config, default_model)
    handles = start_cluster(cluster, lambda rid: ReplicaSpec(
        rid, factory, make_runtime=make_runtime, torch_threads=section.torch_threads), quotas)
    first = next(iter(handles.replicas.values()))
    described: ReplicaDescription = ray.get(first.describe.remote())
    engine_view = SimpleNamespace(
        model_name=described.model_name, page_size=described.page_size,
        num_pages=described.num_pages, tokenizer=ray.get(first.tokenizer.remote()),
        model_config=SimpleNamespace(max_position=described.max_position))
    front = ClusterFront(handles.directory, handles.replicas,
                         config=RuntimeConfig(limits=described.limits), engine=engine_view,
                         on_close=partial(_stop, handles, started_ray, cluster.detached))
    model = model_info(config, engine_view, default_model)
    _log.info("serving on %d Ray replicas (%s)", section.replicas,
              section.address or "a local Ray started here")
    return front, model, partial(cluster_figures, front)


def cluster_adapters(front: ClusterFront, data_dir: Any) -> Any:
    """The tenants' adapters (host.server.adapters.TenantAdapters under data_dir/adapters) over
    every replica's engine, those stored before registered again; None when the replicas'
    engine serves no adapters."""
    from pathlib import Path

    from host.cluster.adapters import ClusterAdapterStore
    from host.server.adapters import TenantAdapters
    replica_id, _ = front.live_replicas()[0]
    if not front.call_replica(replica_id, "has_adapters"):
        return None
    model_config = front.call_replica(replica_id, "model_config")
    adapters = TenantAdapters(Path(data_dir) / "adapters", ClusterAdapterStore(front),
                              model_config)
    adapters.restore()
    return adapters


def _stop(handles: Any, started_ray: bool, shared: bool) -> None:
    """The server closed: stop the cluster's actors unless they are shared with other fronts
    (detached, on a Ray cluster given by address), and Ray when this process started it."""
    if not shared:
        stop_cluster(handles)
    if started_ray:
        shutdown_ray()


def cluster_figures(front: ClusterFront) -> RuntimeFigures:
    """What /metrics shows in --ray mode: the live replicas' figures summed."""
    figures = front.replica_figures()
    histogram: dict[int, int] = {}
    for f in figures:
        for size, count in dict(f.stats.scheduler.batch_size_histogram).items():
            histogram[size] = histogram.get(size, 0) + count
    suspensions = None
    if figures:
        first = figures[0].stats.suspensions
        suspensions = dataclasses.replace(first, **{
            field.name: sum(getattr(f.stats.suspensions, field.name) for f in figures)
            for field in dataclasses.fields(first)
            if isinstance(getattr(first, field.name), (int, float))})
    return RuntimeFigures(
        num_running_instances=sum(f.stats.num_running for f in figures),
        num_pages_used=sum(f.stats.pages.num_used for f in figures),
        num_pages_free=sum(f.stats.pages.num_free for f in figures),
        num_pages_exported=sum(f.num_pages_exported for f in figures),
        queue_depth=sum(f.stats.scheduler.num_pending for f in figures),
        num_batches=sum(f.stats.scheduler.num_batches for f in figures),
        batch_size_counts=histogram,
        num_output_tokens=sum(f.stats.engine.num_output_tokens for f in figures),
        num_input_tokens=sum(f.stats.engine.num_input_tokens for f in figures),
        num_spare_instances=sum(f.num_spare_instances for f in figures),
        suspensions=suspensions)


def register_cluster_metrics(registry: Any, front: ClusterFront) -> None:
    """Add to /metrics each live replica's own figures (label `replica`) and the front's:
    placements by rule, instances and replicas lost, exports copied across, and the median
    time an event takes from its replica to the front (newest events)."""
    registry.register(_ClusterCollector(front))


class _ClusterCollector:
    def __init__(self, front: ClusterFront) -> None:
        self._front = front

    def describe(self) -> list:
        return []

    def collect(self) -> Any:
        yield from self._replicas()
        stats = self._front.statistics()
        placements = CounterMetricFamily("pie_front_placements", "Launches placed, by rule",
                                         labels=["rule"])
        for rule, count in sorted(stats.placements.items()):
            placements.add_metric([rule], count)
        yield placements
        for name, documentation, value in (
                ("pie_front_lost_instances", "Instances ended with a lost replica",
                 stats.num_lost_instances),
                ("pie_front_replicas_lost", "Replica lives lost", stats.num_replicas_lost),
                ("pie_front_exports_copied", "Exports copied to the replica of an import",
                 stats.num_import_mirrored)):
            family = CounterMetricFamily(name, documentation)
            family.add_metric([], value)
            yield family
        latencies = stats.event_latencies_s[-4096:]
        yield GaugeMetricFamily("pie_front_event_latency_seconds",
                                "Median time from an event's emission on its replica to the "
                                "front (newest events)",
                                value=statistics.median(latencies) if latencies else 0.0)

    def _replicas(self) -> Any:
        figures = self._front.replica_figures()
        families = {name: GaugeMetricFamily(name, documentation, labels=["replica"])
                    for name, documentation in (
                        ("pie_replica_epoch", "The replica's life (restarts + 1)"),
                        ("pie_replica_instances_running", "Instances running on the replica"),
                        ("pie_replica_kv_pages_used", "KV pages in use on the replica"),
                        ("pie_replica_kv_pages_free", "KV pages free on the replica"),
                        ("pie_replica_queue_depth", "Passes waiting for a batch"),
                        ("pie_replica_generated_tokens", "Tokens generated by the replica"))}
        for f in figures:
            for name, value in (("pie_replica_epoch", f.epoch),
                                ("pie_replica_instances_running", f.stats.num_running),
                                ("pie_replica_kv_pages_used", f.stats.pages.num_used),
                                ("pie_replica_kv_pages_free", f.stats.pages.num_free),
                                ("pie_replica_queue_depth", f.stats.scheduler.num_pending),
                                ("pie_replica_generated_tokens",
                                 f.stats.engine.num_output_tokens)):
                families[name].add_metric([f.replica_id], value)
        yield from families.values()
