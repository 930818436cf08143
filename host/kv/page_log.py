"""What wrote each page of one instance: the record a suspension needs to recompute the pages by
a prefill into fresh pool pages instead of copying them to host memory (host/suspensions.py).

A page is *recomputable* when its slots 0..fill-1 were written in order by plain token passes of
this instance (no mask, no hidden slots, no input token fed from a pass not yet run), all
attending to one *context*: the pages before it in the sequence, every one of them full and
recomputable itself, or read-only (imported: its content cannot change). A prefill of the page's
tokens at their positions over that context then writes the same K/V (the same computation;
float32 kernels of another batch shape may round differently, see docs/server.md).

Anything else marks the page *dirty*: a write that leaves a gap, a write through another
context, a pass with a mask, a copy-tokens into it, an import. A write that goes back (a
rewind, rejected drafts written again) cuts the record there and goes on from it; a dirty page
written again from its first slot starts a record anew. Either changes the page's `version`:
a page whose context page changed since it attended to it is not recomputable (its slots hold
what the old content gave). A page never written has no record: a restore gives it a fresh page
and computes nothing. A shared page's new id gets a copy of the record (`share`).

A context is kept in O(1) per page: the page before it (`pred`) when that one was written
through the same prefix (the common case: a sequence growing page by page), else the whole
prefix as a tuple (`head`, once, for the first page after pages of another origin).

`plan` turns the pages a suspension releases into the passes that recompute them, or None when
any of them (or a page they attend to) is not recomputable: the victim is then swapped whole.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from engine.batch import ForwardRequest

__all__ = ["PageLog", "PageLogs", "RecomputeGroup", "RecomputePlan"]


class PageLog:
    """One local page id's record: its written slots' tokens and positions (None: dirty) and
    the context its slots attend to: `head` + (the context of `pred`, then `pred`) when `pred`
    is set, else `head` alone; `depth` = its length; `seen`: the version of `pred` (or of each
    page of `head`) when its first slot was written. `version` counts the changes of its
    content other than extensions. `sequence` and `layout` remember the sequence through which
    the context was last checked (a cheap re-check)."""

    __slots__ = ("tokens", "positions", "head", "pred", "depth", "sequence", "layout",
                 "version", "seen")

    def __init__(self, head: tuple[int, ...] = (), pred: int | None = None, depth: int = 0,
                 sequence: object = None, layout: int = 0) -> None:
        self.tokens: list[int] | None = []
        self.positions: list[int] = []
        self.head = head
        self.pred = pred
        self.depth = depth
        self.sequence = sequence
        self.layout = layout
        self.version = 0
        self.seen: int | tuple[int, ...] = ()

    def copy(self) -> "PageLog":
        log = PageLog(self.head, self.pred, self.depth)
        log.version, log.seen = self.version, self.seen
        if self.tokens is None:
            log.tokens = None
        else:
            log.tokens, log.positions = list(self.tokens), list(self.positions)
        return log


@dataclass(frozen=True)
class RecomputeGroup:
    """One pass of a recompute: `own` pages (local ids; all but the last full) written by
    `token_ids` at `positions`, over `prefix` (local ids, full, available before the pass)."""

    prefix: tuple[int, ...]
    own: tuple[int, ...]
    token_ids: tuple[int, ...]
    positions: tuple[int, ...]
    last_page_len: int

    def request(self, physical_id: Callable[[int], int]) -> ForwardRequest:
        """The engine request, the local ids translated by `physical_id`."""
        return ForwardRequest(self.token_ids, self.positions,
                              tuple(physical_id(pid) for pid in self.prefix + self.own),
                              self.last_page_len)


@dataclass(frozen=True)
class RecomputePlan:
    """The passes that recompute a suspended instance's pages, in waves: a wave's passes attend
    only to pages resident or recomputed by an earlier wave. `num_tokens`: tokens in all."""

    waves: tuple[tuple[RecomputeGroup, ...], ...]
    num_tokens: int


class PageLogs:
    """The records of one instance's local page ids. Owned by its InstancePages and called only
    under that table's lock; `read_only(page_id)` says whether a local id is imported."""

    def __init__(self, page_size: int, read_only: Callable[[int], bool]) -> None:
        self.page_size = page_size
        self._read_only = read_only
        self._logs: dict[int, PageLog] = {}

    def note_step(self, sequence: object, page_ids: list[int], layout: int, token_id: int,
                  position: int, last_page_len: int) -> None:
        """A decode step wrote slot last_page_len - 1 of the sequence's last page."""
        page_id = page_ids[-1]
        log = self._logs.get(page_id)
        if (log is not None and log.tokens is not None and log.sequence is sequence
                and log.layout == layout and len(log.tokens) == last_page_len - 1
                and log.depth == len(page_ids) - 1):
            log.tokens.append(token_id)              # the common case: nothing else to check
            log.positions.append(position)
            return
        self._note_page(sequence, page_ids, layout, len(page_ids) - 1, last_page_len - 1,
                        (token_id,), (position,))

    def note_pass(self, sequence: object, page_ids: list[int], layout: int, first_slot: int,
                  token_ids: Sequence[int], positions: Sequence[int], plain: bool) -> None:
        """A pass wrote slots [first_slot, first_slot + len(token_ids)) of the sequence;
        `plain` False (a mask, hidden slots, a fed token): the pages it wrote are dirty."""
        index, offset = divmod(first_slot, self.page_size)
        done = 0
        while done < len(token_ids):
            take = min(self.page_size - offset, len(token_ids) - done)
            if plain:
                self._note_page(sequence, page_ids, layout, index, offset,
                                token_ids[done:done + take], positions[done:done + take])
            else:
                self.dirty(page_ids[index])
            done += take
            index += 1
            offset = 0

    def dirty(self, page_id: int) -> None:
        """`page_id`'s content no longer comes from recorded passes (a copy into it, an
        import)."""
        log = self._logs.get(page_id)
        if log is None:
            log = self._logs[page_id] = PageLog()
        log.tokens, log.positions = None, []
        log.version += 1

    def share(self, src_id: int, dst_id: int) -> None:
        """`dst_id` is a new id of `src_id`'s page (the same content)."""
        log = self._logs.get(src_id)
        if log is not None:
            self._logs[dst_id] = log.copy()

    def drop(self, page_id: int) -> None:
        self._logs.pop(page_id, None)

    def clear(self) -> None:
        self._logs.clear()

    def plan(self, page_ids: Sequence[int], resident: Callable[[int], bool]
             ) -> RecomputePlan | None:
        """The passes that recompute `page_ids` (the local ids a suspension releases) into fresh
        pages, or None when one of them is not recomputable. `resident(page_id)`: the page
        stays in the pool through the suspension (its content unchanged)."""
        released = set(page_ids)
        written = sorted(((pid, self._logs[pid]) for pid in page_ids if pid in self._logs),
                         key=lambda item: item[1].depth)
        valid: dict[int, bool] = {}                  # page id -> its whole context attendable
        groups: dict[int, list] = {}     # last own page -> [prefix, own, tokens, positions]
        for page_id, log in written:
            if not log.tokens:
                if log.tokens is None:
                    return None                      # dirty
                continue                             # never written: nothing to compute
            if not self._context_valid(page_id, released, resident, valid):
                return None
            group = groups.pop(log.pred, None) if log.pred is not None else None
            if group is None or len(self._logs[group[1][-1]].tokens or ()) != self.page_size:
                if group is not None:
                    groups[log.pred] = group         # not extended: keep it as it is
                context = self._context(page_id)
                if context is None:
                    return None
                group = [context, (), [], []]
            group[1] += (page_id,)
            group[2] += log.tokens
            group[3] += log.positions
            groups[page_id] = group
        return self._waves(list(groups.values()), released)

    def _context(self, page_id: int) -> tuple[int, ...] | None:
        """The local ids `page_id`'s slots attend to, in order; None when a record on the way
        is gone (a context page was dropped)."""
        chain: list[int] = []
        log = self._logs.get(page_id)
        while log is not None and log.pred is not None:
            chain.append(log.pred)
            log = self._logs.get(log.pred)
        if log is None:
            return None
        chain.reverse()
        return log.head + tuple(chain)

    def _context_valid(self, page_id: int, released: set[int],
                       resident: Callable[[int], bool], valid: dict[int, bool]) -> bool:
        """Whether every page `page_id` attends to holds, after a restore, what it attended
        (memoized in `valid`, walked iteratively: a context may be thousands of pages)."""
        path: list[int] = []
        current: int | None = page_id
        result = True
        while current is not None and current not in valid:
            log = self._logs.get(current)
            if log is None:
                result = False
                break
            path.append(current)
            if log.pred is None:
                result = (all(self._attendable(pid, released, resident) for pid in log.head)
                          and log.seen == tuple(self._version(pid) for pid in log.head))
                current = None
            elif (not self._attendable(log.pred, released, resident)
                  or self._version(log.pred) != log.seen):
                result = False
                current = None
            else:
                current = log.pred
        if current is not None and current in valid:
            result = valid[current]
        for pid in path:
            valid[pid] = result
        return result

    def _attendable(self, page_id: int, released: set[int],
                    resident: Callable[[int], bool]) -> bool:
        """Whether a context page holds, after a restore, what the pages after it attended."""
        log = self._logs.get(page_id)
        if log is None:                 # never written by this instance: imported, fixed
            return self._read_only(page_id) and page_id not in released and resident(page_id)
        if log.tokens is None:
            return (self._read_only(page_id) and page_id not in released
                    and resident(page_id))
        return len(log.tokens) == self.page_size

    def _waves(self, groups: list[list], released: set[int]) -> RecomputePlan | None:
        """Order the groups: a group runs once every released page of its prefix is done."""
        done: set[int] = set()
        waves = []
        num_tokens = 0
        while groups:
            ready = [g for g in groups if all(pid in done or pid not in released for pid in g[0])]
            if not ready:
                return None                 # a prefix page no pass writes (cannot happen)
            wave = []
            for prefix, own, tokens, positions in ready:
                last_len = len(self._logs[own[-1]].tokens or ())
                wave.append(RecomputeGroup(prefix, own, tuple(tokens), tuple(positions),
                                           last_len))
                done.update(own)
                num_tokens += len(tokens)
            groups = [g for g in groups if not any(g is r for r in ready)]
            waves.append(tuple(wave))
        return RecomputePlan(tuple(waves), num_tokens)

    def _version(self, page_id: int) -> int:
        """A page's content version (-1: no record, never written by this instance)."""
        log = self._logs.get(page_id)
        return -1 if log is None else log.version

    def _note_page(self, sequence: object, page_ids: list[int], layout: int, index: int,
                   offset: int, token_ids: Sequence[int], positions: Sequence[int]) -> None:
        """Slots [offset, offset + len(token_ids)) of page_ids[index] were written."""
        page_id = page_ids[index]
        log = self._logs.get(page_id)
        if log is None:
            log = self._logs[page_id] = PageLog()
        if log.tokens is None:
            if offset:
                return
            log.tokens, log.positions = [], []       # written again from its first slot
            log.version += 1
        elif offset < len(log.tokens):               # a rewind: the record cut there
            del log.tokens[offset:]
            del log.positions[offset:]
            log.version += 1
        elif offset > len(log.tokens):
            self.dirty(page_id)                      # a gap
            return
        if offset == 0:
            if not self._set_context(log, sequence, page_ids, layout, index):
                self.dirty(page_id)
                return
        elif not (log.sequence is sequence and log.layout == layout and log.depth == index) \
                and self._context(page_id) != tuple(page_ids[:index]):
            self.dirty(page_id)                      # written through another context
            return
        log.sequence, log.layout = sequence, layout
        log.tokens.extend(token_ids)
        log.positions.extend(positions)

    def _set_context(self, log: PageLog, sequence: object, page_ids: list[int], layout: int,
                     index: int) -> bool:
        """A page's first write, at page_ids[index]: record its context (False, nothing
        recorded, when a context page is not full and recomputable, nor read-only, or the page
        is in its own context). The page before it, written through this sequence as it is,
        chains it (O(1)); else the context is kept whole."""
        page_id = page_ids[index]
        if index:
            pred = page_ids[index - 1]
            before = self._logs.get(pred)
            if (before is not None and before.tokens is not None
                    and len(before.tokens) == self.page_size and before.sequence is sequence
                    and before.layout == layout and before.depth == index - 1):
                if page_ids.index(page_id) < index:
                    return False                     # listed before itself
                log.head, log.pred, log.depth, log.seen = (), pred, index, before.version
                return True
        context = tuple(page_ids[:index])
        if page_id in context or not all(self._full_or_fixed(pid) for pid in context):
            return False
        log.head, log.pred, log.depth = context, None, index
        log.seen = tuple(self._version(pid) for pid in context)
        return True

    def _full_or_fixed(self, page_id: int) -> bool:
        """Whether a context page may be attended to by a recomputable page: full and
        recomputable, or read-only."""
        log = self._logs.get(page_id)
        if log is not None and log.tokens is not None:
            return len(log.tokens) == self.page_size
        return self._read_only(page_id)
