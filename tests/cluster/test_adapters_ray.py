"""Tenants' LoRA adapters in `pie serve --ray` (real model, float32, two replicas): an upload is
registered on both replicas, served as "<model>:<adapter>" wherever a request lands (the same
answer on either replica, unlike the base model's), refused whole when its tensors do not fit
(the tensor named), registered again on a replica Ray restarted, and gone from both once
deleted."""
from __future__ import annotations

import os
import threading
import time
from functools import partial

import httpx
import openai
import pytest
import ray

from engine import load_default_engine
from host.client import PieError, SyncClient
from host.server.server_config import parse_config
from tests.server.conftest import seed_builtin
from tests.server.harness import ServerThread
from tests.server.test_adapters import _adapter

pytestmark = pytest.mark.slow
TOKEN = "tok-adapters-ray"
ENGINE = dict(dtype="float32", page_size=16, num_pages=96, progress=False, seed=0)
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(ray_cluster, tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("pie-adapters-ray")
    seed_builtin(data_dir)
    config = parse_config({
        "server": {"data_dir": str(data_dir), "openai": True, "shutdown_grace_s": 1.0,
                   "warm_prefixes": False},
        "engine": {"page_size": 16, "num_pages": 96},
        "cluster": {"enabled": True, "replicas": 2, "num_cpus": 0.0, "torch_threads": 1},
        "tenants": [{"name": "alice", "token": TOKEN, "prefix_cache_pages": 0}]})
    running = ServerThread(config, partial(load_default_engine, **ENGINE)).start()
    yield running
    running.stop()


def ask_both(url: str, model: str) -> list[str]:
    """The same greedy chat sent twice at once (placed by load: one on each replica)."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=TOKEN, max_retries=0)
    answers = [None, None]

    def ask(index: int) -> None:
        answers[index] = client.chat.completions.create(
            model=model, messages=QUESTION, max_tokens=8, temperature=0,
            extra_body={"ignore_eos": True}).choices[0].message.content
    threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    return answers


def metric(url: str, name: str) -> dict[str, float]:
    lines = httpx.get(url + "/metrics", timeout=10).text.splitlines()
    return {line.split('"')[1]: float(line.split()[-1]) for line in lines
            if line.startswith(name + "{")}


def generated(url: str) -> dict[str, float]:
    return metric(url, "pie_replica_generated_tokens")


def epoch(url: str, replica_id: str) -> float:
    return metric(url, "pie_replica_epoch").get(replica_id, 0.0)


def test_adapter_registered_on_every_replica(server, tmp_path) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=TOKEN, max_retries=0)
    (base,) = [m.id for m in client.models.list().data]
    with SyncClient(server.url, TOKEN) as ws:
        with pytest.raises(PieError, match="tensor"):
            ws.upload_adapter("broken", _adapter(tmp_path, 2, bad=True))
        stored = ws.upload_adapter("tone", _adapter(tmp_path, 1))
        assert stored["name"] == "tone"
        assert [a["name"] for a in ws.list_adapters()] == ["tone"]
    assert sorted(m.id for m in client.models.list().data) == [base, f"{base}:tone"]
    plain = ask_both(server.url, base)
    toned = ask_both(server.url, f"{base}:tone")
    assert plain[0] == plain[1] and toned[0] == toned[1]
    assert toned[0] != plain[0]                     # the adapter changes the answer
    assert all(n > 0 for n in generated(server.url).values())    # both replicas answered

    replica = ray.get_actor(f"pie{os.getpid()}-replica-r1", namespace="pie")
    ray.kill(replica, no_restart=False)             # its next life holds no adapter
    deadline = time.monotonic() + 60
    while epoch(server.url, "r1") < 2.0:
        assert time.monotonic() < deadline, "r1 did not rejoin"
        time.sleep(0.2)
    assert ask_both(server.url, f"{base}:tone") == toned      # registered again there
    with SyncClient(server.url, TOKEN) as ws:
        ws.delete_adapter("tone")
    with pytest.raises(openai.NotFoundError, match="tone"):
        client.chat.completions.create(model=f"{base}:tone", messages=QUESTION, max_tokens=2)
