"""Prometheus metrics of the server (prometheus-client, one registry per server, no globals).

Counted by the server as events pass (trio thread): instances launched, instance events by kind,
traps by cause. Read from the runtime at scrape time (`RuntimeFigures`): running instances, KV
pages used/free, scheduler queue depth, batch sizes, tokens generated; tokens/s is the rate over
the last samples taken by `TokenRate.sample()` (called once a second by the server). Per tenant
(label `tenant`), also read at scrape time: instances' outgoing HTTP requests, bytes out and in,
refusals by cause (label `cause`), MCP calls and errors (host/outbound/stats.py), children
spawned and alive (host/spawns.py).
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

if TYPE_CHECKING:
    from host.runtime import SuspensionStats

__all__ = ["RuntimeFigures", "TokenRate", "ServerMetrics", "trap_cause", "CONTENT_TYPE"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TRAP_CAUSES = (  # (cause label, words that identify it in a trap message), first match wins
    ("replica_lost", ("replica lost:",)),       # host/cluster/front.py: its replica died
    ("suspend_deadline", ("suspend_deadline_s",)),
    ("swap_full", ("swap space full",)),
    ("out_of_pages", ("out of kv pages",)),
    ("quota", ("quota",)),
    ("memory", ("memory",)),
    ("idle_timeout", ("host call", "deadline", "interrupt", "epoch")),
    ("terminated", ("terminated", "cancelled")),
    ("bad_id", ("unknown", "forged", "double free", "not owned")),
)


def trap_cause(message: str) -> str:
    """A short label for a trap message, e.g. "out_of_pages", "idle_timeout", "other"."""
    lowered = message.lower()
    for cause, words in _TRAP_CAUSES:
        if any(word in lowered for word in words):
            return cause
    return "other"


@dataclass(frozen=True)
class RuntimeFigures:
    """What /metrics reads from the runtime at scrape time."""

    num_running_instances: int
    num_pages_used: int
    num_pages_free: int
    num_pages_exported: int             # held by exports (a part of num_pages_used)
    queue_depth: int
    num_batches: int
    batch_size_counts: dict[int, int]   # batch size (passes) -> number of batches of that size
    num_output_tokens: int
    num_input_tokens: int
    num_spare_instances: int = 0        # instantiated ahead, waiting for a launch
    suspensions: "SuspensionStats | None" = None   # suspend and restore (host/suspensions.py)
    outbound: Mapping[str, Any] | None = None      # tenant -> host.outbound.stats.TenantOutbound
    spawns: Mapping[str, Any] | None = None        # tenant -> host.spawns.TenantSpawns


class TokenRate:
    """Generated tokens per second over a sliding window of (time, total tokens) samples."""

    def __init__(self, window_s: float = 10.0) -> None:
        self.window_s = window_s
        self._samples: deque[tuple[float, int]] = deque()

    def sample(self, total_tokens: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self._samples.append((now, total_tokens))
        while len(self._samples) > 2 and now - self._samples[0][0] > self.window_s:
            self._samples.popleft()

    def per_second(self) -> float:
        if len(self._samples) < 2:
            return 0.0
        (t0, n0), (t1, n1) = self._samples[0], self._samples[-1]
        return (n1 - n0) / (t1 - t0) if t1 > t0 else 0.0


class ServerMetrics:
    """The server's registry: counters it updates plus a collector over `figures()`."""

    def __init__(self, figures: Callable[[], RuntimeFigures]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.token_rate = TokenRate()
        self._figures = figures
        self.instances_launched = Counter("pie_instances_launched", "Instances launched",
                                          registry=self.registry)
        self.instance_events = Counter("pie_instance_events", "Instance events by kind",
                                       ["kind"], registry=self.registry)
        self.traps = Counter("pie_traps", "Instance traps by cause", ["cause"],
                             registry=self.registry)
        self.registry.register(_RuntimeCollector(self))

    def count_event(self, kind: str, data: str) -> None:
        """Count one instance event (and its trap cause)."""
        self.instance_events.labels(kind=kind).inc()
        if kind == "trap":
            self.traps.labels(cause=trap_cause(data)).inc()

    def figures(self) -> RuntimeFigures:
        return self._figures()

    def sample(self) -> None:
        """Take a tokens/s sample (the server calls this about once a second)."""
        self.token_rate.sample(self._figures().num_output_tokens)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)


class _RuntimeCollector:
    def __init__(self, metrics: ServerMetrics) -> None:
        self._metrics = metrics

    def describe(self) -> list:
        return []

    def collect(self) -> Iterator:
        figures = self._metrics.figures()
        yield _gauge("pie_instances_running", "Instances running now",
                     figures.num_running_instances)
        yield _gauge("pie_instances_spare", "Instances instantiated ahead, waiting for a launch",
                     figures.num_spare_instances)
        yield _gauge("pie_kv_pages_used", "KV pages in use", figures.num_pages_used)
        yield _gauge("pie_kv_pages_free", "KV pages free", figures.num_pages_free)
        yield _gauge("pie_kv_pages_exported", "KV pages held by exports (part of the used)",
                     figures.num_pages_exported)
        yield _gauge("pie_scheduler_queue_depth", "Forward passes waiting for a batch",
                     figures.queue_depth)
        yield _gauge("pie_tokens_per_second", "Generated tokens per second (sliding window)",
                     self._metrics.token_rate.per_second())
        tokens = CounterMetricFamily("pie_generated_tokens", "Tokens generated (sampled outputs)")
        tokens.add_metric([], figures.num_output_tokens)
        yield tokens
        inputs = CounterMetricFamily("pie_input_tokens", "Tokens whose KV was computed")
        inputs.add_metric([], figures.num_input_tokens)
        yield inputs
        yield _batch_histogram(figures.batch_size_counts)
        if figures.suspensions is not None:
            yield from _suspension_metrics(figures.suspensions)
        yield from _outbound_metrics(figures.outbound or {})
        yield from _spawn_metrics(figures.spawns or {})


def _outbound_metrics(tenants: Mapping[str, Any]) -> Iterator:
    """Instances' HTTP requests and MCP calls, per tenant (counters since start)."""
    for name, documentation, attribute in (
            ("pie_outbound_requests", "Outgoing HTTP requests sent", "num_requests"),
            ("pie_outbound_bytes_out", "Request body bytes sent", "num_bytes_out"),
            ("pie_outbound_bytes_in", "Answer body bytes read", "num_bytes_in"),
            ("pie_mcp_calls", "MCP tool lists and calls", "num_mcp_calls"),
            ("pie_mcp_errors", "MCP tool lists and calls that failed", "num_mcp_errors")):
        family = CounterMetricFamily(name, documentation, labels=["tenant"])
        for tenant, counts in sorted(tenants.items()):
            family.add_metric([tenant], getattr(counts, attribute))
        yield family
    refusals = CounterMetricFamily("pie_outbound_refusals",
                                   "Outgoing requests and MCP calls refused, by cause",
                                   labels=["tenant", "cause"])
    for tenant, counts in sorted(tenants.items()):
        for cause, number in sorted(counts.refusals.items()):
            refusals.add_metric([tenant, cause], number)
    yield refusals


def _spawn_metrics(tenants: Mapping[str, Any]) -> Iterator:
    """Child inferlets per tenant: spawned since start, alive now."""
    spawned = CounterMetricFamily("pie_spawns", "Child inferlets spawned", labels=["tenant"])
    live = GaugeMetricFamily("pie_children_live", "Child inferlets running now",
                             labels=["tenant"])
    for tenant, counts in sorted(tenants.items()):
        spawned.add_metric([tenant], counts.num_spawns)
        live.add_metric([tenant], counts.num_live_children)
    yield spawned
    yield live


def _suspension_metrics(stats: "SuspensionStats") -> Iterator:
    """Suspend and restore (host/suspensions.py): counters since start, gauges of now."""
    for name, documentation, value in (
            ("pie_suspensions", "Instances suspended for KV pages", stats.num_suspensions),
            ("pie_restores", "Suspended instances restored", stats.num_restores),
            ("pie_swapped_pages", "KV pages copied to host memory", stats.num_swapped_pages),
            ("pie_restored_pages", "KV pages back in the pool by restores",
             stats.num_restored_pages),
            ("pie_recomputed_pages", "KV pages recomputed by a prefill on restore (not copied)",
             stats.num_recomputed_pages),
            ("pie_suspended_seconds", "Time spent suspended (ended suspensions)",
             stats.suspended_s),
            ("pie_suspend_deadline_terminations", "Instances ended past suspend_deadline_s",
             stats.num_deadline_terminations)):
        family = CounterMetricFamily(name, documentation)
        family.add_metric([], value)
        yield family
    yield _gauge("pie_instances_suspended", "Instances suspended now", stats.num_suspended)
    yield _gauge("pie_swap_pages", "KV pages in host memory now", stats.num_pages_in_swap)
    yield _gauge("pie_swap_bytes", "Host bytes of suspended KV pages now", stats.swap_bytes)


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)


def _batch_histogram(counts: dict[int, int]) -> HistogramMetricFamily:
    bounds = (1, 2, 4, 8, 16, 32, 64, 128, 256)
    buckets = []
    for bound in bounds:
        running = sum(n for size, n in counts.items() if size <= bound)
        buckets.append((str(bound), running))
    total = sum(counts.values())
    buckets.append(("+Inf", total))
    size_sum = sum(size * n for size, n in counts.items())
    family = HistogramMetricFamily("pie_batch_size", "Forward passes per engine batch")
    family.add_metric([], buckets, sum_value=size_sum)
    return family
