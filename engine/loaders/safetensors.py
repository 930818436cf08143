"""Load a Hugging Face Llama checkpoint directory: config.json + safetensors weights (+ tokenizer).

Weights come from `model.safetensors` or the shards listed in `model.safetensors.index.json`;
they already have HF names and Q/K order. The tokenizer comes from `tokenizer.json` when present.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from engine.engine_config import ModelConfig
from engine.loaders.common import LoadedModel, ModelLoadError, check_weight_shapes, torch_dtype
from engine.tokenizer import Tokenizer

__all__ = ["load_safetensors", "hf_model_config"]

_SUPPORTED_MODEL_TYPES = ("llama",)


def hf_model_config(path: Path, config: dict[str, Any]) -> ModelConfig:
    """ModelConfig from a parsed config.json (`path` names it in errors)."""
    model_type = config.get("model_type")
    if model_type not in _SUPPORTED_MODEL_TYPES:
        raise ModelLoadError(path, f"unsupported architecture {model_type!r} (only 'llama' is supported)")
    try:
        hidden_size = int(config["hidden_size"])
        num_heads = int(config["num_attention_heads"])
        rope = config.get("rope_parameters") or {}   # transformers >= 5 moves rope_theta here
        rope_scaling = config.get("rope_scaling")
        if rope.get("rope_type", "default") != "default" and rope_scaling is None:
            rope_scaling = {key: value for key, value in rope.items() if key != "rope_theta"}
        return ModelConfig(
            name=str(config.get("_name_or_path") or path.parent.name),
            vocab_size=int(config["vocab_size"]),
            hidden_size=hidden_size,
            intermediate_size=int(config["intermediate_size"]),
            num_layers=int(config["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
            head_dim=int(config.get("head_dim") or hidden_size // num_heads),
            max_position=int(config.get("max_position_embeddings", 2048)),
            rope_theta=float(config.get("rope_theta", rope.get("rope_theta", 10000.0))),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            rope_scaling=rope_scaling,
        )
    except KeyError as error:
        raise ModelLoadError(path, f"config field {error.args[0]!r} is missing") from None
    except (TypeError, ValueError) as error:
        raise ModelLoadError(path, f"invalid hyperparameters: {error}") from None


def load_safetensors(dir_path: str | Path, dtype: torch.dtype | str = torch.float32,
                     progress: bool = True) -> LoadedModel:
    """Load the HF Llama checkpoint in `dir_path`; ModelLoadError naming the file and reason.

    `progress` is accepted for symmetry with load_gguf; safetensors reads are memory-mapped
    and quick, so no bar is shown.
    """
    directory = Path(dir_path)
    dtype = torch_dtype(dtype)
    if not directory.is_dir():
        raise ModelLoadError(directory, "no such directory")
    config_path = directory / "config.json"
    config_json = _read_json(config_path)
    config = hf_model_config(config_path, config_json)
    weights: dict[str, torch.Tensor] = {}
    for file in _weight_files(directory):
        weights.update(_read_safetensors(file, dtype))
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)   # some checkpoints store the tied copy too
    weights = {name: tensor for name, tensor in weights.items() if not name.endswith("rotary_emb.inv_freq")}
    check_weight_shapes(directory, config, {name: tensor.shape for name, tensor in weights.items()})
    tokenizer = None
    if (directory / "tokenizer.json").is_file():
        try:
            tokenizer = Tokenizer.from_tokenizer_json(directory / "tokenizer.json",
                                                      eos_token_ids=config_eos_ids(config_json))
        except Exception as error:  # tokenizers raises its own Exception type for bad JSON
            raise ModelLoadError(directory / "tokenizer.json", f"bad tokenizer: {error}") from None
    return LoadedModel(config=config, weights=weights, tokenizer=tokenizer, source=str(directory))


def config_eos_ids(config: dict[str, Any]) -> list[int]:
    """config.json's eos_token_id, which may be an int, a list or absent."""
    eos = config.get("eos_token_id")
    if eos is None:
        return []
    return [int(token_id) for token_id in (eos if isinstance(eos, list) else [eos])]


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ModelLoadError(path, "no such file")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ModelLoadError(path, f"not valid JSON ({error})") from None


def _weight_files(directory: Path) -> list[Path]:
    """model.safetensors, or every shard named by model.safetensors.index.json."""
    single, index = directory / "model.safetensors", directory / "model.safetensors.index.json"
    if single.is_file():
        return [single]
    if not index.is_file():
        raise ModelLoadError(directory, "no model.safetensors or model.safetensors.index.json")
    weight_map = _read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ModelLoadError(index, "no 'weight_map' in the index")
    shards = [directory / name for name in dict.fromkeys(weight_map.values())]
    for shard in shards:
        if not shard.is_file():
            raise ModelLoadError(shard, "shard listed in model.safetensors.index.json is missing")
    return shards


def _read_safetensors(file: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    try:
        with safe_open(file, framework="pt") as reader:
            return {name: _converted(reader.get_tensor(name), dtype) for name in reader.keys()}
    except (SafetensorError, OSError) as error:
        raise ModelLoadError(file, f"truncated or corrupt safetensors file ({error})") from None


def _converted(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return tensor if tensor.dtype == dtype else tensor.to(dtype)
