"""Grammars over the model's vocabulary, with llguidance.

llguidance, not xgrammar: both compute a step's mask in far less time than a decode step takes;
llguidance installs with no dependency (xgrammar needs torch, transformers, triton) and reads
Lark grammars, regexes and JSON schemas directly.
"""
from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Any, Sequence

import llguidance

__all__ = ["GRAMMAR_KINDS", "GrammarSpec", "GrammarError", "GrammarCompiler", "MAX_GRAMMAR_CHARS"]

GRAMMAR_KINDS = ("json_schema", "regex", "lark")
MAX_GRAMMAR_CHARS = 65536


class GrammarError(ValueError):
    """A grammar that does not parse or compile; the message says why."""


@dataclass(frozen=True)
class GrammarSpec:
    """A grammar: kind "json_schema" (a JSON schema text; "{}" or {"type": "object"} for any
    JSON object), "regex" (the whole output matches it) or "lark" (a Lark/EBNF grammar whose
    `start` rule the whole output matches)."""

    kind: str
    source: str

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise GrammarError(f"grammar kind must be one of {GRAMMAR_KINDS}, got {self.kind!r}")
        if not isinstance(self.source, str) or not 0 < len(self.source) <= MAX_GRAMMAR_CHARS:
            raise GrammarError(f"a {self.kind} grammar must be 1..{MAX_GRAMMAR_CHARS} characters")

    def to_llguidance(self) -> str:
        """The grammar in llguidance's own format (GrammarError for a bad JSON schema text)."""
        if self.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.source)
        if self.kind == "lark":
            return llguidance.LLMatcher.grammar_from_lark(self.source)
        try:
            schema = json.loads(self.source)
        except json.JSONDecodeError as exc:
            raise GrammarError(f"json_schema is not valid JSON: {exc}") from None
        if not isinstance(schema, (dict, bool)):
            raise GrammarError("json_schema must be a JSON object")
        return llguidance.LLMatcher.grammar_from_json_schema(
            json.dumps(schema), defaults={"whitespace_flexible": False})


class _ByteTokenizer:
    """What llguidance.TokenizerWrapper reads: every token's bytes, an encoder, the EOS."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.eos_token_id = tokenizer.stop_token_ids[0] if tokenizer.stop_token_ids else 0
        self.bos_token_id = None
        num_known = min(vocab_size, tokenizer.vocab_size)
        self.tokens = [tokenizer.token_bytes(i) for i in range(num_known)]
        self.tokens += [b""] * (vocab_size - num_known)     # padding rows of a larger lm_head
        self.special_token_ids = list(tokenizer.stop_token_ids)
        self._tokenizer = tokenizer

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tokenizer.encode(text)


class GrammarCompiler:
    """Builds matchers for one model's vocabulary. Thread-safe; the llguidance tokenizer (slow to
    build) is made on first use. Stop tokens end a finished grammar."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._tokenizer = tokenizer
        self._lock = threading.Lock()
        self._ll_tokenizer: llguidance.LLTokenizer | None = None

    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._ll_tokenizer is None:
                wrapper = llguidance.TokenizerWrapper(_ByteTokenizer(self._tokenizer, self.vocab_size))
                self._ll_tokenizer = llguidance.LLTokenizer(
                    wrapper, n_vocab=self.vocab_size,
                    eos_token=list(self._tokenizer.stop_token_ids) or None)
            return self._ll_tokenizer

    def matcher(self, spec: GrammarSpec) -> llguidance.LLMatcher:
        """A fresh matcher at the start of `spec`'s grammar; GrammarError naming the problem."""
        try:
            grammar = spec.to_llguidance()
        except (ValueError, TypeError) as exc:
            raise GrammarError(f"{spec.kind}: {exc}") from None
        matcher = llguidance.LLMatcher(self.ll_tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"{spec.kind}: {matcher.get_error()}")
        return matcher

    def encode_ok(self, spec: GrammarSpec, token_ids: Sequence[int]) -> bool:
        """True when `token_ids` are a complete match of the grammar (for tests and checks)."""
        matcher = self.matcher(spec)
        return matcher.consume_tokens(list(token_ids)) and matcher.is_accepting()
