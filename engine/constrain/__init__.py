"""Constrained decoding and per-generation sampling state.

`GrammarCompiler` turns a `GrammarSpec` (a JSON schema, a regex or a Lark grammar) into a fresh
matcher over the model's vocabulary (llguidance); `GenerationState` is what one generation keeps
between passes: the tokens it produced (for repetition penalties) and its grammar matcher, which
the sampler reads for the token mask and advances with every token it returns.
"""
from engine.constrain.grammar import GRAMMAR_KINDS, GrammarCompiler, GrammarError, GrammarSpec
from engine.constrain.state import GenerationState, GenerationStatus

__all__ = ["GRAMMAR_KINDS", "GrammarCompiler", "GrammarError", "GrammarSpec", "GenerationState",
           "GenerationStatus"]
