"""One instance's log: runtime.log lines and its stdout / stderr, bounded in characters."""
from __future__ import annotations

import collections
import threading
from typing import Callable

__all__ = ["InstanceLog"]

_MAX_LOG_LINES = 2000
_MAX_LOG_LINE_CHARS = 8192       # a longer line is cut, saying how much was cut
_MAX_PARTIAL_BYTES = 4096        # output without a newline reaches the log past this


class InstanceLog:
    """The newest lines, at most `max_chars` characters and 2,000 lines (the oldest go first);
    each line at most 8,192 characters. `write_output` splits a WASI stream into lines.
    `on_line(line)` sees each line kept (for the host's debug log)."""

    def __init__(self, max_chars: int, on_line: Callable[[str], None]) -> None:
        self.max_chars = max_chars
        self._on_line = on_line
        self._lines: collections.deque[str] = collections.deque()
        self.num_chars = 0
        self._lock = threading.Lock()
        self._partial_output = {"stdout": b"", "stderr": b""}

    def lines(self) -> tuple[str, ...]:
        with self._lock:
            return tuple(self._lines)

    def append(self, line: str) -> None:
        if len(line) > _MAX_LOG_LINE_CHARS:
            line = f"{line[:_MAX_LOG_LINE_CHARS]}... ({len(line) - _MAX_LOG_LINE_CHARS} more " \
                   f"characters cut)"
        with self._lock:
            self._lines.append(line)
            self.num_chars += len(line)
            self._trim(self.max_chars)
        self._on_line(line)

    def trim(self, max_chars: int) -> None:
        """Keep only the newest lines holding at most max_chars characters."""
        with self._lock:
            self._trim(max_chars)

    def _trim(self, max_chars: int) -> None:
        while self._lines and (self.num_chars > max_chars or len(self._lines) > _MAX_LOG_LINES):
            self.num_chars -= len(self._lines.popleft())

    def write_output(self, stream: str, data: bytes, log: Callable[[str], None]) -> None:
        """Log each whole line of `stream` through `log` (a longer partial line too)."""
        buffered = self._partial_output[stream] + data
        *lines, rest = buffered.split(b"\n")
        for line in lines:
            log(f"{stream}: {line.decode('utf-8', errors='replace')}")
        if len(rest) > _MAX_PARTIAL_BYTES:   # a guest writing without newlines still reaches the log
            log(f"{stream}: {rest.decode('utf-8', errors='replace')}")
            rest = b""
        self._partial_output[stream] = rest

    def flush_output(self, log: Callable[[str], None]) -> None:
        for stream, rest in self._partial_output.items():
            if rest:
                log(f"{stream}: {rest.decode('utf-8', errors='replace')}")
        self._partial_output = {"stdout": b"", "stderr": b""}
