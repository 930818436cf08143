"""LoRA adapters in the PEFT layout: `adapter_config.json` + `adapter_model.safetensors`.

An adapter adds, to a base projection y = x @ W.T of a decoder layer, the low-rank product
scale * (x @ A.T) @ B.T with A [r, in], B [out, r] and scale = lora_alpha / r (lora_alpha /
sqrt(r) with `use_rslora`). Targets are among the Llama projections q/k/v/o/gate/up/down; the
tensors are named as PEFT saves them:

    base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight    [r, hidden]
    base_model.model.model.layers.{i}.self_attn.q_proj.lora_B.weight    [Hq * D, r]

A target may be present in only some layers (PEFT's layers_to_transform). `read_adapter_spec`
checks the config and every tensor's name, dtype and shape against the base model from the
safetensors header alone (nothing is loaded); `load_adapter` then reads the tensors into the
per-layer, per-fused-projection layout the model applies (engine.adapters.apply): the engine's
layers fuse q/k/v into one matmul and gate/up into another, so an adapter's A of a fused
projection is its targeted parts' A stacked ([r * parts targeted, in]: one shrink matmul) and
each targeted part keeps its own B, transposed ([r, out_k], scale folded in), with the columns of
the fused output it adds to; nothing but the file's elements is kept.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.engine_config import ModelConfig

__all__ = ["AdapterError", "AdapterSpec", "LoraAdapter", "ProjectionLora", "FUSED_PROJECTIONS", "TARGET_MODULES",
           "CONFIG_FILE", "WEIGHTS_FILE", "MAX_RANK", "MAX_CONFIG_BYTES", "read_adapter_spec",
           "load_adapter", "projection_shapes", "save_adapter", "tensor_name"]

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MAX_RANK = 256                       # the largest r accepted
MAX_CONFIG_BYTES = 64 * 1024         # adapter_config.json is a few hundred bytes
# the fused projections of a layer, in the model's order, and the PEFT modules each is made of
FUSED_PROJECTIONS: tuple[tuple[str, ...], ...] = (
    ("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",))
TARGET_MODULES = tuple(module for parts in FUSED_PROJECTIONS for module in parts)
_SUBLAYER = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
             "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
_TENSOR = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)"
                     r"\.lora_([AB])\.weight")
_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


class AdapterError(ValueError):
    """An adapter that cannot be used with this base model. `adapter`: its name or path;
    `tensor`: the tensor at fault, or None for the config or the files; `reason`: what is
    wrong. str(error) names all three."""

    def __init__(self, adapter: str, reason: str, tensor: str | None = None) -> None:
        where = f" tensor {tensor}" if tensor else ""
        super().__init__(f"adapter {adapter!r}:{where} {reason}")
        self.adapter = adapter
        self.tensor = tensor
        self.reason = reason


@dataclass(frozen=True)
class AdapterSpec:
    """What an adapter's files declare, checked against a base model (no tensor loaded).

    targets: per layer, the target modules that layer carries (both A and B present).
    num_parameters: elements of every A and B in the file (what `load_adapter` keeps).
    """

    rank: int
    alpha: float
    scale: float
    target_modules: tuple[str, ...]
    targets: tuple[tuple[str, ...], ...]       # [num_layers]
    num_parameters: int

    def resident_bytes(self, dtype_bytes: int) -> int:
        """Bytes the loaded adapter keeps in elements of `dtype_bytes`."""
        return self.num_parameters * dtype_bytes


@dataclass(frozen=True)
class ProjectionLora:
    """One adapter's share of one fused projection: a [r * len(parts), in], the targeted parts'
    A stacked in order; per targeted part, the columns (start, end) of the fused output it adds
    to and its B transposed, b_t [r, end - start] (scale included), each contiguous. The delta of
    part j is (x @ a[j*r:(j+1)*r].T) @ b_t[j]."""

    a: torch.Tensor
    slices: tuple[tuple[int, int], ...]
    b_t: tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class LoraAdapter:
    """An adapter's tensors as the model applies them (see the module docstring).

    layers[i][p]: None (no part of it targeted), or the ProjectionLora of fused projection p
    (FUSED_PROJECTIONS' order) of layer i, on the engine's device and dtype. num_bytes: what the
    tensors hold.
    """

    name: str
    spec: AdapterSpec
    layers: tuple[tuple[ProjectionLora | None, ...], ...]
    num_bytes: int


def tensor_name(layer: int, module: str, which: str) -> str:
    """PEFT's name of `which` ("A" or "B") of `module` in `layer`."""
    return f"base_model.model.model.layers.{layer}.{_SUBLAYER[module]}.{module}.lora_{which}.weight"


def projection_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(out, in) of every target module of the base model."""
    hidden, inter = config.hidden_size, config.intermediate_size
    q_dim, kv_dim = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    return {"q_proj": (q_dim, hidden), "k_proj": (kv_dim, hidden), "v_proj": (kv_dim, hidden),
            "o_proj": (hidden, q_dim), "gate_proj": (inter, hidden), "up_proj": (inter, hidden),
            "down_proj": (hidden, inter)}


def _read_config(name: str, path: Path) -> tuple[int, float, float, tuple[str, ...]]:
    """(rank, alpha, scale, target modules) of adapter_config.json."""
    try:
        if path.stat().st_size > MAX_CONFIG_BYTES:
            raise AdapterError(name, f"{CONFIG_FILE} is larger than {MAX_CONFIG_BYTES} bytes")
        config = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise AdapterError(name, f"{CONFIG_FILE} is missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:
        raise AdapterError(name, f"{CONFIG_FILE} is not readable JSON: {error}") from None
    if not isinstance(config, dict):
        raise AdapterError(name, f"{CONFIG_FILE} must hold a JSON object")
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise AdapterError(name, f"peft_type {peft_type!r} is not supported (only LORA)")
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if type(rank) is not int or not 0 < rank <= MAX_RANK:
        raise AdapterError(name, f"r must be an integer in 1..{MAX_RANK}, got {rank!r}")
    if (isinstance(alpha, bool) or not isinstance(alpha, (int, float))
            or not math.isfinite(alpha)):
        raise AdapterError(name, f"lora_alpha must be a finite number, got {alpha!r}")
    for key, allowed in (("fan_in_fan_out", (False, None)), ("use_dora", (False, None)),
                         ("bias", ("none", None)), ("modules_to_save", (None, [])),
                         ("rank_pattern", ({}, None)), ("alpha_pattern", ({}, None))):
        if config.get(key) not in allowed:
            raise AdapterError(name, f"{key}={config.get(key)!r} is not supported")
    modules = config.get("target_modules")
    if not isinstance(modules, list) or not modules or not all(isinstance(m, str) for m in modules):
        raise AdapterError(name, f"target_modules must be a non-empty list of names among "
                           f"{TARGET_MODULES}, got {modules!r}")
    unknown = sorted(set(modules) - set(TARGET_MODULES))
    if unknown:
        raise AdapterError(name, f"target_modules {unknown} are not among {TARGET_MODULES}")
    rslora = config.get("use_rslora", False)
    if not isinstance(rslora, bool):
        raise AdapterError(name, f"use_rslora must be true or false, got {rslora!r}")
    scale = alpha / math.sqrt(rank) if rslora else alpha / rank
    return rank, float(alpha), float(scale), tuple(m for m in TARGET_MODULES if m in modules)


def _tensor_shapes(name: str, path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """tensor name -> (safetensors dtype, shape), from the file's header."""
    from safetensors import SafetensorError, safe_open

    if not path.is_file():
        raise AdapterError(name, f"{WEIGHTS_FILE} is missing")
    try:
        with safe_open(str(path), framework="pt") as file:
            return {key: (file.get_slice(key).get_dtype(), tuple(file.get_slice(key).get_shape()))
                    for key in file.keys()}
    except (SafetensorError, OSError, ValueError) as error:
        raise AdapterError(name, f"{WEIGHTS_FILE} is not a readable safetensors file: "
                           f"{error}") from None


def read_adapter_spec(name: str, directory: str | Path, config: ModelConfig) -> AdapterSpec:
    """Check the adapter in `directory` against the base model `config`; AdapterError naming the
    tensor (or the config key) at fault. Every tensor must be an A or B of a declared target of
    a layer of the model, float32 / float16 / bfloat16, shaped [r, in] / [out, r]; every A has
    its B; at least one pair."""
    directory = Path(directory)
    rank, alpha, scale, modules = _read_config(name, directory / CONFIG_FILE)
    shapes = projection_shapes(config)
    present: set[tuple[int, str, str]] = set()
    num_parameters = 0
    for key, (dtype, shape) in _tensor_shapes(name, directory / WEIGHTS_FILE).items():
        match = _TENSOR.fullmatch(key)
        if match is None:
            raise AdapterError(name, "is not a LoRA A/B tensor of a decoder layer projection "
                               "(base_model.model.model.layers.<i>.<self_attn|mlp>.<module>"
                               ".lora_<A|B>.weight)", key)
        layer, sublayer, module, which = int(match[1]), match[2], match[3], match[4]
        if module not in modules or _SUBLAYER[module] != sublayer:
            raise AdapterError(name, f"is not of a declared target module {modules}", key)
        if layer >= config.num_layers:
            raise AdapterError(name, f"names layer {layer}; the base model has "
                               f"{config.num_layers}", key)
        if dtype not in _DTYPES:
            raise AdapterError(name, f"has dtype {dtype}; F32, F16 or BF16 expected", key)
        out_dim, in_dim = shapes[module]
        expected = (rank, in_dim) if which == "A" else (out_dim, rank)
        if shape != expected:
            raise AdapterError(name, f"has shape {shape}, expected {expected} (r={rank}, "
                               f"base {module} [{out_dim}, {in_dim}])", key)
        present.add((layer, module, which))
        num_parameters += math.prod(shape)
    for layer, module, which in sorted(present):
        other = "B" if which == "A" else "A"
        if (layer, module, other) not in present:
            raise AdapterError(name, f"is missing (lora_{which} of the same module is present)",
                               tensor_name(layer, module, other))
    if not present:
        raise AdapterError(name, f"{WEIGHTS_FILE} holds no LoRA tensor")
    targets = tuple(tuple(m for m in modules if (layer, m, "A") in present)
                    for layer in range(config.num_layers))
    return AdapterSpec(rank, alpha, scale, modules, targets, num_parameters)


def _finite(name: str, file, key: str) -> torch.Tensor:
    """Tensor `key` of the open safetensors file as float32; AdapterError naming it when some
    value is not finite."""
    tensor = file.get_tensor(key).float()
    if not bool(torch.isfinite(tensor).all()):
        raise AdapterError(name, "holds values that are not finite (NaN or infinity)", key)
    return tensor


def load_adapter(name: str, directory: str | Path, config: ModelConfig, dtype: torch.dtype,
                 device: torch.device) -> LoraAdapter:
    """Read and check the adapter in `directory` (read_adapter_spec), its tensors laid out per
    fused projection on `device` in `dtype` (see LoraAdapter)."""
    from safetensors import SafetensorError, safe_open

    directory = Path(directory)
    spec = read_adapter_spec(name, directory, config)
    shapes = projection_shapes(config)
    layers = []
    try:
        with safe_open(str(directory / WEIGHTS_FILE), framework="pt") as file:
            for i, targets in enumerate(spec.targets):
                fused = []
                for parts in FUSED_PROJECTIONS:
                    if not any(module in targets for module in parts):
                        fused.append(None)
                        continue
                    a_rows, slices, bs = [], [], []
                    start = 0
                    for module in parts:
                        end = start + shapes[module][0]
                        if module in targets:
                            a_rows.append(_finite(name, file, tensor_name(i, module, "A")))  # [r, in]
                            b = _finite(name, file, tensor_name(i, module, "B"))       # [out_k, r]
                            bs.append((b.t() * spec.scale).to(device=device, dtype=dtype)
                                      .contiguous())                                 # [r, out_k]
                            slices.append((start, end))
                        start = end
                    a = torch.cat(a_rows).to(device=device, dtype=dtype).contiguous()  # [r*P, in]
                    fused.append(ProjectionLora(a, tuple(slices), tuple(bs)))
                layers.append(tuple(fused))
    except (SafetensorError, OSError) as error:
        raise AdapterError(name, f"{WEIGHTS_FILE} could not be read: {error}") from None
    num_bytes = sum(t.numel() * t.element_size() for layer in layers for proj in layer
                    if proj is not None for t in (proj.a, *proj.b_t))
    return LoraAdapter(name, spec, tuple(layers), num_bytes)


def save_adapter(directory: str | Path, rank: int, alpha: float,
                 tensors: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]],
                 use_rslora: bool = False) -> Path:
    """Write an adapter in the PEFT layout: tensors[(layer, module)] = (A [r, in], B [out, r]);
    target_modules are the modules named. Returns `directory` (made if missing)."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    modules = [m for m in TARGET_MODULES if any(module == m for _, module in tensors)]
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": modules,
              "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
              "use_rslora": use_rslora, "task_type": "CAUSAL_LM"}
    (directory / CONFIG_FILE).write_text(json.dumps(config, indent=2), encoding="utf-8")
    flat = {}
    for (layer, module), (a, b) in tensors.items():
        flat[tensor_name(layer, module, "A")] = a.contiguous()
        flat[tensor_name(layer, module, "B")] = b.contiguous()
    save_file(flat, str(directory / WEIGHTS_FILE))
    return directory
