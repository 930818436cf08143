"""The technique examples (output validation, watermarking, tree / graph / recursion of thought,
hierarchical attention) end to end on the real model, with few tokens each."""
from __future__ import annotations

import math

import pytest

pytestmark = pytest.mark.slow


def test_output_validation_ranks_the_greedy_answer_first(run_inferlet, engine, greedy_oracle):
    prompt = "The capital of France is"
    greedy_id = greedy_oracle([engine.tokenizer.encode(prompt)], 1)[0][0]
    best = engine.tokenizer.decode([greedy_id])
    candidates = [" banana", best, " London"]
    args = ["--prompt", prompt] + [a for c in candidates for a in ("--candidate", c)]
    result = run_inferlet("output_validation", args).json()
    assert result["best"] == best == result["candidates"][0]["text"]
    assert sorted(c["text"] for c in result["candidates"]) == sorted(candidates)
    assert math.isclose(sum(c["probability"] for c in result["candidates"]), 1.0, rel_tol=1e-6)
    assert all(c["log_prob"] <= 0 and 0 < c["per_token"] <= 1 for c in result["candidates"])


def test_watermark_is_detected_and_plain_text_is_not(run_inferlet):
    common = ["--max-tokens", "32", "--gamma", "0.25", "--seed", "3", "--top-k", "40"]
    marked = run_inferlet("watermarking", common + ["--delta", "4"]).json()
    plain = run_inferlet("watermarking", common + ["--delta", "0"]).json()
    assert len(marked["token_ids"]) >= 16 and len(plain["token_ids"]) >= 16
    assert marked["z_score"] > 4 > plain["z_score"]
    assert marked["num_green"] / (len(marked["token_ids"]) - 1) > 0.6
    detected = run_inferlet("watermarking", ["--gamma", "0.25", "--detect", marked["text"]]).json()
    assert detected["z_score"] > 3
    other_key = run_inferlet("watermarking", ["--gamma", "0.25", "--key", "7", "--detect",
                                              marked["text"]]).json()
    assert other_key["z_score"] < 3   # the green lists depend on the key


def test_tree_of_thought_keeps_the_best_rated_steps(run_inferlet, runtime):
    before = runtime.statistics().engine
    result = run_inferlet("tree_of_thought", ["--breadth", "2", "--depth", "2", "--keep", "1",
                                              "--step-tokens", "6"]).json()
    after = runtime.statistics().engine
    assert result["num_nodes"] == 4 and [len(level) for level in result["levels"]] == [2, 2]
    for level in result["levels"]:
        scores = [node["score"] for node in level]
        assert scores == sorted(scores, reverse=True) and all(0 <= s <= 1 for s in scores)
    assert result["best"] == result["levels"][-1][0]["steps"] and len(result["best"]) == 2
    assert result["levels"][1][0]["steps"][0] == result["levels"][0][0]["steps"][0]   # kept parent
    assert after.num_batches - before.num_batches < after.num_requests - before.num_requests


def test_graph_of_thought_merges_proposals_in_stages(run_inferlet):
    result = run_inferlet("graph_of_thought", ["--num-proposals", "3", "--max-tokens", "6"]).json()
    nodes = result["nodes"]
    assert [n["stage"] for n in nodes] == [0, 0, 0, 1, 2]
    assert nodes[3]["parents"] == [0, 1] and nodes[4]["parents"] == [3, 2]
    assert result["answer"] == nodes[4]["text"]
    assert len({n["text"] for n in nodes[:3]}) > 1   # seeded samples differ


def test_recursion_of_thought_answers_subquestions_first(run_inferlet):
    result = run_inferlet("recursion_of_thought", ["--depth", "1", "--split-tokens", "24",
                                                   "--answer-tokens", "8"]).json()
    subproblems = result["subproblems"]
    assert result["question"] == "How can I learn to cook?" and isinstance(result["answer"], str)
    assert len(subproblems) <= 2 and all(s["subproblems"] == [] for s in subproblems)
    assert result["num_calls"] == 1 + len(subproblems) + 1   # split, sub-answers, final answer


def probe(run_inferlet, first_paragraph: str, flat: bool) -> dict[int, float]:
    args = ["--title", "Pets", "--section", f"Cats|{first_paragraph}",
            "--section", "Dogs|Dogs bark at strangers.", "--probe"] + (["--flat"] if flat else [])
    return dict(map(tuple, run_inferlet("hierarchical_attention", args).json()["probe"]))


def test_hierarchical_attention_isolates_paragraphs(run_inferlet, engine):
    first, other = "Cats sleep most of the day.", "Cats hunt most of the night."
    encode = engine.tokenizer.encode
    assert len(encode(f"{first}\n")) == len(encode(f"{other}\n"))   # same positions after it
    masked = [probe(run_inferlet, text, flat=False) for text in (first, other)]
    assert masked[0].keys() == masked[1].keys()
    assert all(math.isclose(masked[0][t], masked[1][t], abs_tol=1e-4) for t in masked[0])
    flat = [probe(run_inferlet, text, flat=True) for text in (first, other)]
    assert any(not math.isclose(flat[0].get(t, 0.0), flat[1].get(t, 0.0), abs_tol=1e-3)
               for t in flat[0])   # without the mask the other section leaks in
    result = run_inferlet("hierarchical_attention", ["--max-tokens", "8"]).json()
    assert result["segments"][-1][1] == result["num_prompt_tokens"]
    assert [kind for _, _, kind in result["segments"]].count("paragraph") == 4
