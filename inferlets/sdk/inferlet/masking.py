"""Masking a context's KV slots (`mask-tokens`): hide ranges from later passes, free pages
whose slots are all hidden, and the attention-sink window built on both. Mixed into Context."""
from __future__ import annotations

from inferlet._wit import kv

__all__ = ["MaskingMixin"]


class MaskingMixin:
    """The masking methods of Context (they use its page_ids, _page_masks, kv_len, settle)."""

    def _apply_mask_runs(self, page_id: int, mask: bytearray) -> None:
        offset = 0
        while offset < len(mask):
            if not mask[offset]:
                offset += 1
                continue
            end = offset
            while end < len(mask) and mask[end]:
                end += 1
            kv.mask_tokens(page_id, offset, end - offset, True)
            offset = end

    def mask(self, start: int, end: int, masked: bool = True) -> None:
        """Hide (or show again) KV slots [start, end) from every later pass of this context."""
        self.settle()
        if not 0 <= start <= end <= self.kv_len:
            raise ValueError(f"mask range [{start}, {end}) outside the {self.kv_len} KV slots")
        flag = 1 if masked else 0
        for page_index in range(start // self.page_size, -(-end // self.page_size)):
            page_start = page_index * self.page_size
            lo, hi = max(start, page_start) - page_start, min(end, page_start + self.page_size) - page_start
            page_mask = self._page_masks[page_index]
            if all(page_mask[i] == flag for i in range(lo, hi)):
                continue
            kv.mask_tokens(self.page_ids[page_index], lo, hi - lo, masked)
            page_mask[lo:hi] = bytes([flag]) * (hi - lo)

    def drop_masked_pages(self) -> int:
        """Free the pages (but the last) whose slots are all masked; returns how many."""
        self.settle()
        keep = [i for i, m in enumerate(self._page_masks)
                if i == len(self.page_ids) - 1 or not all(m)]
        if len(keep) == len(self.page_ids):
            return 0
        dropped = [self.page_ids[i] for i in range(len(self.page_ids)) if i not in set(keep)]
        kv.free_pages(dropped)   # also removes them from the sequence
        self.page_ids = [self.page_ids[i] for i in keep]
        self._page_masks = [self._page_masks[i] for i in keep]
        return len(dropped)

    def keep_window(self, num_sink_tokens: int, window: int) -> int:
        """Attention sink + sliding window: hide every KV slot but the first `num_sink_tokens`
        and the last `window`, then free fully hidden pages. Returns the pages freed."""
        end = self.kv_len - window
        if end > num_sink_tokens:
            self.mask(num_sink_tokens, end)
        return self.drop_masked_pages()
