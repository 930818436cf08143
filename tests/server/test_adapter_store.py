"""The tenants' adapter store (host/server/adapters.py) over a real AdapterStore of a tiny model:
content-addressed files, names per tenant registered in the tenant's scope, the quota, a bad
tensor named, replacing and deleting (files no name refers to go), and a restart's restore."""
from __future__ import annotations

import hashlib
import io
from pathlib import Path

import pytest
import torch

from engine.adapters import AdapterStore
from engine.adapters.peft import CONFIG_FILE, WEIGHTS_FILE, save_adapter
from host.server.adapters import (MAX_ADAPTERS_PER_TENANT, AdapterUploadError, TenantAdapters,
                                  adapter_id)
from tests.engine.conftest import TINY
from tests.engine.test_adapters import random_tensors

QUOTA = 1 << 20


def _files(tmp_path: Path, name: str, seed: int, rank: int = 4, bad: bool = False
           ) -> tuple[bytes, bytes]:
    """(config bytes, weights bytes) of a random adapter of the tiny model; `bad`: layer 1's
    q_proj B one column short."""
    tensors = random_tensors(TINY, rank, ("q_proj", "down_proj"), seed)
    if bad:
        a, b = tensors[(1, "q_proj")]
        tensors[(1, "q_proj")] = (a, b[:, :-1].contiguous())
    folder = save_adapter(tmp_path / f"src-{name}-{seed}", rank, 2 * rank, tensors)
    return (folder / CONFIG_FILE).read_bytes(), (folder / WEIGHTS_FILE).read_bytes()


def _store() -> AdapterStore:
    return AdapterStore(TINY, torch.float32, torch.device("cpu"), memory_bytes=8 << 20)


def _add(adapters: TenantAdapters, tenant: str, name: str, files: tuple[bytes, bytes],
         quota: int = QUOTA):
    config, weights = files
    return adapters.add(tenant, quota, name, config, io.BytesIO(weights),
                        hashlib.sha256(weights).hexdigest())


def test_an_upload_is_stored_once_and_registered_in_its_tenants_scope(tmp_path):
    engine_store = _store()
    adapters = TenantAdapters(tmp_path / "adapters", engine_store, TINY)
    files = _files(tmp_path, "tone", 1)
    stored = _add(adapters, "alice", "tone", files)
    assert stored.sha256 == adapter_id(files[0], hashlib.sha256(files[1]).hexdigest())
    assert stored.size == len(files[0]) + len(files[1]) and stored.rank == 4
    assert stored.target_modules == ("q_proj", "down_proj")
    assert engine_store.resolve("tone", "alice") == "alice/tone"
    assert engine_store.resolve("tone", "bob") is None
    assert [a.name for a in adapters.list("alice")] == ["tone"] and adapters.list("bob") == []
    _add(adapters, "bob", "other-name", files)                      # the same bytes: one copy
    assert len(list((tmp_path / "adapters" / "files").iterdir())) == 1
    assert adapters.names("bob") == {"other-name"}
    assert engine_store.prepare(_requests("alice/tone", "bob/other-name")) is not None


def _requests(*names):
    from engine.batch import GREEDY, ForwardRequest
    return [ForwardRequest((1, 2), (0, 1), (i,), 2, (1,), (GREEDY,), adapter=name)
            for i, name in enumerate(names)]


def test_a_bad_tensor_is_named_and_nothing_is_kept(tmp_path):
    engine_store = _store()
    adapters = TenantAdapters(tmp_path / "adapters", engine_store, TINY)
    with pytest.raises(AdapterUploadError, match=r"layers\.1\.self_attn\.q_proj\.lora_B"):
        _add(adapters, "alice", "bad", _files(tmp_path, "bad", 2, bad=True))
    with pytest.raises(AdapterUploadError, match="not a valid adapter name"):
        _add(adapters, "alice", "../up", _files(tmp_path, "x", 3))
    config, weights = _files(tmp_path, "nan", 4)
    weights = weights[:-4] + torch.tensor([float("nan")]).numpy().tobytes()
    with pytest.raises(AdapterUploadError, match="not finite"):
        adapters.add("alice", QUOTA, "nan", config, io.BytesIO(weights),
                     hashlib.sha256(weights).hexdigest())
    assert adapters.list("alice") == [] and engine_store.names == ()
    assert list((tmp_path / "adapters" / "files").iterdir()) == []
    assert list((tmp_path / "adapters" / "incoming").iterdir()) == []


def test_the_quota_counts_every_name_and_a_replacement_once(tmp_path):
    adapters = TenantAdapters(tmp_path / "adapters", _store(), TINY)
    first = _files(tmp_path, "a", 1)
    size = len(first[0]) + len(first[1])
    quota = 2 * size + size // 2
    _add(adapters, "alice", "a", first, quota)
    _add(adapters, "alice", "b", _files(tmp_path, "b", 2), quota)
    with pytest.raises(AdapterUploadError, match=r"adapter quota: .* max_adapter_bytes"):
        _add(adapters, "alice", "c", _files(tmp_path, "c", 3), quota)
    _add(adapters, "alice", "a", _files(tmp_path, "a2", 4), quota)   # replacing: counted once
    assert adapters.tenant_bytes("alice") == 2 * size
    assert len(list((tmp_path / "adapters" / "files").iterdir())) == 2   # a's old files went


def test_the_number_of_names_is_bounded(tmp_path, monkeypatch):
    import host.server.adapters as module
    monkeypatch.setattr(module, "MAX_ADAPTERS_PER_TENANT", 2)
    adapters = TenantAdapters(tmp_path / "adapters", _store(), TINY)
    files = _files(tmp_path, "a", 1)
    _add(adapters, "alice", "a", files)
    _add(adapters, "alice", "b", files)
    with pytest.raises(AdapterUploadError, match="2 adapters already"):
        _add(adapters, "alice", "c", files)
    _add(adapters, "alice", "b", _files(tmp_path, "b", 2))           # replacing one is fine
    assert MAX_ADAPTERS_PER_TENANT >= 2


def test_delete_and_restore(tmp_path):
    engine_store = _store()
    adapters = TenantAdapters(tmp_path / "adapters", engine_store, TINY)
    _add(adapters, "alice", "a", _files(tmp_path, "a", 1))
    _add(adapters, "alice", "b", _files(tmp_path, "b", 2))
    adapters.delete("alice", "b")
    with pytest.raises(AdapterUploadError, match="unknown adapter 'b'"):
        adapters.delete("alice", "b")
    with pytest.raises(AdapterUploadError, match="unknown adapter 'a'"):
        adapters.delete("bob", "a")
    assert engine_store.names == ("alice/a",)
    assert len(list((tmp_path / "adapters" / "files").iterdir())) == 1
    restarted = _store()                                   # a new server on the same data_dir
    assert TenantAdapters(tmp_path / "adapters", restarted, TINY).restore() == 1
    assert restarted.names == ("alice/a",)


def test_an_openai_model_names_a_tenants_adapter():
    from dataclasses import replace

    from host.server.openai.schema import ApiLimits, RequestError, parse_request

    limits = ApiLimits(frozenset({"M", "M.gguf"}), "M", 4096, 1000, frozenset({"tone"}))
    body = {"prompt": "hi", "max_tokens": 2}
    assert parse_request(dict(body, model="M"), "completion", limits)["adapter"] is None
    assert parse_request(dict(body, model="M:tone"), "completion", limits)["adapter"] == "tone"
    assert parse_request(dict(body, model="M.gguf:tone"), "completion", limits)["adapter"] == "tone"
    for model, words in (("M:nope", "adapter 'nope' of model 'M'"), ("X:tone", "model 'X:tone'"),
                         ("M:", "adapter '' of model 'M'")):
        with pytest.raises(RequestError, match=words) as error:
            parse_request(dict(body, model=model), "completion", limits)
        assert (error.value.status, error.value.code) == (404, "model_not_found")
    with pytest.raises(RequestError, match="adapter 'tone'"):       # another tenant's limits
        parse_request(dict(body, model="M:tone"), "completion", replace(limits, adapters=frozenset()))
