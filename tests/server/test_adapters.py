"""Tenants' LoRA adapters on the real model (SmolLM2-135M) through `pie serve`: uploaded over the
websocket (checked against the base model, the tensor at fault named; counted in the tenant's
quota; listed, replaced, deleted; a tenant sees only its own), then served by the OpenAI API as
"<model>:<adapter>" (listed in /v1/models; an unknown adapter a 404 naming it). A request with
an adapter shares no chat prefix with one without: the same prompt with and without the adapter,
interleaved, gives each what it gives alone."""
from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace

import httpx
import openai
import pytest

from engine.adapters.peft import save_adapter
from host.client import PieError, SyncClient
from tests.engine.test_adapters import random_tensors
from tests.server.conftest import TOKENS, scrape, wait_until_idle

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
# SmolLM2-135M's projection shapes (engine.adapters.peft.projection_shapes reads these)
SMOLLM2 = SimpleNamespace(hidden_size=576, intermediate_size=1536, num_heads=9, num_kv_heads=3,
                          head_dim=64, num_layers=30)
MODULES = ("q_proj", "v_proj", "down_proj")
SYSTEM = "You are the terse assistant of the adapter tests. Answer in one short sentence."
QUESTION = "What is the capital of France?"


def _adapter(directory: Path, seed: int, bad: bool = False) -> Path:
    """A random rank-8 adapter of SmolLM2-135M (about 3.9 MB); `bad`: layer 7's v_proj A one
    column short."""
    tensors = random_tensors(SMOLLM2, 8, MODULES, seed, sigma=0.5)
    if bad:
        a, b = tensors[(7, "v_proj")]
        tensors[(7, "v_proj")] = (a[:, :-1].contiguous(), b)
    return save_adapter(directory / f"lora-{seed}{'-bad' if bad else ''}", 8, 16, tensors)


@pytest.fixture(scope="module")
def alice_tone(model_server, tmp_path_factory):
    """Alice's adapter "tone", deleted when the module ends (other tests list alice's models)."""
    folder = _adapter(tmp_path_factory.mktemp("adapters"), 1)
    with SyncClient(model_server.url, TOKENS["alice"]) as client:
        stored = client.upload_adapter("tone", folder)
    yield stored
    with SyncClient(model_server.url, TOKENS["alice"]) as client:
        for adapter in client.list_adapters():
            client.delete_adapter(adapter["name"])


def _openai(model_server, tenant: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{model_server.url}/v1", api_key=TOKENS[tenant], max_retries=0)


def _ask(model_server, tenant: str, model: str, n: int = 1, system: str = SYSTEM) -> list[str]:
    answer = _openai(model_server, tenant).chat.completions.create(
        model=model, max_tokens=8, temperature=0, n=n, extra_body={"ignore_eos": True},
        messages=[{"role": "system", "content": system}, {"role": "user", "content": QUESTION}])
    assert answer.model == model
    return [choice.message.content for choice in answer.choices]


def _computed(model_server, tenant: str, model: str, system: str) -> tuple[str, int]:
    """(answer, input tokens the engine computed for it) of one request alone."""
    before = scrape(model_server.url)["pie_input_tokens_total"]
    answer = _ask(model_server, tenant, model, system=system)[0]
    figures = wait_until_idle(model_server.url)
    return answer, int(figures["pie_input_tokens_total"] - before)


def test_an_uploaded_adapter_is_listed_and_checked(model_server, alice_tone, tmp_path) -> None:
    assert alice_tone["name"] == "tone" and alice_tone["rank"] == 8
    assert alice_tone["target_modules"] == list(MODULES) and len(alice_tone["sha256"]) == 64
    with SyncClient(model_server.url, TOKENS["alice"]) as alice, \
            SyncClient(model_server.url, TOKENS["carol"]) as carol:
        assert [a["name"] for a in alice.list_adapters()] == ["tone"]
        assert carol.list_adapters() == []                             # a tenant's own only
        with pytest.raises(PieError, match=r"layers\.7\.self_attn\.v_proj\.lora_A.*shape"):
            alice.upload_adapter("broken", _adapter(tmp_path, 2, bad=True))
        with pytest.raises(PieError, match="not a valid adapter name"):
            alice.upload_adapter("base:lora", _adapter(tmp_path, 3))
        with pytest.raises(PieError, match="unknown adapter 'tone'"):
            carol.delete_adapter("tone")
        assert [a["name"] for a in alice.list_adapters()] == ["tone"]


def test_the_adapter_quota(model_server, tmp_path) -> None:
    """tiny holds 6 MiB of adapters: one of ~3.9 MB fits, a second does not, a replacement
    of the first does; one declared past the quota is refused before its bytes are sent."""
    with SyncClient(model_server.url, TOKENS["tiny"]) as tiny:
        try:
            tiny.upload_adapter("first", _adapter(tmp_path, 4))
            with pytest.raises(PieError, match=r"adapter quota.*max_adapter_bytes 6291456"):
                tiny.upload_adapter("second", _adapter(tmp_path, 5))
            replaced = tiny.upload_adapter("first", _adapter(tmp_path, 5))
            assert [a["sha256"] for a in tiny.list_adapters()] == [replaced["sha256"]]
            with pytest.raises(PieError, match="size 7340032 out of range"):
                tiny._call(tiny._client.request, "upload_adapter", name="big", config="{}",
                           sha256="0" * 64, size=7 * 2**20)
        finally:
            for adapter in tiny.list_adapters():
                tiny.delete_adapter(adapter["name"])
        assert tiny.list_adapters() == []


def test_the_openai_api_serves_a_tenants_adapter(model_server, alice_tone) -> None:
    models = [m.id for m in _openai(model_server, "alice").models.list().data]
    assert models == [MODEL, f"{MODEL}:tone"]
    assert [m.id for m in _openai(model_server, "carol").models.list().data] == [MODEL]
    assert _openai(model_server, "alice").models.retrieve(f"{MODEL}:tone").parent == MODEL
    base, = _ask(model_server, "alice", MODEL)
    tuned = _ask(model_server, "alice", f"{MODEL}:tone", n=2)
    assert tuned[0] == tuned[1] != base               # both forks run with the adapter
    completion = _openai(model_server, "alice").completions.create(
        model=f"{MODEL}:tone", prompt="The capital of France is", max_tokens=4, temperature=0)
    assert completion.model == f"{MODEL}:tone" and completion.choices[0].text
    for tenant, model in (("carol", f"{MODEL}:tone"), ("alice", f"{MODEL}:nope")):
        response = httpx.post(f"{model_server.url}/v1/chat/completions",
                              headers={"Authorization": f"Bearer {TOKENS[tenant]}"},
                              json={"model": model, "messages": [{"role": "user",
                                                                  "content": "hi"}]})
        error = response.json()["error"]
        assert response.status_code == 404 and error["code"] == "model_not_found"
        assert f"adapter '{model.rsplit(':', 1)[1]}'" in error["message"]


def test_with_and_without_the_adapter_interleaved_each_gives_its_own(model_server,
                                                                     alice_tone) -> None:
    """Alice shares chat prefixes: the base request's prefix export must never serve the
    adapter's request (it computes its whole prompt every time), nor the reverse."""
    tuned_model, system = f"{MODEL}:tone", SYSTEM + " This is the interleaving test."
    base, computed_base = _computed(model_server, "alice", MODEL, system)   # exports the prefix
    tuned, computed_tuned = _computed(model_server, "alice", tuned_model, system)
    again, computed_again = _computed(model_server, "alice", MODEL, system)  # imports it
    assert tuned != base and again == base
    assert computed_again < computed_base
    assert computed_tuned >= computed_base                  # nothing imported by the adapter
    results: dict[int, str] = {}

    def ask(index: int) -> None:
        results[index] = _ask(model_server, "alice", tuned_model if index % 2 else MODEL,
                              system=system)[0]

    threads = [threading.Thread(target=ask, args=(index,)) for index in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    assert results == {index: tuned if index % 2 else base for index in range(6)}
    tuned_after, computed_after = _computed(model_server, "alice", tuned_model, system)
    assert tuned_after == tuned and computed_after == computed_tuned
    wait_until_idle(model_server.url)


def test_a_deleted_adapter_is_no_model(model_server, tmp_path) -> None:
    with SyncClient(model_server.url, TOKENS["carol"]) as carol:
        carol.upload_adapter("short-lived", _adapter(tmp_path, 6))
        assert f"{MODEL}:short-lived" in [m.id for m in _openai(model_server, "carol")
                                          .models.list().data]
        carol.delete_adapter("short-lived")
        assert carol.list_adapters() == []
    with pytest.raises(openai.NotFoundError, match="short-lived"):
        _ask(model_server, "carol", f"{MODEL}:short-lived")


def test_a_server_whose_engine_takes_no_adapters_says_so(fake_server) -> None:
    with SyncClient(fake_server.url, TOKENS["alice"]) as client:
        assert client.list_adapters() == []
        with pytest.raises(PieError, match="takes no LoRA adapters"):
            client._call(client._client.request, "upload_adapter", name="x", config="{}",
                         sha256="0" * 64, size=10)
        with pytest.raises(PieError, match=r"expected int, got str @ upload_adapter\.size"):
            client._call(client._client.request, "upload_adapter", name="x", config="{}",
                         sha256="0" * 64, size="10")
