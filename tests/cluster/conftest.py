"""One local Ray for the session (it takes seconds to start), a cluster of fake-engine replicas per
module on it (its actors killed at the module's end), and fronts over that cluster per test."""
from __future__ import annotations

import os
import queue
from functools import partial
from pathlib import Path

import pytest
import ray

from host.cluster.cluster import ClusterConfig, init_ray, shutdown_ray, start_cluster, stop_cluster
from host.cluster.directory import TenantQuota
from host.cluster.front import ClusterFront
from host.cluster.placement import PlacementPolicy
from host.cluster.replica import ReplicaSpec
from host.runtime_config import InstanceLimits, RuntimeConfig
from tests.host.fake_engine import FakeEngine

REPO_DIR = Path(__file__).resolve().parents[2]
NUM_PAGES = 64


@pytest.fixture(scope="module")
def ray_cluster():
    """Ray on this machine (4 logical CPUs, a small object store, no dashboard): started by the
    first module that needs it, kept for the next ones, shut down at the session's end (a module
    that needs a Ray of its own shuts this one down first; the next module starts it again)."""
    if not ray.is_initialized():
        init_ray(num_cpus=4, include_dashboard=False, object_store_memory=80 << 20,
                 log_to_driver=False, namespace="pie-test",
                 runtime_env={"env_vars": {"PYTHONPATH": str(REPO_DIR),
                                           "OMP_NUM_THREADS": "1"}})
    yield ray


@pytest.fixture(scope="session", autouse=True)
def _ray_shut_down_at_the_end():
    yield
    if ray.is_initialized():
        shutdown_ray()


class Events:
    """One instance's events; `next()` waits for the next one."""

    def __init__(self) -> None:
        self.queue: queue.Queue = queue.Queue()

    def __call__(self, event) -> None:
        self.queue.put((event.kind, event.data))

    def next(self, timeout: float = 20.0) -> tuple[str, str]:
        return self.queue.get(timeout=timeout)


QUOTAS = (TenantQuota("acme", max_instances=3, max_kv_pages=12, max_program_bytes=1 << 20),
          TenantQuota("beta", max_instances=8, max_kv_pages=64, max_program_bytes=1 << 20))


@pytest.fixture(scope="module")
def cluster(ray_cluster, tmp_path_factory):
    """The module's cluster: a directory (tenants QUOTAS) and 2 fake-engine replicas (64 pages
    of 4 tokens each, 2 ms batches), restartable twice; its actors are killed at the end."""
    cache_dir = tmp_path_factory.mktemp("pie-cluster-cache")
    config = ClusterConfig(num_replicas=2, num_cpus=0, detached=False,
                           name_prefix=f"t{os.getpid()}", namespace="pie-test", max_restarts=2)
    runtime_config = RuntimeConfig(cache_dir=cache_dir, limits=InstanceLimits(max_idle_s=20.0))
    engine = partial(FakeEngine, num_pages=NUM_PAGES, page_size=4, batch_delay_s=0.002,
                     keep_log=False)
    handles = start_cluster(config, lambda rid: ReplicaSpec(rid, engine, runtime_config),
                            quotas=QUOTAS)
    yield handles, runtime_config
    stop_cluster(handles)


@pytest.fixture
def make_front(cluster):
    """make_front(policy=PlacementPolicy(), **options) -> a ClusterFront over the module's
    cluster (with `.handles`), closed after the test (its instances terminated)."""
    handles, runtime_config = cluster
    made = []

    def make(policy: PlacementPolicy = PlacementPolicy(), **options) -> ClusterFront:
        front = ClusterFront(handles.directory, handles.replicas, config=runtime_config,
                             policy=policy, poll_s=0.2, **options)
        front.handles = handles
        made.append(front)
        return front

    yield make
    for front in made:
        front.close()


__all__ = ["Events", "NUM_PAGES", "QUOTAS"]
