"""bench/cuda_decode_bench.py's code against the CPU engine (tiny shapes, few steps), so that the
benchmark cannot break silently between GPU runs: the random checkpoint it writes loads, the rows
come out for both paths, and the floor's parts compute."""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "bench" / "cuda_decode_bench.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("cuda_decode_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["cuda_decode_bench"] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("cuda_decode_bench", None)


def _tiny(bench):
    return dataclasses.replace(bench.shape_config("smollm2-135m"), num_layers=2, hidden_size=64,
                               intermediate_size=96, num_heads=4, num_kv_heads=2, head_dim=16,
                               vocab_size=300, max_position=256)


def test_the_built_in_shapes_are_the_models(bench):
    llama = bench.shape_config("llama-1b")
    assert (llama.num_layers, llama.hidden_size, llama.num_heads, llama.num_kv_heads,
            llama.head_dim, llama.intermediate_size, llama.vocab_size) == (
        16, 2048, 32, 8, 64, 8192, 128256)
    smol = bench.shape_config("smollm2-135m")
    assert (smol.num_layers, smol.hidden_size, smol.num_heads, smol.num_kv_heads,
            smol.intermediate_size, smol.vocab_size) == (30, 576, 9, 3, 1536, 49152)


def test_rows_run_on_the_cpu_engine(bench, tmp_path):
    config = _tiny(bench)
    path = bench.write_random_checkpoint(config, tmp_path / "tiny", "cpu")
    assert json.loads((path / "config.json").read_text())["num_hidden_layers"] == 2
    rows = bench.run_rows(str(path), "tiny", [1, 3], context=20, steps=2, page_size=16,
                          paths=["eager", "graph"], device="cpu", dtype="float32")
    assert [(r.path, r.batch) for r in rows] == [("eager", 1), ("eager", 3), ("graph", 1),
                                                 ("graph", 3)]
    for row in rows:
        assert row.ms_per_step > 0 and row.tokens_per_s > 0
        assert row.floor_ms is None and row.ratio_to_floor is None       # no floor off CUDA


def test_the_floors_parts_compute_on_the_cpu(bench):
    config = _tiny(bench)
    assert bench.matmul_ms(config, 2, torch.device("cpu"), torch.float32, repeats=2) > 0
    assert bench.copy_bandwidth(torch.device("cpu"), nbytes=2**20, repeats=2) > 0
    # 2 rows x 10 tokens x 2 layers x K,V x 2 heads x 16 dims x 2 bytes
    assert bench.kv_bytes(config, 2, 10, 2) == 2 * 10 * 2 * 2 * 2 * 16 * 2


def test_the_header_names_the_machine(bench):
    info = bench.header()
    assert info["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert info["cpu"] and info["gpu"]


def test_without_cuda_it_exits_1_and_says_so(bench, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.main(["--json"]) == 1
    assert "CUDA is not available" in capsys.readouterr().err
