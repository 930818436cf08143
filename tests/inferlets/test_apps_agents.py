"""The agent examples (ReAct, CodeAct, swarm) and the KV-sharing examples (prefix tree, attention
sink) end to end on the real model, with few tokens each."""
from __future__ import annotations

import json
import math
import threading
import time
import uuid

import pytest

from tests.inferlets.conftest import RUN_TIMEOUT_S, truncate_at_stop

pytestmark = pytest.mark.slow


def computed_tokens(runtime, run):
    """(what `run()` returned, the tokens the engine computed meanwhile)."""
    before = runtime.statistics().engine.num_input_tokens
    result = run()
    return result, runtime.statistics().engine.num_input_tokens - before


def test_prefix_tree_computes_each_shared_prefix_once(run_inferlet, runtime, engine, greedy_oracle):
    root, levels, num_tokens = "Write about nature.\n", [["A:", "B:"], [" x", " y"], [" 1\n", " 2\n"]], 6
    args = ["--root", root, "--max-tokens", str(num_tokens)]
    for texts in levels:
        args += ["--level", "|".join(texts)]
    result, num_computed = computed_tokens(runtime, lambda: run_inferlet("prefix_tree", args).json())
    leaves, encode = result["leaves"], engine.tokenizer.encode
    assert len(leaves) == 8 and len({tuple(leaf["path"]) for leaf in leaves}) == 8
    prompts = [encode(root) + [t for text in leaf["path"] for t in encode(text)] for leaf in leaves]
    expected = greedy_oracle(prompts, num_tokens)
    for leaf, want in zip(leaves, expected):
        assert leaf["token_ids"] == truncate_at_stop(want, engine.tokenizer.stop_token_ids)
    node_tokens = len(encode(root)) + sum(len(encode(t)) * 2 ** (depth - 1)
                                          for depth, texts in enumerate(levels, 1) for t in texts)
    assert result["num_node_tokens"] == node_tokens < sum(map(len, prompts))
    stopped_early = sum(len(leaf["token_ids"]) < num_tokens for leaf in leaves)
    decode_inputs = sum(len(leaf["token_ids"]) - 1 for leaf in leaves) + stopped_early
    assert num_computed == node_tokens + decode_inputs


def test_attention_sink_reads_a_long_input_with_bounded_pages(run_inferlet, runtime, engine):
    sink, window = 4, 32
    result = run_inferlet("attention_sink", ["--num-chunks", "10", "--sink", str(sink), "--window",
                                             str(window), "--max-tokens", "20"]).json()
    page_size = engine.page_size
    num_slots = result["num_input_tokens"] + result["num_generated"]
    chunk = result["num_input_tokens"] // 10
    bound = 1 + math.ceil((window + chunk) / page_size) + 1   # sink page, window + a chunk, tail
    assert result["max_pages"] <= bound < math.ceil(num_slots / page_size)
    assert result["num_pages_freed"] >= math.ceil(num_slots / page_size) - bound
    assert result["num_generated"] > 0 and result["text"]
    assert runtime.statistics().pages.num_used == 0


def test_react_keeps_kv_across_tool_calls_and_reuses_the_system_prefix(run_inferlet, runtime):
    name = f"test/react/{uuid.uuid4().hex}"
    args = ["--num-calls", "2", "--delay-ms", "150", "--turn-tokens", "4", "--system-export", name]
    start = time.monotonic()
    first, first_tokens = computed_tokens(runtime, lambda: run_inferlet("react", args).json())
    elapsed_s = time.monotonic() - start
    second, second_tokens = computed_tokens(runtime, lambda: run_inferlet("react", args + ["--release"]).json())
    assert elapsed_s >= 2 * 0.150   # the tool delays really ran
    assert len(first["turns"]) == 2 and first["observations"] == [
        "Observation 1: the search found one more useful fact.",
        "Observation 2: the search found one more useful fact."]
    # Nothing is recomputed: every token of the context but the last sampled one, once.
    assert first_tokens == first["num_context_tokens"] - 1
    assert not first["imported"] and second["imported"] and second["turns"] == first["turns"]
    num_system_tokens = first_tokens - second_tokens
    assert num_system_tokens > 16 and second["num_context_tokens"] == first["num_context_tokens"]
    assert runtime.statistics().pages.num_used == 0   # the export was released


class ToolSide:
    """The client's tools for react.py --tool client: each call answered from its own thread
    after `delay_s`, the call's start (message received) and end (answer sent) recorded."""

    def __init__(self, runtime, delay_s: float) -> None:
        self.runtime, self.delay_s = runtime, delay_s
        self.calls: list[dict] = []
        self.spans: dict[int, tuple[float, float]] = {}

    def on_message(self, instance_id: str, message: str) -> None:
        call, start = json.loads(message), time.monotonic()
        self.calls.append(call)
        threading.Thread(target=self.answer, args=(instance_id, call["id"], start)).start()

    def answer(self, instance_id: str, call_id: int, start: float) -> None:
        time.sleep(self.delay_s)
        self.spans[call_id] = (start, time.monotonic())
        self.runtime.send(instance_id, json.dumps({"id": call_id, "content": f"fact {call_id}"}))


def test_react_runs_the_tool_calls_of_a_turn_concurrently(run_inferlet, runtime):
    tools = ToolSide(runtime, delay_s=0.3)
    result = run_inferlet("react", ["--tool", "client", "--num-calls", "6", "--calls-per-turn", "4",
                                    "--turn-tokens", "4"], on_message=tools.on_message).json()
    assert len(result["turns"]) == 2 and [c["id"] for c in tools.calls] == list(range(6))
    assert all(c["type"] == "tool_call" and c["name"] == "search" for c in tools.calls)
    assert result["observations"] == [f"Observation {i + 1}: fact {i}" for i in range(6)]
    first, second = [tools.spans[i] for i in range(4)], [tools.spans[i] for i in (4, 5)]
    # Every call of a turn was running while every other one was: all started before any ended.
    assert max(start for start, _ in first) < min(end for _, end in first)
    assert max(start for start, _ in second) < min(end for _, end in second)
    # The next turn's calls follow the observations of the previous turn's.
    assert min(start for start, _ in second) > max(end for _, end in first)


def test_react_rejects_an_answer_to_no_pending_call(run_inferlet, runtime):
    def on_message(instance_id: str, message: str) -> None:
        runtime.send(instance_id, json.dumps({"id": json.loads(message)["id"] + 7, "content": "x"}))
    run = run_inferlet("react", ["--tool", "client", "--num-calls", "1", "--turn-tokens", "2"],
                       on_message=on_message)
    assert run.status == "error" and "tool answer id 7 is not a pending call [0]" in run.value


def test_react_simulated_calls_of_a_turn_share_one_observation_turn(run_inferlet, runtime):
    args = ["--num-calls", "5", "--calls-per-turn", "2", "--delay-ms", "1", "--turn-tokens", "3"]
    result, num_computed = computed_tokens(runtime, lambda: run_inferlet("react", args).json())
    assert len(result["turns"]) == 3 and len(result["observations"]) == 5
    assert result["observations"][4] == "Observation 5: the search found one more useful fact."
    assert num_computed == result["num_context_tokens"] - 1   # nothing recomputed


def test_codeact_runs_only_arithmetic(run_inferlet):
    def run(code: str) -> dict:
        return run_inferlet("codeact", ["--run", code]).json()
    assert run("Let me compute (17 + 25) * 3 now") == {"action": "(17 + 25) * 3", "observation": "Output: 126"}
    assert run("7 / 2")["observation"] == "Output: 3.5"
    assert run("2 ** 1000")["observation"] == "Output: error: ValueError"
    assert run("1 / 0")["observation"] == "Output: error: ZeroDivisionError"
    assert run("__import__('os').system('x')")["observation"] == "Output: error: no arithmetic expression"
    assert run("(1 + 2")["observation"] == "Output: error: SyntaxError"


def test_codeact_agent_observes_its_own_code(run_inferlet):
    result = run_inferlet("codeact", ["--task", "What is (17 + 25) * 3? Write the expression.",
                                      "--num-calls", "2", "--turn-tokens", "12"]).json()
    assert len(result["turns"]) == len(result["actions"]) == len(result["observations"]) == 2
    for action, observation in zip(result["actions"], result["observations"]):
        if action and "error" not in observation:
            assert observation == f"Output: {eval(action)}"   # the host's Python agrees
    assert result["num_generated"] > 0


def test_codeact_runs_several_actions_a_turn(run_inferlet):
    result = run_inferlet("codeact", ["--task", "Write (1 + 2) * 3 and 4 * 5 and 6 - 1.",
                                      "--num-calls", "3", "--calls-per-turn", "2",
                                      "--turn-tokens", "16"]).json()
    assert len(result["turns"]) == 2 and len(result["actions"]) == len(result["observations"]) == 3
    for action, observation in zip(result["actions"], result["observations"]):
        if not action:
            assert observation == "Output: error: no arithmetic expression"
        elif "error" not in observation:
            value = eval(action)   # the host's Python agrees
            assert observation == (f"Output: {value:g}" if isinstance(value, float) else f"Output: {value}")


def test_swarm_roles_pass_messages_over_broadcast(runtime, program):
    roles, team = ["planner", "writer", "critic"], f"t{uuid.uuid4().hex[:8]}"
    swarm = program("swarm")
    instance_ids = [runtime.launch(swarm, ["--roles", ",".join(roles), "--role", role, "--team", team,
                                           "--rounds", "2", "--turn-tokens", "4"]) for role in roles]
    outcomes = [runtime.wait(i, timeout=RUN_TIMEOUT_S) for i in instance_ids]
    assert all(o.status == "ok" for o in outcomes), [o.value for o in outcomes]
    planner, writer, critic = (json.loads(o.value) for o in outcomes)
    assert writer["received"] == planner["sent"] and critic["received"] == writer["sent"]
    assert planner["received"] == critic["sent"][:1] and len(critic["sent"]) == 2
    assert all(m.startswith("planner: ") for m in planner["sent"])
