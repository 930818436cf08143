"""The surface of the engine that the host relies on, as Protocols.

The real `engine.Engine` implements `EngineLike`; host tests use a fake engine that does too.
Nothing else of the engine is visible to `host/`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

from engine.batch import ForwardBatch, ForwardResult, TokenCopy
from engine.engine_config import ModelConfig


class TokenizerLike(Protocol):
    """Text <-> token ids for one model, plus its chat template."""

    vocab_size: int
    stop_token_ids: tuple[int, ...]   # EOS / end-of-turn tokens that end a generation
    chat_template: str                # the raw jinja2 template text ("" when the model has none)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...
    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str: ...
    def token_strings(self) -> list[str]: ...  # the vocabulary, index = token id
    def render_chat(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> str: ...


@dataclass(frozen=True)
class EngineStats:
    """Counters since the engine was built; tests and /metrics read them."""

    num_batches: int = 0
    num_requests: int = 0
    num_input_tokens: int = 0      # tokens whose KV was computed (prefill + decode)
    num_output_tokens: int = 0     # outputs sampled or distributions returned
    num_copied_tokens: int = 0


class PageData(Protocol):
    """Pages copied out of the KV cache (`EngineLike.read_pages`): opaque to the host but for
    their size in host memory."""

    @property
    def nbytes(self) -> int: ...


class EngineLike(Protocol):
    """What the host needs: page geometry, a batched forward pass, KV copies, a tokenizer.

    Calls are made from one thread at a time (the host's engine thread, or a thread holding the
    scheduler's engine for a page swap: BatchScheduler.run_exclusive); the engine does not lock.
    `forward` raises ValueError naming the request index and field for malformed input and stays
    usable for the next batch.
    """

    model_name: str
    model_config: ModelConfig
    page_size: int
    num_pages: int
    kv_page_nbytes: int               # host bytes of one page read out by read_pages
    tokenizer: TokenizerLike

    def forward(self, batch: ForwardBatch) -> list[ForwardResult]: ...
    def copy_tokens(self, copies: Sequence[TokenCopy]) -> None: ...
    # Whole pages out to host memory and back (suspension, host/kv/swap.py): read_pages returns
    # an opaque value with `nbytes`; write_pages puts it into the same number of other pages.
    def read_pages(self, page_ids: Sequence[int]) -> PageData: ...
    def write_pages(self, page_ids: Sequence[int], data: PageData) -> None: ...
    def statistics(self) -> EngineStats: ...
