"""Decode steps on CUDA against the GPU's own floor: eager and CUDA-graph rows side by side.

    python bench/cuda_decode_bench.py [--model llama-1b|smollm2-135m|PATH] [--batch-sizes 1,64,256]
        [--context 512] [--steps 32] [--json]

The model: a built-in random model of Llama-3.2-1B's shape (16 layers, hidden 2048, 32/8 heads of
64, intermediate 8192, vocab 128256) or SmolLM2-135M's, written as a safetensors checkpoint
(generated on the device, bfloat16) into a temporary directory and loaded like any checkpoint; or
`--model PATH` (a GGUF file or checkpoint directory). For each batch size, and for the engine with
CUDA graphs off (eager) and on (graph): prefill `batch` random prompts of `context` tokens, warm
up, then time `steps` decode steps of the whole batch through `Engine.forward` (greedy sampling,
as the host calls it).

The floor, measured in the same run: the step's matrix products (every layer's QKV, O, gate/up and
down projections plus the lm_head, at this batch size) replayed as one CUDA graph, plus the
step's KV reads (batch x context x layers x 2 x kv heads x head dim x 2 bytes) at the
device-to-device copy bandwidth measured here. Each row prints its ms per step and its ratio to
the floor. Without CUDA it exits with status 1 and says so; `run_rows(..., device="cpu")` runs
the same code on the CPU engine (tests/engine/test_cuda_decode_bench.py).
"""
from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

REPO_DIR = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_DIR))

from engine.batch import GREEDY, ForwardBatch, ForwardRequest  # noqa: E402
from engine.engine_config import ModelConfig  # noqa: E402
from engine.paging import last_page_len, num_pages_needed  # noqa: E402

WARMUP_STEPS = 3
SHAPES = {   # name -> (layers, hidden, heads, kv heads, head dim, intermediate, vocab, tied)
    "llama-1b": (16, 2048, 32, 8, 64, 8192, 128256, True),
    "smollm2-135m": (30, 576, 9, 3, 64, 1536, 49152, True),
}


@dataclass(frozen=True)
class Row:
    """One measured configuration."""

    model: str
    batch: int
    path: str                   # "eager" | "graph"
    ms_per_step: float
    tokens_per_s: float
    floor_ms: float | None
    ratio_to_floor: float | None


def _parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-1b",
                        help=f"{' | '.join(SHAPES)} (random weights) or a model PATH")
    parser.add_argument("--batch-sizes", default="1,16,64,256")
    parser.add_argument("--context", type=int, default=512, help="prompt tokens per sequence")
    parser.add_argument("--steps", type=int, default=32, help="timed decode steps")
    parser.add_argument("--paths", default="eager,graph")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    return parser.parse_args(argv)


def shape_config(name: str) -> ModelConfig:
    layers, hidden, heads, kv_heads, head_dim, inter, vocab, tied = SHAPES[name]
    return ModelConfig(name=f"{name}-shape-random", vocab_size=vocab, hidden_size=hidden,
                       intermediate_size=inter, num_layers=layers, num_heads=heads,
                       num_kv_heads=kv_heads, head_dim=head_dim, max_position=8192,
                       rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=tied)


def write_random_checkpoint(config: ModelConfig, directory: Path, device: str,
                            seed: int = 0) -> Path:
    """A Llama checkpoint directory (config.json + model.safetensors, bfloat16) with random
    weights generated on `device` (std 0.02, norms 1): the model's every shape, gibberish text."""
    from safetensors.torch import save_file

    gen = torch.Generator(device=device).manual_seed(seed)
    hidden, d = config.hidden_size, config.head_dim
    shapes = {"model.embed_tokens.weight": (config.vocab_size, hidden)}
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": (config.num_heads * d, hidden),
            p + "self_attn.k_proj.weight": (config.num_kv_heads * d, hidden),
            p + "self_attn.v_proj.weight": (config.num_kv_heads * d, hidden),
            p + "self_attn.o_proj.weight": (hidden, config.num_heads * d),
            p + "mlp.gate_proj.weight": (config.intermediate_size, hidden),
            p + "mlp.up_proj.weight": (config.intermediate_size, hidden),
            p + "mlp.down_proj.weight": (hidden, config.intermediate_size),
        })
    tensors = {name: (torch.randn(shape, generator=gen, device=device) * 0.02)
               .to(torch.bfloat16).cpu() for name, shape in shapes.items()}
    for i in range(config.num_layers):
        for norm in ("input_layernorm", "post_attention_layernorm"):
            tensors[f"model.layers.{i}.{norm}.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
    tensors["model.norm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps({
        "model_type": "llama", "_name_or_path": config.name, "vocab_size": config.vocab_size,
        "hidden_size": hidden, "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers, "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads, "head_dim": d,
        "max_position_embeddings": config.max_position, "rope_theta": config.rope_theta,
        "rms_norm_eps": config.rms_norm_eps, "tie_word_embeddings": config.tie_word_embeddings,
        "torch_dtype": "bfloat16"}))
    return directory


class Sequences:
    """Page bookkeeping of `batch` sequences decoding side by side (pages fixed up front)."""

    def __init__(self, batch: int, max_len: int, page_size: int) -> None:
        self.page_size = page_size
        pages_each = -(-max_len // page_size)
        self.page_ids = [tuple(range(b * pages_each, (b + 1) * pages_each)) for b in range(batch)]
        self.lengths = [0] * batch

    def request(self, b: int, token_ids: list[int]) -> ForwardRequest:
        start, end = self.lengths[b], self.lengths[b] + len(token_ids)
        self.lengths[b] = end
        return ForwardRequest(
            token_ids=tuple(token_ids), positions=tuple(range(start, end)),
            page_ids=self.page_ids[b][:num_pages_needed(end, self.page_size)],
            last_page_len=last_page_len(end, self.page_size),
            output_indices=(len(token_ids) - 1,), samplers=(GREEDY,))


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _prefill(engine, seqs: Sequences, batch: int, context: int, gen: torch.Generator) -> list[int]:
    """Prefill every sequence (as many per pass as max_batch_tokens allows); last tokens."""
    per_pass = max(1, engine.config.max_batch_tokens // context)
    last_tokens = []
    for first in range(0, batch, per_pass):
        requests = []
        for b in range(first, min(batch, first + per_pass)):
            prompt = torch.randint(100, engine.model_config.vocab_size, (context,), generator=gen)
            requests.append(seqs.request(b, prompt.tolist()))
        results = engine.forward(ForwardBatch(tuple(requests)))
        last_tokens += [r.outputs[0] for r in results]
    return last_tokens


def decode_ms_per_step(engine, batch: int, context: int, steps: int) -> float:
    """Mean wall ms of `steps` greedy decode steps of `batch` sequences after `context` tokens."""
    seqs = Sequences(batch, context + WARMUP_STEPS + steps, engine.page_size)
    tokens = _prefill(engine, seqs, batch, context, torch.Generator().manual_seed(batch))
    elapsed = 0.0
    for step in range(WARMUP_STEPS + steps):
        requests = tuple(seqs.request(b, [tokens[b]]) for b in range(batch))
        _synchronize(engine.device)
        started = time.perf_counter()
        results = engine.forward(ForwardBatch(requests))   # sampled ids come back: a sync point
        if step >= WARMUP_STEPS:
            elapsed += time.perf_counter() - started
        tokens = [r.outputs[0] for r in results]
    return 1000 * elapsed / steps


def copy_bandwidth(device: torch.device, nbytes: int = 2**30, repeats: int = 10) -> float:
    """Device-to-device copy bandwidth, bytes/s (each byte read once and written once: the
    rate counts the bytes read)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    _synchronize(device)
    started = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    _synchronize(device)
    return nbytes * repeats / (time.perf_counter() - started)


def matmul_ms(config: ModelConfig, batch: int, device: torch.device, dtype: torch.dtype,
              repeats: int = 20) -> float:
    """One step's matrix products at `batch` rows (every layer's 4 projections + the lm_head),
    in one CUDA graph on CUDA (plain calls elsewhere): mean ms per replay."""
    hidden, d = config.hidden_size, config.head_dim
    qkv = (config.num_heads + 2 * config.num_kv_heads) * d
    shapes = [(qkv, hidden), (hidden, config.num_heads * d),
              (2 * config.intermediate_size, hidden), (hidden, config.intermediate_size)]
    weights = [[torch.randn(shape, device=device, dtype=dtype) * 0.02 for shape in shapes]
               for _ in range(config.num_layers)]
    lm_head = torch.randn(config.vocab_size, hidden, device=device, dtype=dtype) * 0.02
    x = torch.randn(batch, hidden, device=device, dtype=dtype)
    wide = torch.randn(batch, max(config.intermediate_size, config.num_heads * d), device=device,
                       dtype=dtype)

    def step() -> None:
        for w_qkv, w_o, w_gate_up, w_down in weights:
            torch.nn.functional.linear(x, w_qkv)
            torch.nn.functional.linear(wide[:, :w_o.shape[1]], w_o)
            torch.nn.functional.linear(x, w_gate_up)
            torch.nn.functional.linear(wide[:, :w_down.shape[1]], w_down)
        torch.nn.functional.linear(x, lm_head)

    run = step
    if device.type == "cuda":
        step()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        run = graph.replay
    run()
    _synchronize(device)
    started = time.perf_counter()
    for _ in range(repeats):
        run()
    _synchronize(device)
    return 1000 * (time.perf_counter() - started) / repeats


def kv_bytes(config: ModelConfig, batch: int, context: int, element_size: int) -> int:
    """The KV cache a decode step reads: every sequence's K and V in every layer."""
    return (batch * context * config.num_layers * 2 * config.num_kv_heads * config.head_dim
            * element_size)


def floor_ms(config: ModelConfig, batch: int, context: int, device: torch.device,
             dtype: torch.dtype, bandwidth: float) -> float:
    """The step's matrix products in one graph + its KV reads at the copy bandwidth."""
    element_size = torch.empty((), dtype=dtype).element_size()
    return (matmul_ms(config, batch, device, dtype)
            + 1000 * kv_bytes(config, batch, context, element_size) / bandwidth)


def load(mode: str, path: str, *, device: str, dtype: str, num_pages: int, page_size: int,
         batch_sizes: tuple[int, ...]):
    """An engine over the checkpoint / GGUF at `path` for one path: "eager" (CUDA graphs off) or
    "graph" (on, captured for exactly these batch sizes)."""
    from engine import load_engine

    return load_engine(path, device=device, dtype=dtype, num_pages=num_pages, page_size=page_size,
                       progress=False, seed=0, cuda_graphs=mode == "graph",
                       cuda_graph_batch_sizes=tuple(sorted(set(batch_sizes))))


def run_rows(model_path: str, model_name: str, batch_sizes: list[int], context: int, steps: int,
             page_size: int, paths: list[str], device: str = "cuda",
             dtype: str = "bfloat16") -> list[Row]:
    """Every (path, batch) row of one model; on CUDA the floor of each batch size is measured
    once, while the first engine is loaded (elsewhere there is no floor: None)."""
    torch_device = torch.device(device)
    pages_each = -(-(context + WARMUP_STEPS + steps) // page_size)
    num_pages = max(batch_sizes) * pages_each
    floors: dict[int, float | None] = {b: None for b in batch_sizes}
    bandwidth = copy_bandwidth(torch_device) if torch_device.type == "cuda" else None
    rows = []
    for path in paths:
        engine = load(path, model_path, device=device, dtype=dtype, num_pages=num_pages,
                      page_size=page_size, batch_sizes=tuple(batch_sizes))
        if bandwidth is not None and floors[batch_sizes[0]] is None:
            floors = {b: floor_ms(engine.model_config, b, context, torch_device, engine.dtype,
                                  bandwidth) for b in batch_sizes}
        for batch in batch_sizes:
            ms = decode_ms_per_step(engine, batch, context, steps)
            floor = floors[batch]
            rows.append(Row(model_name, batch, path, ms, 1000 * batch / ms, floor,
                            None if floor is None else ms / floor))
        del engine
        if torch_device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def header() -> dict[str, str]:
    """The machine: CPU model (lscpu), torch's CPU capability, GPU name, versions."""
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        cpu = next((line.split(":", 1)[1].strip() for line in lscpu.splitlines()
                    if line.startswith("Model name")), platform.processor())
    except OSError:
        cpu = platform.processor()
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
    return {"cpu": cpu, "cpu_capability": torch.backends.cpu.get_cpu_capability(), "gpu": gpu,
            "torch": torch.__version__, "cuda": str(torch.version.cuda)}


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    if not torch.cuda.is_available():
        print("cuda_decode_bench: CUDA is not available on this machine (torch "
              f"{torch.__version__}, CUDA build {torch.version.cuda or 'none'}); this benchmark "
              "needs an NVIDIA GPU and `pip install 'pie-serve[cuda]'`.", file=sys.stderr)
        return 1
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    paths = args.paths.split(",")
    info = header()
    with tempfile.TemporaryDirectory(prefix="pie-bench-") as scratch:
        if args.model in SHAPES:
            model_path = str(write_random_checkpoint(shape_config(args.model),
                                                     Path(scratch) / args.model, "cuda"))
            model_name = f"{args.model} shape (random)"
        else:
            model_path, model_name = args.model, Path(args.model).name
        rows = run_rows(model_path, model_name, batch_sizes, args.context, args.steps,
                        args.page_size, paths)
    if args.json:
        print(json.dumps({"header": info, "context": args.context, "steps": args.steps,
                          "rows": [asdict(row) for row in rows]}))
        return 0
    print(f"cpu: {info['cpu']} ({info['cpu_capability']})  gpu: {info['gpu']}  "
          f"torch {info['torch']} cuda {info['cuda']}")
    print(f"model: {model_name}  context {args.context}  steps {args.steps}  "
          f"page_size {args.page_size}")
    print(f"{'batch':>5} {'floor ms':>9} " + " ".join(
        f"{p + ' ms':>9} {'x floor':>8} {'tok/s':>9}" for p in paths))
    for batch in batch_sizes:
        cells = {row.path: row for row in rows if row.batch == batch}
        floor = next(iter(cells.values())).floor_ms
        line = f"{batch:>5} {floor:>9.3f} "
        line += " ".join(f"{cells[p].ms_per_step:>9.3f} {cells[p].ratio_to_floor:>7.2f}x "
                         f"{cells[p].tokens_per_s:>9.0f}" for p in paths)
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
