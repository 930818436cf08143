"""LoRA adapters through the WIT and the SDK: an inferlet's Context(adapter=...) generates what
the engine gives that adapter directly, a per-call `adapter=None` what the base model gives."""
from __future__ import annotations

import json

import pytest

from engine.adapters.peft import save_adapter
from tests.engine.test_adapters import random_tensors

PROMPT = [1, 504, 3158, 2391, 8162, 359]
NUM_TOKENS = 6


@pytest.fixture(scope="module")
def adapter_name(engine, tmp_path_factory):
    tensors = random_tensors(engine.model_config, 8, ("q_proj", "v_proj", "down_proj"), 11)
    path = save_adapter(tmp_path_factory.mktemp("lora") / "probe-lora", 8, 16, tensors)
    engine.adapters.register("probe-lora", path)
    return "probe-lora"


def test_an_inferlet_generates_with_its_adapter(run_inferlet, engine, runtime, adapter_name):
    run = run_inferlet("adapter_probe", ["generate", adapter_name, str(NUM_TOKENS),
                                         *map(str, PROMPT)])
    got = run.json()
    expected = engine.generate_greedy_batch([PROMPT, PROMPT], NUM_TOKENS,
                                            adapters=[adapter_name, None])
    assert got["adapter"] == expected[0]
    assert got["base"] == expected[1] and got["override"] == expected[1]
    assert got["adapter"] != got["base"]
    assert got["bound_after"] == adapter_name       # the override ended with the call


def test_available_and_unknown_adapters(run_inferlet, adapter_name):
    assert adapter_name in run_inferlet("adapter_probe", ["available"]).json()
    run = run_inferlet("adapter_probe", ["unknown", "no-such-adapter"])
    assert run.status == "ok" and run.value.startswith("refused:") and "no adapter" in run.value


def test_pie_run_opens_the_adapters_it_is_given(tmp_path, engine, cli_env, component_path):
    """`pie run --adapter NAME=PATH`: the inferlet lists NAME; a bad adapter stops the run
    before it starts, naming the adapter and the tensor at fault."""
    import subprocess
    import sys

    from tests.inferlets.conftest import REPO

    tensors = random_tensors(engine.model_config, 4, ("o_proj",), 5)
    good = save_adapter(tmp_path / "good", 4, 8, tensors)
    a, b = tensors[(2, "o_proj")]
    tensors[(2, "o_proj")] = (a, b[:, :2].contiguous())
    bad = save_adapter(tmp_path / "bad", 4, 8, tensors)
    wasm = str(component_path("adapter_probe"))

    def pie(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "host.cli", "run", wasm, *args], cwd=REPO,
                              env=cli_env, capture_output=True, text=True, timeout=300,
                              stdin=subprocess.DEVNULL)

    done = pie("--adapter", f"mine={good}", "--", "available")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == ["mine"]
    refused = pie("--adapter", f"mine={bad}", "--", "available")
    assert refused.returncode == 1
    assert "adapter 'mine'" in refused.stderr and "layers.2.self_attn.o_proj.lora_B" in refused.stderr
