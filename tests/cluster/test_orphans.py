"""Instances whose front is gone (fake engine, local Ray, orphan_grace_s 1 s): nobody attaches
them within the grace, so their replica terminates them, their reservations return and their
waiting events go; an instance another front attached in time runs on."""
from __future__ import annotations

import os
import time
from functools import partial

import pytest
import ray

from host.cluster.cluster import ClusterConfig, start_cluster, stop_cluster
from host.cluster.front import ClusterFront
from host.cluster.replica import ReplicaSpec
from host.runtime_config import InstanceLimits, RuntimeConfig
from tests.cluster.conftest import Events
from tests.host.components import components  # noqa: F401
from tests.host.fake_engine import FakeEngine


@pytest.fixture(scope="module")
def handles(ray_cluster, tmp_path_factory):
    runtime_config = RuntimeConfig(cache_dir=tmp_path_factory.mktemp("pie-orphans"),
                                   limits=InstanceLimits(max_idle_s=20.0))
    engine = partial(FakeEngine, num_pages=64, page_size=4, batch_delay_s=0.002,
                     keep_log=False)
    config = ClusterConfig(num_replicas=2, num_cpus=0, detached=False,
                           name_prefix=f"o{os.getpid()}", namespace="pie-test")
    made = start_cluster(config, lambda rid: ReplicaSpec(rid, engine, runtime_config,
                                                         orphan_grace_s=1.0))
    yield made, runtime_config
    stop_cluster(made)


def front_of(handles) -> ClusterFront:
    made, runtime_config = handles
    return ClusterFront(made.directory, made.replicas, config=runtime_config, poll_s=0.2)


def wait_for(check, what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def test_orphans_end_after_the_grace_unless_attached(handles, components) -> None:  # noqa: F811
    made, _ = handles
    first = front_of(handles)
    echo = first.load_program(components.component("echo"))
    ids = [first.launch(echo, []) for _ in range(2)]
    first.close(terminate=False)
    second = front_of(handles)
    try:
        events = Events()
        second.attach(ids[0], "default", on_event=events)      # taken over in time
        wait_for(lambda: [i.instance_id for i in second.running_instances()] == [ids[0]],
                 "the other orphan to end")
        wait_for(lambda: ray.get(made.directory.num_reservations.remote()) == 1,
                 "the orphan's reservation to return")
        time.sleep(1.5)                                   # past the grace: attached, it runs on
        assert second.send(ids[0], "still here")
        assert events.next() == ("message", "still here")
        second.send(ids[0], "")
        assert second.wait(ids[0], 20).value == "bye"
    finally:
        second.close()
