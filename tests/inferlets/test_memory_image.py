"""A Python inferlet on the host's counted memories, as `pie run` and `pie serve` run it: its
heap image is taken out of its data segments when it is loaded and copied in by the memory
creator (host/sandbox/programs/memory_image.py), into a fresh memory and into pooled ones, with the same
results as on Wasmtime's own copy-on-write memories."""
from __future__ import annotations

import pytest

from tests.inferlets.conftest import CACHE_DIR

pytestmark = pytest.mark.slow

ARGS = ["--prompt", "The three primary colours are", "--max-tokens", "12", "--json"]


def test_counted_memories_start_from_the_image_and_match_copy_on_write(engine, component_path):
    from host.runtime import Runtime
    from host.runtime_config import RuntimeConfig
    wasm = component_path("text_completion").read_bytes()
    with Runtime(engine, RuntimeConfig(cache_dir=CACHE_DIR, count_linear_memory=False)) as cow:
        expected = cow.wait(cow.launch(cow.load_program(wasm), ARGS), timeout=240)
        assert expected.status == "ok", expected.value
        assert cow.load_program(wasm).memory_image is None     # copy-on-write: left whole
    config = RuntimeConfig(cache_dir=CACHE_DIR, count_linear_memory=True, memory_pool_mb=256)
    with Runtime(engine, config) as counted:
        program = counted.load_program(wasm)
        image = program.memory_image
        assert image is not None and image.num_bytes % (64 << 10) == 0
        assert 8 << 20 < len(image.data) <= image.num_bytes      # CPython's heap, ~11 MB
        for _ in range(3):                        # a fresh memory, then pooled ones
            outcome = counted.wait(counted.launch(program, ARGS), timeout=240)
            assert (outcome.status, outcome.value) == ("ok", expected.value)
        assert counted.statistics().pages.num_used == 0
