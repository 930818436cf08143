"""Incremental detokenization and stop strings, for streaming generation.

Decoding the whole generation after every token would cost O(n^2) host list traffic; instead
`TextStream` decodes a short window (the HF TextStreamer scheme: text is emitted once it no longer
ends in an incomplete UTF-8 sequence) and holds back text that could still become a stop string.
The window's text is kept from one token to the next, so a token costs one `decode` host call;
every _MAX_WINDOW tokens the window restarts at the last token (kept as context) and one more
call decodes that token alone.
"""
from __future__ import annotations

from inferlet.model import decode

__all__ = ["TextStream"]

_INCOMPLETE = "\ufffd"   # what a partial UTF-8 sequence decodes to
_MAX_WINDOW = 8          # tokens a window spans before it restarts


class TextStream:
    """Turns generated token ids into text deltas and finds stop strings in them."""

    def __init__(self, stop_strings: tuple[str, ...] = ()) -> None:
        self._stop_strings = tuple(s for s in stop_strings if s)
        self._holdback = max((len(s) for s in self._stop_strings), default=1) - 1
        self._token_ids: list[int] = []
        self._prefix_offset = 0      # window start: tokens before it are decoded for good
        self._window_text = ""       # decode(token ids from prefix_offset up to the last in `text`)
        self.text = ""               # decoded text so far (cut at a stop string once found)
        self._num_emitted = 0        # characters of `text` already returned as deltas
        self.stopped = False         # a stop string was found

    def push(self, token_id: int) -> str:
        """Add a generated token; return the text that is now final (may be "")."""
        self._token_ids.append(token_id)
        new_text = decode(self._token_ids[self._prefix_offset:])
        if new_text.endswith(_INCOMPLETE):
            return ""
        search_from = max(0, len(self.text) - self._holdback)
        self.text += new_text[len(self._window_text):]
        self._window_text = new_text
        if len(self._token_ids) - self._prefix_offset >= _MAX_WINDOW:
            self._prefix_offset = len(self._token_ids) - 1
            self._window_text = decode(self._token_ids[self._prefix_offset:])
        self._find_stop(search_from)
        return self._take(final=self.stopped)

    def finish(self) -> str:
        """The held-back rest, once the generation has ended."""
        return self._take(final=True)

    def _find_stop(self, search_from: int) -> None:
        cut = -1
        for stop in self._stop_strings:
            index = self.text.find(stop, search_from)
            if index >= 0 and (cut < 0 or index < cut):
                cut = index
        if cut >= 0:
            self.text = self.text[:cut]
            self.stopped = True

    def _take(self, *, final: bool) -> str:
        end = len(self.text) if final else max(self._num_emitted, len(self.text) - self._holdback)
        delta = self.text[self._num_emitted:end]
        self._num_emitted = end
        return delta
