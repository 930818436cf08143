"""`pie serve` in --ray mode ([cluster] enabled): the same WebSocket protocol, served by a
ClusterFront over two fake-engine replicas on a local Ray; launches with an affinity; /metrics
summed over the replicas; a refused affinity; the server's shutdown stops the replicas."""
from __future__ import annotations

import dataclasses
import os
from functools import partial

import httpx
import pytest
import ray

from host.client.client import PieError
from host.client.sync import SyncClient
from host.server.server_config import ClusterSection, ConfigError, parse_config
from tests.host.components import components  # noqa: F401
from tests.host.fake_engine import FakeEngine
from tests.server.harness import ServerThread

TOKEN = "tok-ray-tenant"


def ray_config(data_dir, **cluster):
    return parse_config({
        "server": {"data_dir": str(data_dir), "shutdown_grace_s": 1.0, "openai": False},
        "cluster": {"enabled": True, "replicas": 2, "num_cpus": 0.0, **cluster},
        "tenants": [{"name": "ray", "token": TOKEN, "max_instances": 3, "max_kv_pages": 30,
                     "max_program_bytes": 64 << 10}]})


@pytest.fixture(scope="module")
def ray_server(ray_cluster, tmp_path_factory):
    engine = partial(FakeEngine, num_pages=64, page_size=4, batch_delay_s=0.002, keep_log=False)
    server = ServerThread(ray_config(tmp_path_factory.mktemp("pie-ray-data")), engine).start()
    yield server
    server.stop()


def test_serving_over_replicas(ray_server, components) -> None:  # noqa: F811
    with SyncClient(ray_server.url, TOKEN) as client:
        echo = client.upload(components.component("echo"))
        ids = [client.launch(echo), client.launch(echo, affinity="session-42")]
        assert {instance_id.split(".")[0] for instance_id in ids} <= {"r0", "r1"}
        for instance_id in ids:
            client.send(instance_id, "hi")
            event = next(client.events(instance_id))
            assert (event.kind, event.data) == ("message", "hi")
        metrics = httpx.get(ray_server.url + "/metrics").text
        assert "pie_instances_running 2.0" in metrics
        running = [line for line in metrics.splitlines()
                   if line.startswith("pie_replica_instances_running{")]
        assert sorted(running) == [
            f'pie_replica_instances_running{{replica="r{i}"}} {float(n)}'
            for i, n in enumerate(sum(1 for x in ids if x.startswith(f"r{r}.")) for r in (0, 1))]
        assert 'pie_front_placements_total{rule="least_loaded"}' in metrics
        client.launch(echo)
        with pytest.raises(PieError, match="max_instances") as refused:
            client.launch(echo)                           # tenant ray: 3 instances at most
        assert "Traceback" not in str(refused.value)     # the refusal itself, not Ray's trace
        with pytest.raises(PieError, match="affinity must be 1..256 characters"):
            client.launch(echo, affinity="x" * 300)
        for instance_id in ids:
            client.send(instance_id, "")
            assert client.wait(instance_id).data == "bye"
        assert client.model_info()["name"] == "fake-byte-model"


def test_program_bytes_count_across_the_cluster(ray_server, components) -> None:  # noqa: F811
    """The Directory counts the tenant's programs across fronts: past max_program_bytes an
    upload is refused, however little this front's own store holds."""
    directory = ray.get_actor(f"pie{os.getpid()}-directory", namespace="pie")
    ray.get(directory.add_program.remote("ray", "f" * 64, 48 << 10))  # another front's upload
    with SyncClient(ray_server.url, TOKEN) as client:
        with pytest.raises(PieError, match="max_program_bytes \\(65536\\)"):
            client.upload(components.component("generate"))


@pytest.mark.parametrize("field, value", [("replicas", 0), ("num_gpus", -1.0),
                                          ("torch_threads", 0), ("max_restarts", -2)])
def test_the_cluster_section_is_validated(tmp_path, field, value) -> None:
    with pytest.raises(ConfigError, match=f"cluster.{field}"):
        ray_config(tmp_path, **{field: value})


def test_the_cluster_is_off_unless_asked() -> None:
    assert ClusterSection().enabled is False
    assert dataclasses.replace(ClusterSection(), enabled=True).replicas == 2
