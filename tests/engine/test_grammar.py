"""Constrained decoding, log-probabilities, penalties and draft verification on the real model
(SmolLM2-135M-Instruct, float32), driven straight on the engine (tests/engine/decode_loop.py)."""
from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest
import torch

from engine.batch import SamplerSpec, TokenLogprobs
from engine.constrain import GenerationState, GrammarError, GrammarSpec
from tests.engine.decode_loop import DecodeLoop, generate, generate_drafted

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0,
                                                         "maximum": 150},
    "city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]}},
    "required": ["name", "age", "city"], "additionalProperties": False}


@pytest.fixture(scope="module")
def engine(one_torch_thread):
    from engine.engine import load_default_engine
    return load_default_engine(progress=False, seed=0, dtype="float32")


def chat(engine, text: str) -> list[int]:
    return engine.tokenizer.encode(engine.tokenizer.render_chat(
        [{"role": "user", "content": text}], True))


def constrained_text(engine, prompt: str, grammar: GrammarSpec, spec: SamplerSpec,
                     max_tokens: int = 60) -> str:
    state = GenerationState(engine.grammar.matcher(grammar))
    spec = SamplerSpec(**{**spec.__dict__, "state": state})
    outputs = generate(engine, chat(engine, prompt), spec, max_tokens,
                       engine.tokenizer.stop_token_ids)
    assert state.status().accepting, engine.tokenizer.decode(outputs)
    return engine.tokenizer.decode([t for t in outputs if t not in engine.tokenizer.stop_token_ids])


def test_json_schema_output_parses_and_validates_for_every_seed(engine) -> None:
    grammar = GrammarSpec("json_schema", json.dumps(PERSON))
    for seed in range(8):
        spec = SamplerSpec("sample", temperature=1.2, seed=seed)
        text = constrained_text(engine, "Describe a person as JSON.", grammar, spec)
        value = json.loads(text)
        assert set(value) == {"name", "age", "city"}
        assert isinstance(value["name"], str) and len(value["name"]) <= 20
        assert isinstance(value["age"], int) and 0 <= value["age"] <= 150
        assert value["city"] in ("Paris", "London", "Tokyo")


def test_regex_output_matches(engine) -> None:
    pattern = r"[0-9]{3}-[0-9]{4}"
    for seed in range(4):
        text = constrained_text(engine, "Give me a phone number.", GrammarSpec("regex", pattern),
                                SamplerSpec("sample", temperature=1.0, seed=seed), 20)
        assert re.fullmatch(pattern, text), text


def test_lark_grammar_output_matches(engine) -> None:
    lark = 'start: "The answer is " ANSWER "."\nANSWER: "yes" | "no"'
    text = constrained_text(engine, "Is the sky blue?", GrammarSpec("lark", lark), SamplerSpec(), 20)
    assert text in ("The answer is yes.", "The answer is no.")


def test_bad_grammars_are_refused_with_the_cause(engine) -> None:
    with pytest.raises(GrammarError, match="JSON"):
        engine.grammar.matcher(GrammarSpec("json_schema", "{not json"))
    with pytest.raises(GrammarError):
        engine.grammar.matcher(GrammarSpec("lark", "start: undefined_rule"))
    with pytest.raises(GrammarError, match="kind"):
        GrammarSpec("yaml", "x")


def test_logprobs_equal_log_softmax_of_float32_logits(engine) -> None:
    prompt = chat(engine, "Name a colour.")
    spec = SamplerSpec("sample", temperature=0.8, seed=3, num_logprobs=5)
    outputs = generate(engine, prompt, spec, 4)
    assert all(isinstance(o, TokenLogprobs) for o in outputs)
    context = list(prompt)
    for output in outputs:
        expected = torch.log_softmax(engine.prompt_logits(context).float(), dim=-1)
        assert output.logprob == pytest.approx(float(expected[output.token_id]), abs=2e-4)
        top_values, top_ids = expected.topk(5)
        assert list(output.top_token_ids) == top_ids.tolist()
        assert list(output.top_logprobs) == pytest.approx(top_values.tolist(), abs=2e-4)
        context.append(output.token_id)


def test_entropy_probe_matches_the_distribution(engine) -> None:
    prompt = chat(engine, "Name a colour.")
    entropy = DecodeLoop(engine, prompt).step(SamplerSpec("entropy"))
    log_probs = torch.log_softmax(engine.prompt_logits(prompt).double(), dim=-1)
    assert entropy == pytest.approx(float(-(log_probs.exp() * log_probs).sum()), rel=1e-4)


def test_frequency_penalty_removes_repeats_and_bias_forces_tokens(engine) -> None:
    prompt = engine.tokenizer.encode("one one one one one one one one")
    plain = generate(engine, prompt, SamplerSpec(state=GenerationState()), 12)
    penalized = generate(engine, prompt, SamplerSpec(frequency_penalty=2.0, presence_penalty=2.0,
                                                     state=GenerationState()), 12)
    def max_count(tokens: list[int]) -> int:
        return max(tokens.count(t) for t in tokens)
    assert max_count(plain) > 3                       # the model repeats itself
    assert max_count(penalized) < max_count(plain)
    target = engine.tokenizer.encode(" banana")[0]
    biased = generate(engine, prompt, SamplerSpec(logit_bias=((target, 100.0),)), 3)
    assert biased == [target] * 3
    allowed = generate(engine, prompt, SamplerSpec("sample", seed=1,
                                                   allowed_token_ids=(target, target + 1)), 5)
    assert set(allowed) <= {target, target + 1}


def _prompt_lookup():
    spec = importlib.util.spec_from_file_location(
        "drafting", REPO / "inferlets" / "sdk" / "inferlet" / "drafting.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.PromptLookupDrafter(num_drafts=5)


def test_drafted_greedy_equals_plain_greedy_token_for_token(engine) -> None:
    text = ("Rewrite exactly: The quick brown fox jumps over the lazy dog while the cat "
            "sleeps on the warm mat near the door.")
    prompt = chat(engine, text)
    plain = generate(engine, prompt, SamplerSpec(), 40)
    drafted, accepted = generate_drafted(engine, prompt, SamplerSpec(), 40, _prompt_lookup())
    assert drafted == plain
    assert accepted and max(accepted) >= 2            # the drafter found copied spans


def test_drafted_sampling_with_a_seed_is_reproducible_and_in_distribution(engine) -> None:
    prompt = chat(engine, "Repeat: red green blue red green blue")
    spec = SamplerSpec("sample", temperature=0.7, top_k=5, seed=7)
    first, _ = generate_drafted(engine, prompt, spec, 16, _prompt_lookup())
    again, _ = generate_drafted(engine, prompt, spec, 16, _prompt_lookup())
    assert first == again
    context = list(prompt)
    for token in first:                                # every token is in its row's top-5
        top5 = engine.prompt_logits(context).topk(5).indices.tolist()
        assert token in top5
        context.append(token)
