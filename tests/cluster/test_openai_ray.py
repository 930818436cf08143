"""The OpenAI API in `pie serve --ray` mode on the real model (SmolLM2-135M, float32: batch
invariant), two replicas: /v1/models, chat and completions, streamed and not, answer exactly as
one process does; requests spread over both replicas, a `user` keeps to one."""
from __future__ import annotations

from functools import partial

import httpx
import openai
import pytest

from engine import load_default_engine
from host.server.server_config import parse_config
from tests.server.conftest import seed_builtin
from tests.server.harness import ServerThread

pytestmark = pytest.mark.slow
TOKEN = "tok-openai-ray"
ENGINE = dict(dtype="float32", page_size=16, num_pages=96, progress=False, seed=0)
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def config(data_dir, **cluster):
    return parse_config({
        "server": {"data_dir": str(data_dir), "openai": True, "shutdown_grace_s": 1.0,
                   "warm_prefixes": False},
        "engine": {"page_size": 16, "num_pages": 96},
        **({"cluster": {"enabled": True, "replicas": 2, "num_cpus": 0.0, **cluster}}
           if cluster else {}),
        "tenants": [{"name": "alice", "token": TOKEN, "prefix_cache_pages": 0}]})


def answers(url: str) -> dict:
    """What the server answers to the same requests (greedy)."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=TOKEN, max_retries=0)
    (model,) = [m.id for m in client.models.list().data]
    chat = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=10,
                                          temperature=0)
    chunks = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=10,
                                            temperature=0, stream=True)
    completion = client.completions.create(model=model, prompt="The capital of France is",
                                           max_tokens=8, temperature=0, n=2)
    return {"model": model, "chat": chat.choices[0].message.content,
            "usage": (chat.usage.prompt_tokens, chat.usage.completion_tokens),
            "streamed": "".join(c.choices[0].delta.content or "" for c in chunks if c.choices),
            "completions": [c.text for c in completion.choices]}


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> dict:
    data_dir = tmp_path_factory.mktemp("pie-openai-one")
    seed_builtin(data_dir)
    server = ServerThread(config(data_dir), load_default_engine(**ENGINE)).start()
    try:
        return answers(server.url)
    finally:
        server.stop()


def test_openai_over_two_replicas_answers_as_one_process(ray_cluster, tmp_path_factory,
                                                         one_process) -> None:
    data_dir = tmp_path_factory.mktemp("pie-openai-ray")
    seed_builtin(data_dir)
    server = ServerThread(config(data_dir, torch_threads=1),
                          partial(load_default_engine, **ENGINE)).start()
    try:
        assert answers(server.url) == one_process
        assert "Paris" in one_process["chat"] and one_process["streamed"] == one_process["chat"]
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=TOKEN, max_retries=0)
        for _ in range(3):                       # one user's requests keep to one replica
            client.completions.create(model=one_process["model"], prompt="Hi", max_tokens=1,
                                      user="session-7")
        metrics = httpx.get(server.url + "/metrics").text
        placed = {line.split("}")[0].split('"')[1]: float(line.split()[-1])
                  for line in metrics.splitlines()
                  if line.startswith("pie_front_placements_total{")}
        assert placed.get("key") == 3.0          # by the user's key; the rest by load
        generated = [float(line.split()[-1]) for line in metrics.splitlines()
                     if line.startswith("pie_replica_generated_tokens{")]
        assert len(generated) == 2 and all(n > 0 for n in generated)   # both replicas served
    finally:
        server.stop()
