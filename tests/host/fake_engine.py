"""A deterministic, page-accurate stand-in for the engine, for host tests and host benchmarks.

It implements `engine.protocol.EngineLike` without tensors: each physical page records which token
id sits in each slot; `copy_tokens` copies those records; a pass writes its tokens into its tail
slots and each output is a function of the token ids the position attends to (causal, ANDed with the
mask rows), so a sharing, copy-on-write or masking bug shows up as a different output. Outputs are
printable ASCII byte tokens (32..126), never a stop token, so decoded text is readable.

Usable outside pytest: `from tests.host.fake_engine import FakeEngine` (run from the repo root).
"""
from __future__ import annotations

import time
from dataclasses import replace
from typing import Sequence

from engine.batch import Distribution, ForwardBatch, ForwardRequest, ForwardResult, TokenCopy
from engine.engine_config import ModelConfig
from engine.errors import RequestError
from engine.paging import kv_len
from engine.protocol import EngineStats

__all__ = ["FakeEngine", "FakePages", "FakeTokenizer", "fake_next_token", "EMPTY_SLOT"]

EMPTY_SLOT = -1            # a slot never written
_HASH_MOD = (1 << 61) - 1
_FIRST_OUTPUT, _NUM_OUTPUTS = 32, 95   # printable ASCII


def fake_next_token(context_token_ids: Sequence[int], seed: int = 0) -> int:
    """The token the fake model emits after attending to exactly `context_token_ids` (in kv order;
    EMPTY_SLOT for unwritten slots)."""
    value = 1469598103934665603 ^ seed
    for token_id in context_token_ids:
        value = (value * 1099511628211 + token_id + 7) % _HASH_MOD
    return _FIRST_OUTPUT + value % _NUM_OUTPUTS


class FakePages:
    """What FakeEngine.read_pages returns: each page's slot records, and a size in host memory
    (`kv_page_nbytes` per page, as the engine would charge)."""

    __slots__ = ("slots", "nbytes")

    def __init__(self, slots: tuple[tuple[int, ...], ...], nbytes: int) -> None:
        self.slots = slots
        self.nbytes = nbytes


class FakeTokenizer:
    """Byte-level: ids 0..255 are bytes; 256.. are the special tokens below (parsed in text)."""

    SPECIAL_TOKENS = ("<|im_start|>", "<|im_end|>", "<|endoftext|>")
    chat_template = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
                     "{{ message['content'] }}<|im_end|>\n{% endfor %}"
                     "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

    def __init__(self) -> None:
        self.vocab_size = 256 + len(self.SPECIAL_TOKENS)
        self.stop_token_ids = (257, 258)   # <|im_end|>, <|endoftext|>
        self._special_ids = {text: 256 + i for i, text in enumerate(self.SPECIAL_TOKENS)}

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        token_ids: list[int] = []
        position = 0
        while position < len(text):
            special = next((s for s in self.SPECIAL_TOKENS if text.startswith(s, position)), None)
            if special is not None:
                token_ids.append(self._special_ids[special])
                position += len(special)
                continue
            end = min((i for i in (text.find(s, position) for s in self.SPECIAL_TOKENS)
                       if i >= 0), default=len(text))
            token_ids.extend(text[position:end].encode("utf-8"))
            position = end
        return token_ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        parts: list[str] = []
        pending = bytearray()
        for token_id in token_ids:
            if not 0 <= token_id < self.vocab_size:
                raise ValueError(f"decode: token id {token_id} outside 0..{self.vocab_size - 1}")
            if token_id < 256:
                pending.append(token_id)
                continue
            parts.append(pending.decode("utf-8", errors="replace"))
            pending = bytearray()
            if not skip_special_tokens:
                parts.append(self.SPECIAL_TOKENS[token_id - 256])
        parts.append(pending.decode("utf-8", errors="replace"))
        return "".join(parts)

    def token_strings(self) -> list[str]:
        return [bytes([i]).decode("latin-1") for i in range(256)] + list(self.SPECIAL_TOKENS)

    def render_chat(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> str:
        """Same text as `chat_template` rendered with jinja2 (ChatML)."""
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")


class FakeEngine:
    """EngineLike with page-accurate token bookkeeping. Not thread-safe (like the engine: one
    caller at a time). `batches` / `copies` log what it ran; `fail_next_batches(n)` makes the next
    n forward calls raise RuntimeError; `batch_delay_s` sleeps in every forward."""

    def __init__(self, *, num_pages: int = 64, page_size: int = 4, batch_delay_s: float = 0.0,
                 keep_log: bool = True, kv_page_nbytes: int = 1024) -> None:
        if page_size <= 0 or num_pages <= 0:
            raise ValueError(f"FakeEngine: page_size and num_pages must be positive, "
                             f"got {page_size} and {num_pages}")
        self.tokenizer = FakeTokenizer()
        self.model_name = "fake-byte-model"
        self.model_config = ModelConfig(name=self.model_name, vocab_size=self.tokenizer.vocab_size,
                                        hidden_size=8, intermediate_size=16, num_layers=1,
                                        num_heads=2, num_kv_heads=1, head_dim=4, max_position=4096)
        self.page_size = page_size
        self.num_pages = num_pages
        self.batch_delay_s = batch_delay_s
        self.keep_log = keep_log
        self.kv_page_nbytes = kv_page_nbytes   # what one page read out costs in host memory
        self.num_pages_read = 0
        self.num_pages_written = 0
        self.batches: list[ForwardBatch] = []
        self.copies: list[TokenCopy] = []
        self._slots = [[EMPTY_SLOT] * page_size for _ in range(num_pages)]
        self._stats = EngineStats()
        self._num_failures_left = 0

    # ------------------------------------------------------------- inspection
    def page_tokens(self, page_id: int) -> tuple[int, ...]:
        """The token id in each slot of a physical page (EMPTY_SLOT where never written)."""
        return tuple(self._slots[page_id])

    def fail_next_batches(self, num_batches: int = 1) -> None:
        self._num_failures_left = num_batches

    def statistics(self) -> EngineStats:
        return self._stats

    # ----------------------------------------------------------------- engine
    def copy_tokens(self, copies: Sequence[TokenCopy]) -> None:
        for index, copy in enumerate(copies):
            self._check_copy(index, copy)
        for copy in copies:
            src = self._slots[copy.src_page_id][copy.src_offset:copy.src_offset + copy.num_tokens]
            self._slots[copy.dst_page_id][copy.dst_offset:copy.dst_offset + copy.num_tokens] = src
        if self.keep_log:
            self.copies.extend(copies)
        self._stats = replace(self._stats, num_copied_tokens=self._stats.num_copied_tokens
                              + sum(c.num_tokens for c in copies))

    def read_pages(self, page_ids: Sequence[int]) -> FakePages:
        """The slot records of whole pages (in order), as a swap-out would copy them."""
        for index, page_id in enumerate(page_ids):
            self._check_page(f"read_pages: page_ids[{index}]", page_id)
        self.num_pages_read += len(page_ids)
        return FakePages(tuple(tuple(self._slots[page_id]) for page_id in page_ids),
                         self.kv_page_nbytes * len(page_ids))

    def write_pages(self, page_ids: Sequence[int], data: FakePages) -> None:
        """Put pages read by `read_pages` into `page_ids` (as many as were read)."""
        for index, page_id in enumerate(page_ids):
            self._check_page(f"write_pages: page_ids[{index}]", page_id)
        if len(page_ids) != len(data.slots):
            raise ValueError(f"write_pages: {len(page_ids)} page ids for "
                             f"{len(data.slots)} pages read")
        for page_id, slots in zip(page_ids, data.slots):
            self._slots[page_id] = list(slots)
        self.num_pages_written += len(page_ids)

    def scribble(self, page_ids: Sequence[int], token_id: int = 0) -> None:
        """Overwrite every slot of `page_ids` (a test's stand-in for another owner's writes)."""
        for page_id in page_ids:
            self._slots[page_id] = [token_id] * self.page_size

    def forward(self, batch: ForwardBatch) -> list[ForwardResult]:
        batch = batch.with_fed_tokens()
        for index, request in enumerate(batch.requests):
            self._check_request(index, request)
        if self.batch_delay_s:
            time.sleep(self.batch_delay_s)
        if self._num_failures_left:
            self._num_failures_left -= 1
            raise RuntimeError("fake engine: injected failure")
        for request in batch.requests:
            self._write_tail(request)
        results = [ForwardResult(tuple(self._output(request, i, sampler)
                                       for i, sampler in zip(request.output_indices,
                                                             request.samplers)))
                   for request in batch.requests]
        if self.keep_log:
            self.batches.append(batch)
        s = self._stats
        self._stats = replace(s, num_batches=s.num_batches + 1,
                              num_requests=s.num_requests + len(batch.requests),
                              num_input_tokens=s.num_input_tokens + batch.num_tokens,
                              num_output_tokens=s.num_output_tokens
                              + sum(len(r.output_indices) for r in batch.requests))
        return results

    # ---------------------------------------------------------------- helpers
    def _kv_len(self, request: ForwardRequest) -> int:
        return kv_len(len(request.page_ids), request.last_page_len, self.page_size)

    def _slot(self, request: ForwardRequest, position: int) -> tuple[int, int]:
        return request.page_ids[position // self.page_size], position % self.page_size

    def _write_tail(self, request: ForwardRequest) -> None:
        first = self._kv_len(request) - len(request.token_ids)
        for offset, token_id in enumerate(request.token_ids):
            page_id, slot = self._slot(request, first + offset)
            self._slots[page_id][slot] = token_id

    def _output(self, request: ForwardRequest, index: int, sampler) -> int | Distribution:
        kv_len = self._kv_len(request)
        visible_end = kv_len - len(request.token_ids) + index + 1     # causal
        attend = [True] * visible_end
        if request.mask is not None:
            position, keep = 0, True
            for run in request.mask[index]:
                for p in range(position, min(position + run, visible_end)):
                    attend[p] = keep
                position += run
                keep = not keep
        context = [self._slots[page][slot] for p in range(visible_end) if attend[p]
                   for page, slot in (self._slot(request, p),)]
        seed = (sampler.seed or 0) if sampler.kind == "sample" else 0
        token = fake_next_token(context, seed)
        if sampler.kind != "distribution":
            return token
        num_top = min(sampler.num_top, _NUM_OUTPUTS)
        token_ids = tuple(_FIRST_OUTPUT + (token - _FIRST_OUTPUT + k) % _NUM_OUTPUTS
                          for k in range(num_top))
        weights = [0.5 ** (k + 1) for k in range(num_top)]
        total = sum(weights)
        return Distribution(token_ids, tuple(w / total for w in weights))

    def _check_page(self, where: str, page_id: int) -> None:
        if not 0 <= page_id < self.num_pages:
            raise ValueError(f"{where}={page_id} out of range [0, {self.num_pages})")

    def _check_copy(self, index: int, copy: TokenCopy) -> None:
        self._check_page(f"copy {index}: src_page_id", copy.src_page_id)
        self._check_page(f"copy {index}: dst_page_id", copy.dst_page_id)
        for name in ("src_offset", "dst_offset"):
            offset = getattr(copy, name)
            if offset < 0 or copy.num_tokens < 0 or offset + copy.num_tokens > self.page_size:
                raise ValueError(f"copy {index}: {name}={offset} + num_tokens={copy.num_tokens} "
                                 f"outside a page of {self.page_size}")

    def _check_request(self, index: int, request: ForwardRequest) -> None:
        """RequestError(index, field, reason) for the first thing wrong with the request."""
        def fail(field: str, reason: str) -> RequestError:
            return RequestError(index, field, reason)

        num_tokens = len(request.token_ids)
        if num_tokens == 0:
            raise fail("token_ids", "token_ids is empty")
        if len(request.positions) != num_tokens:
            raise fail("positions", f"positions has {len(request.positions)} entries, "
                                    f"token_ids {num_tokens}")
        for token_id in request.token_ids:
            if not 0 <= token_id < self.model_config.vocab_size:
                raise fail("token_ids", f"token id {token_id} outside the vocabulary")
        if not request.page_ids:
            raise fail("page_ids", "page_ids is empty")
        for j, page_id in enumerate(request.page_ids):
            if not 0 <= page_id < self.num_pages:
                raise fail("page_ids", f"page_ids[{j}]={page_id} out of range [0, {self.num_pages})")
        if not 1 <= request.last_page_len <= self.page_size:
            raise fail("last_page_len", f"last_page_len={request.last_page_len} outside "
                                        f"1..{self.page_size}")
        kv_len = self._kv_len(request)
        if num_tokens > kv_len:
            raise fail("page_ids", f"{num_tokens} tokens exceed kv length {kv_len}")
        if len(request.samplers) != len(request.output_indices):
            raise fail("samplers", f"{len(request.samplers)} samplers for "
                                   f"{len(request.output_indices)} output_indices")
        for i in request.output_indices:
            if not 0 <= i < num_tokens:
                raise fail("output_indices", f"output_indices entry {i} outside 0..{num_tokens - 1}")
        if request.mask is not None:
            if len(request.mask) != num_tokens:
                raise fail("mask", f"mask has {len(request.mask)} rows, {num_tokens} tokens")
            for r, row in enumerate(request.mask):
                if any(run < 0 for run in row) or sum(row) != kv_len:
                    raise fail("mask", f"mask row {r} must be non-negative runs summing to "
                                       f"kv length {kv_len}")
