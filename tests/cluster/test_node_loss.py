"""A node removed mid-generation (ray.cluster_utils.Cluster: a head and three simulated nodes on
127.0.0.1): the replica on it is lost with exactly its own instances; Ray restarts it on the
spare node, where it rejoins under a new epoch and takes placements again."""
from __future__ import annotations

import time
from functools import partial

import pytest
import ray
from ray.cluster_utils import Cluster

from host.cluster.cluster import (ClusterConfig, init_ray, kept_signal_handlers, shutdown_ray,
                                  start_cluster, stop_cluster)
from host.cluster.front import ClusterFront, replica_of
from host.cluster.replica import ReplicaSpec
from host.runtime_config import InstanceLimits, RuntimeConfig
from tests.cluster.conftest import NUM_PAGES, REPO_DIR
from tests.host.components import components  # noqa: F401
from tests.host.fake_engine import FakeEngine


@pytest.fixture(scope="module")
def nodes():
    """A Ray of its own: a head without CPUs and three nodes of one CPU each."""
    if ray.is_initialized():
        shutdown_ray()
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "include_dashboard": False, "object_store_memory": 80 << 20})
    workers = [cluster.add_node(num_cpus=1, object_store_memory=80 << 20) for _ in range(3)]
    init_ray(address=cluster.address, namespace="pie-test", log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(REPO_DIR), "OMP_NUM_THREADS": "1"}})
    yield cluster, workers
    shutdown_ray()
    with kept_signal_handlers():
        cluster.shutdown()


def node_of(handle) -> str:
    return ray.get(handle.__ray_call__.remote(
        lambda self: ray.get_runtime_context().get_node_id()))


def test_a_removed_node_costs_only_its_replicas_instances(nodes, components,  # noqa: F811
                                                          tmp_path) -> None:
    cluster, workers = nodes
    runtime_config = RuntimeConfig(cache_dir=tmp_path, limits=InstanceLimits(max_idle_s=30.0))
    engine = partial(FakeEngine, num_pages=NUM_PAGES, page_size=4, batch_delay_s=0.01,
                     keep_log=False)
    config = ClusterConfig(num_replicas=2, num_cpus=1, detached=False, name_prefix="nodes",
                           namespace="pie-test", max_restarts=1)
    handles = start_cluster(config, lambda rid: ReplicaSpec(rid, engine, runtime_config))
    front = ClusterFront(handles.directory, handles.replicas, config=runtime_config, poll_s=0.2)
    try:
        program = front.load_program(components.component("bench_calls"))
        ids = [front.launch(program, ["step", "300"]) for _ in range(6)]
        time.sleep(0.5)                                       # mid-generation
        doomed_node = node_of(handles.replicas["r1"])
        assert doomed_node != node_of(handles.replicas["r0"])
        cluster.remove_node(next(w for w in workers if w.node_id == doomed_node))

        outcomes = {i: front.wait(i, 120) for i in ids}
        for instance_id, outcome in outcomes.items():
            if replica_of(instance_id)[0] == "r1":
                assert outcome.status == "trap" and "replica r1 is gone" in outcome.value
            else:
                assert (outcome.status, outcome.value) == ("ok", "done")
        deadline = time.monotonic() + 150
        while "r1" not in front.loads():
            assert time.monotonic() < deadline, "r1 never rejoined"
            time.sleep(0.1)
        assert node_of(handles.replicas["r1"]) not in (doomed_node, node_of(handles.replicas["r0"]))
        later = [front.launch(program, ["step", "3"]) for _ in range(2)]
        assert {replica_of(i)[0] for i in later} == {"r0", "r1"}
        assert [front.wait(i, 60).status for i in later] == ["ok", "ok"]
        assert ray.get(handles.directory.num_reservations.remote()) == 0
        assert all(f.stats.pages.num_free == NUM_PAGES for f in front.replica_figures())
    finally:
        front.close()
        stop_cluster(handles)
