"""`Context`: a token sequence with its KV pages, positions and queue.

Tokens are *filled* lazily: `fill` only appends to `pending_token_ids`; the next forward pass
(the first step of a generation, `flush`, `fork`, `export`) computes their KV. So a prompt's
prefill and the first sampled token are one pass, and a decode step is one `forward.submit` plus
one `get` (the page list stays on the host, in a kv sequence).

KV layout: `page_ids` hold `kv_len` token slots, the last page `last_page_len` of them. Positions
(RoPE) keep growing even when masked pages are dropped, so `next_position` >= `kv_len`.
"""
from __future__ import annotations

import json

from inferlet import adapters
from inferlet._wit import Err, forward, kv, messaging, queue
from inferlet.errors import InferletError
from inferlet.generation import Generation
from inferlet.masking import MaskingMixin
from inferlet.model import decode, encode, model_info, render_chat
from inferlet.sampling import Sampler
from inferlet.stats import ContextStats

__all__ = ["Context", "list_exports", "release_export"]

_PRIORITIES = {"low": queue.Priority.LOW, "normal": queue.Priority.NORMAL,
               "high": queue.Priority.HIGH}
_EXPORT_KEY = "inferlet.export."   # store key prefix of an export's token metadata


class Context(MaskingMixin):
    """A token sequence the model attends to: tokens, KV pages, positions, its own queue.

    adapter: a LoRA adapter (a name, or an inferlet.adapters.Adapter) every pass of the context
    runs with; None: the base model. `use_adapter` changes it; generate / generate_tokens /
    stream take `adapter=` for one call.
    """

    def __init__(self, *, priority: str = "normal", adapter=None) -> None:
        if priority not in _PRIORITIES:
            raise ValueError(f"priority must be low, normal or high, got {priority!r}")
        info = model_info()
        self.priority = priority
        self.page_size = info.page_size
        self.max_batch_tokens = info.max_batch_tokens
        self.stop_token_ids = frozenset(info.stop_token_ids)
        self.queue_id = queue.create(_PRIORITIES[priority])
        self.sequence_id = kv.create_sequence()
        self.page_ids: list[int] = []
        self._page_masks: list[bytearray] = []   # per page: 1 = slot hidden by mask-tokens
        self.last_page_len = 0
        self.token_ids: list[int] = []           # every token of the context, pending included
        self.pending_token_ids: list[int] = []   # filled, KV not computed yet
        self._read_only_page_ids: set[int] = set()   # imported pages (never written)
        self.next_position = 0                   # position of the next token a pass computes
        self._unsynchronized = False             # passes submitted since the last synchronize
        self._dropped_futures: list[forward.ForwardFuture] = []
        self._chat: list[tuple[str, str]] = []   # (role, content) messages filled so far
        self._chat_text = ""                      # rendered chat text already in the context
        self._closed = False
        self.open_loop = None                     # a host decode loop not closed yet (HostLoop)
        self._num_inherited_slots = 0             # KV slots a fork or an import brought (stats)
        self._shared_page_ids: set[int] = set()   # full pages shared with another context
        self.adapter: adapters.Adapter | None = None
        if adapter is not None:
            self.use_adapter(adapter)

    def use_adapter(self, adapter) -> None:
        """Run the context's later passes with `adapter` (a name or an Adapter; None: the base
        model). Pending tokens are computed with the adapter of the pass that computes them."""
        opened = None if adapter is None else adapters.open_adapter(adapter)
        if (opened and opened.handle) != (self.adapter and self.adapter.handle):
            adapters.bind(self.sequence_id, opened)
        self.adapter = opened

    # -- filling -------------------------------------------------------------------------------
    def fill(self, text_or_token_ids: str | list[int]) -> None:
        """Append text (encoded with the model's tokenizer) or token ids to the context."""
        if isinstance(text_or_token_ids, str):
            token_ids = encode(text_or_token_ids)
        else:
            token_ids = [int(t) for t in text_or_token_ids]
        self.token_ids.extend(token_ids)
        self.pending_token_ids.extend(token_ids)

    def fill_system(self, content: str) -> None:
        """Append a system message, rendered with the model's chat template."""
        self._fill_message("system", content)

    def fill_user(self, content: str) -> None:
        """Append a user message, rendered with the model's chat template."""
        self._fill_message("user", content)

    def fill_assistant(self, content: str) -> None:
        """Append an assistant message (e.g. a few-shot answer), rendered with the template."""
        self._fill_message("assistant", content)

    def _fill_message(self, role: str, content: str) -> None:
        self._chat.append((role, content))
        self._fill_rendered(render_chat(self._chat, False))

    def _fill_rendered(self, rendered: str) -> None:
        """Fill what `rendered` adds to the chat text already in the context."""
        common = 0
        limit = min(len(rendered), len(self._chat_text))
        if rendered.startswith(self._chat_text):
            common = len(self._chat_text)
        else:   # the template re-rendered earlier text differently: keep the shared prefix
            while common < limit and rendered[common] == self._chat_text[common]:
                common += 1
        self.fill(rendered[common:])
        self._chat_text = rendered

    @property
    def in_chat(self) -> bool:
        """True once a chat message was filled (generations then record assistant turns)."""
        return bool(self._chat)

    def fill_generation_prompt(self) -> None:
        """In chat mode, append the assistant header when the last message is not the assistant's."""
        if self._chat and self._chat[-1][0] != "assistant":
            self._fill_rendered(render_chat(self._chat, True))

    def record_assistant_turn(self, text: str, generated_token_ids: list[int]) -> None:
        """After a generation in chat mode, record `text` as the assistant's turn;
        `generated_token_ids` (the stop token included) are what the context now holds."""
        if self._chat:
            self._chat.append(("assistant", text))
            self._chat_text += decode(generated_token_ids)

    # -- generating ----------------------------------------------------------------------------
    def generation(self, max_tokens: int = 256, sampler: Sampler | None = None, *,
                   stop: tuple[str, ...] | str = (), stop_token_ids=None,
                   stream_text: bool = False, **options) -> Generation:
        """A Generation to drive step by step (see inferlet.generation); `stream_text` makes its
        steps return text deltas; `options`: schema=, regex=, grammar=, drafter= (Generation)."""
        return Generation(self, max_tokens, sampler, stop=stop, stop_token_ids=stop_token_ids,
                          stream_text=stream_text, **options)

    def generate(self, max_tokens: int = 256, sampler: Sampler | None = None, *,
                 stop: tuple[str, ...] | str = (), stop_token_ids=None, **options) -> str:
        """Generate up to `max_tokens` (greedy unless `sampler`); returns the text. Stops at the
        model's stop tokens (or `stop_token_ids`) and at any `stop` string. In chat mode the
        assistant header is added first and the answer recorded as the assistant's turn.
        `options`: schema= / regex= / grammar= constrain the output, drafter= drafts (Generation);
        adapter= runs this call with another adapter (None: the base model)."""
        with self._adapter_for(options):
            return self.generation(max_tokens, sampler, stop=stop, stop_token_ids=stop_token_ids,
                                   **options).run().text

    def generate_tokens(self, max_tokens: int = 256, sampler: Sampler | None = None, *,
                        stop_token_ids=None, **options) -> list[int]:
        """Like `generate`, returning the generated token ids (stop token excluded)."""
        with self._adapter_for(options):
            return self.generation(max_tokens, sampler, stop_token_ids=stop_token_ids,
                                   **options).run().token_ids

    def stream(self, max_tokens: int = 256, sampler: Sampler | None = None, *,
               stop: tuple[str, ...] | str = (), stop_token_ids=None, **options):
        """Like `generate`, yielding text deltas as they become final."""
        with self._adapter_for(options):
            yield from self.generation(max_tokens, sampler, stop=stop,
                                       stop_token_ids=stop_token_ids, stream_text=True,
                                       **options).steps()

    def _adapter_for(self, options: dict) -> "_AdapterScope":
        """The scope of one call's `adapter=` option (taken out of `options`)."""
        if "adapter" not in options:
            return _AdapterScope(self, None, False)
        return _AdapterScope(self, options.pop("adapter"), True)

    def stats(self) -> ContextStats:
        """What this context computed itself and what it shares (inferlet.stats.ContextStats),
        counted from what the SDK knows: no host call (the KV of a host decode loop still open,
        a generation read part-way, counts once it is closed)."""
        shared = self._shared_page_ids
        return ContextStats(len(self.token_ids), self.kv_len,
                            max(0, self.kv_len - self._num_inherited_slots), len(self.page_ids),
                            sum(1 for page_id in self.page_ids if page_id in shared))

    # -- KV bookkeeping ------------------------------------------------------------------------
    @property
    def kv_len(self) -> int:
        """Token slots in the pages (computed or submitted)."""
        return 0 if not self.page_ids else (len(self.page_ids) - 1) * self.page_size + self.last_page_len

    def settle(self) -> None:
        """Close a host decode loop left open (a generation read part-way), so the pages and
        pending tokens match what was read. Every KV operation of the context does this first."""
        if self.open_loop is not None:
            self.open_loop.close()

    def reserve(self, num_tokens: int) -> None:
        """Grow the pages (and the host sequence) to hold `num_tokens` more slots."""
        self.settle()
        new_len = self.kv_len + num_tokens
        num_new_pages = -(-new_len // self.page_size) - len(self.page_ids)
        if num_new_pages > 0:
            new_ids = list(kv.allocate_pages(num_new_pages))
            kv.sequence_append(self.sequence_id, new_ids)
            self.page_ids.extend(new_ids)
            self._page_masks.extend(bytearray(self.page_size) for _ in new_ids)
        self.last_page_len = new_len - (len(self.page_ids) - 1) * self.page_size

    def adopt_pages(self, page_ids: list[int], kv_len: int) -> None:
        """Pages the host appended to the sequence (a decode loop's) join the context,
        which now holds `kv_len` slots."""
        self.page_ids.extend(page_ids)
        self._page_masks.extend(bytearray(self.page_size) for _ in page_ids)
        self.last_page_len = kv_len - (len(self.page_ids) - 1) * self.page_size

    def note_submitted(self) -> None:
        """A pass was submitted on this context's queue (synchronize waits for it)."""
        self._unsynchronized = True

    def submit(self, token_ids: list[int], sampler=None, options=None, *,
               mask: list[list[int]] | None = None) -> forward.ForwardFuture | None:
        """Compute the KV of `token_ids` (appended at the tail) in passes of at most
        max_batch_tokens; the last pass's future when `sampler` is given (it samples after the
        last token), else None. `options` (a forward.SamplerOptions): the last pass goes through
        forward.submit-with (read it with wait_outputs(future, sampled=True)). `mask` (one pass
        only): per token, attend / skip run lengths over the KV after the pass (`forward.submit`)."""
        self._check_open()
        if mask is not None and len(token_ids) > self.max_batch_tokens:
            raise ValueError(f"a masked submit is one pass: {len(token_ids)} tokens over "
                             f"max_batch_tokens {self.max_batch_tokens}")
        last = None
        for start in range(0, len(token_ids), self.max_batch_tokens):
            chunk = token_ids[start:start + self.max_batch_tokens]
            is_last = start + len(chunk) == len(token_ids)
            with_output = sampler is not None and is_last
            positions = list(range(self.next_position, self.next_position + len(chunk)))
            self.reserve(len(chunk))
            if with_output and options is not None:
                future = forward.submit_with(self.queue_id, self.sequence_id, chunk, positions,
                                             self.last_page_len, [len(chunk) - 1],
                                             [sampler.to_wit()], [options], mask)
            else:
                future = forward.submit(self.queue_id, self.sequence_id, chunk, positions,
                                        self.last_page_len, [len(chunk) - 1] if with_output else [],
                                        [sampler.to_wit()] if with_output else [], mask)
            self.next_position += len(chunk)
            self._unsynchronized = True
            if with_output:
                last = future
            else:
                self._dropped_futures.append(future)
        return last

    def reopen_last_token(self) -> None:
        """Make the last computed token pending again, so a generation can start from a context
        whose tokens are all computed (a fresh fork, an import): its KV slot is given back and
        the next pass recomputes it (and samples after it)."""
        if self.pending_token_ids or not self.token_ids or not self.page_ids:
            return
        last_index = len(self.page_ids) - 1
        if self.last_page_len == 1:   # the page would be empty: drop it
            kv.sequence_remove(self.sequence_id, last_index, 1)
            kv.free_pages([self.page_ids.pop()])
            self._page_masks.pop()
            self.last_page_len = self.page_size
        else:
            self.last_page_len -= 1
            if self.page_ids[last_index] in self._read_only_page_ids:   # imported: copy it
                kv.sequence_remove(self.sequence_id, last_index, 1)
                own_id = self._copy_to_own_page(self.page_ids[last_index], self.last_page_len)
                kv.sequence_append(self.sequence_id, [own_id])
                self.page_ids[last_index] = own_id
        self.next_position -= 1
        self.pending_token_ids.append(self.token_ids[-1])

    def _copy_to_own_page(self, page_id: int, num_tokens: int) -> int:
        """A new page of this context holding the first `num_tokens` slots of `page_id` (copied
        on this context's queue); `page_id` is freed."""
        own_id = kv.allocate_pages(1)[0]
        kv.copy_tokens(self.queue_id, page_id, own_id, 0, 0, num_tokens)
        kv.free_pages([page_id])
        return own_id

    def take_pending(self) -> list[int]:
        """The pending tokens, now counted as submitted (the caller submits them)."""
        self.settle()
        token_ids, self.pending_token_ids = self.pending_token_ids, []
        return token_ids

    def accept(self, token_id: int) -> None:
        """Append a sampled token (pending: its KV is computed by the next pass)."""
        self.token_ids.append(token_id)
        self.pending_token_ids.append(token_id)

    def flush(self) -> None:
        """Submit the pending tokens' KV (no output)."""
        if self.pending_token_ids:
            self.submit(self.take_pending())

    def synchronize(self) -> None:
        """Block until everything submitted on this context's queue has run."""
        self._check_open()
        self.settle()
        if self._unsynchronized:
            queue.synchronize(self.queue_id)
            self._unsynchronized = False
        self._release_dropped_futures()

    def passes_done(self) -> None:
        """Note that the last submitted pass has run (its future's `get` returned)."""
        self._unsynchronized = False
        self._release_dropped_futures()

    def _release_dropped_futures(self) -> None:
        for future in self._dropped_futures:
            future.__exit__(None, None, None)
        self._dropped_futures.clear()

    # -- fork -------------------------------------------------------------------------------
    def fork(self, *, priority: str | None = None) -> "Context":
        """A new context with the same tokens, sharing this one's KV pages (no copy).

        The pending tokens are computed first, so the prefix is computed once; the shared
        partial last page is copied by the host when either side writes into it.
        """
        self.settle()
        self.flush()
        self.synchronize()
        child = Context(priority=priority or self.priority, adapter=self.adapter)
        if self.page_ids:
            child.page_ids = list(kv.share_pages(self.page_ids))
            child._read_only_page_ids = {child_id for child_id, page_id in zip(child.page_ids, self.page_ids)
                                         if page_id in self._read_only_page_ids}
            kv.sequence_append(child.sequence_id, child.page_ids)
            child._page_masks = [bytearray(mask) for mask in self._page_masks]
            for page_id, mask in zip(child.page_ids, child._page_masks):
                child._apply_mask_runs(page_id, mask)
        child.last_page_len = self.last_page_len
        num_full = self.kv_len // self.page_size          # the partial last page is copied on write
        child._num_inherited_slots = self.kv_len
        child._shared_page_ids = set(child.page_ids[:num_full])
        self._shared_page_ids.update(self.page_ids[:num_full])
        child.token_ids = list(self.token_ids)
        child.next_position = self.next_position
        child._chat, child._chat_text = list(self._chat), self._chat_text
        return child

    # -- export / import -----------------------------------------------------------------------
    def export(self, name: str, *, persistent: bool = False) -> None:
        """Publish this context's KV under `name` (tokens in the tenant's store) for `from_import`."""
        if any(any(m) for m in self._page_masks) or self.next_position != self.kv_len:
            raise ValueError(f"export {name!r}: a masked or windowed context cannot be exported")
        self.settle()
        self.flush()
        self.synchronize()
        try:
            kv.export_pages(name, self.page_ids, persistent)
        except Err as err:
            raise InferletError(f"export {name!r}: {err.value}") from None
        meta = {"token_ids": self.token_ids, "last_page_len": self.last_page_len,
                "chat": self._chat, "chat_text": self._chat_text}
        messaging.store_set(_EXPORT_KEY + name, json.dumps(meta))

    @classmethod
    def from_import(cls, name: str, *, priority: str = "normal", adapter=None) -> "Context":
        """A context continuing an export: its full pages shared read-only, no prefill."""
        meta_text = messaging.store_get(_EXPORT_KEY + name)
        try:
            page_ids = list(kv.import_pages(name))
        except Err as err:
            raise InferletError(f"import {name!r}: {err.value}") from None
        if meta_text is None:
            kv.free_pages(page_ids)
            raise InferletError(f"import {name!r}: no token metadata (export it with Context.export)")
        meta = json.loads(meta_text)
        ctx = cls(priority=priority, adapter=adapter)
        ctx.last_page_len = meta["last_page_len"]
        if page_ids and ctx.last_page_len < ctx.page_size:   # imported pages are read-only
            page_ids[-1] = ctx._copy_to_own_page(page_ids[-1], ctx.last_page_len)
        kv.sequence_append(ctx.sequence_id, page_ids)
        ctx.page_ids = page_ids
        ctx._read_only_page_ids = set(page_ids) - {page_ids[-1]} if ctx.last_page_len < ctx.page_size \
            else set(page_ids)
        ctx._page_masks = [bytearray(ctx.page_size) for _ in page_ids]
        ctx._num_inherited_slots = ctx.kv_len
        ctx._shared_page_ids = set(ctx._read_only_page_ids)
        ctx.token_ids = list(meta["token_ids"])
        ctx.next_position = len(ctx.token_ids)
        ctx._chat = [tuple(m) for m in meta["chat"]]
        ctx._chat_text = meta["chat_text"]
        return ctx

    # -- lifetime ------------------------------------------------------------------------------
    def close(self) -> None:
        """Free the pages, the sequence and the queue (idempotent)."""
        if self._closed:
            return
        self.settle()
        self._release_dropped_futures()
        if self.page_ids:
            kv.free_pages(self.page_ids)
        kv.destroy_sequence(self.sequence_id)
        queue.destroy(self.queue_id)
        self.page_ids, self._page_masks = [], []
        self._closed = True

    def __enter__(self) -> "Context":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise InferletError("this Context is closed")


def list_exports() -> list[str]:
    """Names of the KV exports visible to this instance."""
    return list(kv.list_exports())


def release_export(name: str) -> None:
    """Drop an export made by this instance (or a persistent one of its tenant)."""
    try:
        kv.release_export(name)
    except Err as err:
        raise InferletError(f"release export {name!r}: {err.value}") from None
    messaging.store_delete(_EXPORT_KEY + name)


class _AdapterScope:
    """One call's adapter: bound on entry (the pending tokens are computed by the call's first
    pass), the context's own put back on exit, after the call's passes have run."""

    def __init__(self, ctx: Context, adapter, active: bool) -> None:
        self.ctx, self.adapter, self.active = ctx, adapter, active
        self.saved = None

    def __enter__(self) -> None:
        if self.active:
            self.saved = self.ctx.adapter
            self.ctx.use_adapter(self.adapter)

    def __exit__(self, *exc_info) -> None:
        if self.active and not self.ctx._closed:
            self.ctx.settle()
            self.ctx.use_adapter(self.saved)
