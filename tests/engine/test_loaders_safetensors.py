"""The safetensors loader on tiny HF Llama checkpoints written here (one file, and two shards with
an index), checked against the weights written and against transformers' from_pretrained."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from engine.loaders import ModelLoadError, load_model, load_safetensors
from tests.engine.gguf_factory import TINY, tiny_hf_weights


def hf_config(tied: bool) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "vocab_size": TINY["vocab"], "hidden_size": TINY["hidden"],
            "intermediate_size": TINY["intermediate"], "num_hidden_layers": TINY["num_layers"],
            "num_attention_heads": TINY["num_heads"], "num_key_value_heads": TINY["num_kv_heads"],
            "max_position_embeddings": 256, "rope_theta": 5000.0, "rms_norm_eps": 1e-6,
            "tie_word_embeddings": tied, "eos_token_id": 3, "torch_dtype": "float32"}


def write_checkpoint(directory: Path, tied: bool, sharded: bool) -> dict[str, torch.Tensor]:
    """A tiny HF Llama checkpoint in `directory`; returns the weights written."""
    directory.mkdir(parents=True, exist_ok=True)
    weights = {name: torch.from_numpy(value) for name, value in tiny_hf_weights(3, tied).items()}
    (directory / "config.json").write_text(json.dumps(hf_config(tied)))
    if not sharded:
        save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})
        return weights
    names = sorted(weights)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for file, shard_names in shards.items():
        save_file({name: weights[name] for name in shard_names}, directory / file, metadata={"format": "pt"})
    weight_map = {name: file for file, shard_names in shards.items() for name in shard_names}
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}))
    return weights


@pytest.mark.parametrize("tied, sharded", [(True, False), (False, True)])
def test_checkpoint_loads_as_written(tmp_path, tied, sharded):
    written = write_checkpoint(tmp_path / "ckpt", tied, sharded)
    model = load_model(tmp_path / "ckpt", dtype=torch.float32, progress=False)
    config = model.config
    assert (config.num_layers, config.hidden_size, config.intermediate_size) == (
        TINY["num_layers"], TINY["hidden"], TINY["intermediate"])
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (4, 2, 16)
    assert (config.vocab_size, config.max_position, config.rope_theta) == (TINY["vocab"], 256, 5000.0)
    assert config.tie_word_embeddings == tied and config.rms_norm_eps == 1e-6
    assert set(model.weights) == set(written) and model.tokenizer is None
    for name, tensor in written.items():
        assert torch.equal(model.weights[name], tensor), name
    assert model.source == str(tmp_path / "ckpt")


@pytest.mark.parametrize("tied, sharded", [(True, True), (False, False)])
def test_checkpoint_agrees_with_transformers(tmp_path, tied, sharded):
    from transformers import LlamaForCausalLM

    write_checkpoint(tmp_path / "ckpt", tied, sharded)
    reference = LlamaForCausalLM.from_pretrained(tmp_path / "ckpt", dtype=torch.float32).state_dict()
    model = load_safetensors(tmp_path / "ckpt", progress=False)
    if tied:
        reference.pop("lm_head.weight")
    assert set(model.weights) == set(reference)
    for name, tensor in model.weights.items():
        assert torch.equal(tensor, reference[name]), name


def test_bfloat16_on_request(tmp_path):
    written = write_checkpoint(tmp_path / "ckpt", tied=True, sharded=False)
    model = load_safetensors(tmp_path / "ckpt", dtype="bfloat16", progress=False)
    name = "model.layers.1.mlp.down_proj.weight"
    assert model.weights[name].dtype == torch.bfloat16
    assert torch.equal(model.weights[name], written[name].to(torch.bfloat16))


def test_tokenizer_json_beside_the_weights_is_loaded(tmp_path):
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers

    write_checkpoint(tmp_path / "ckpt", tied=True, sharded=False)
    vocab = {token: index for index, token in enumerate(["<s>", "</s>", "a", "b", "ab", "Ġ", "Ġab"])}
    backend = Backend(models.BPE(vocab=vocab, merges=[("a", "b"), ("Ġ", "ab")]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(["<s>", "</s>"])
    backend.save(str(tmp_path / "ckpt" / "tokenizer.json"))
    (tmp_path / "ckpt" / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "</s>", "bos_token": {"content": "<s>"},
         "chat_template": "{% for m in messages %}{{ bos_token + m['content'] + eos_token }}{% endfor %}"}))
    tokenizer = load_safetensors(tmp_path / "ckpt", progress=False).tokenizer
    assert tokenizer is not None and tokenizer.encode("ab ab") == [4, 6]
    assert tokenizer.decode([4, 6]) == "ab ab"
    assert tokenizer.stop_token_ids == (3, 1)   # config.json's eos_token_id, then "</s>"
    assert tokenizer.render_chat([{"role": "user", "content": "ab"}]) == "<s>ab</s>"


def test_missing_shard_is_named(tmp_path):
    write_checkpoint(tmp_path / "ckpt", tied=True, sharded=True)
    (tmp_path / "ckpt" / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"model-00002-of-00002\.safetensors.*shard .* is missing"):
        load_safetensors(tmp_path / "ckpt")


def test_truncated_safetensors_is_named(tmp_path):
    write_checkpoint(tmp_path / "ckpt", tied=True, sharded=False)
    file = tmp_path / "ckpt" / "model.safetensors"
    file.write_bytes(file.read_bytes()[:-1000])
    with pytest.raises(ModelLoadError, match=r"model\.safetensors.*truncated or corrupt"):
        load_safetensors(tmp_path / "ckpt")


def test_other_architecture_is_refused(tmp_path):
    write_checkpoint(tmp_path / "ckpt", tied=True, sharded=False)
    config = hf_config(tied=True) | {"model_type": "qwen2"}
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"config\.json.*unsupported architecture 'qwen2'"):
        load_safetensors(tmp_path / "ckpt")


def test_missing_weight_and_missing_field_are_named(tmp_path):
    written = write_checkpoint(tmp_path / "ckpt", tied=False, sharded=False)
    del written["lm_head.weight"]
    save_file(written, tmp_path / "ckpt" / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"ckpt.*missing weight 'lm_head\.weight'"):
        load_safetensors(tmp_path / "ckpt")
    config = hf_config(tied=False)
    del config["hidden_size"]
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"config\.json.*'hidden_size' is missing"):
        load_safetensors(tmp_path / "ckpt")


def test_directory_without_weights_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(hf_config(tied=True)))
    with pytest.raises(ModelLoadError, match="no model.safetensors or model.safetensors.index.json"):
        load_safetensors(tmp_path)
