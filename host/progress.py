"""Progress lines for the slow steps of the `pie` commands: what is being done, for how long.

    with progress("pie run", "compiling app.wasm"):
        ...

A step that ends within `after_s` says nothing. One that runs longer writes
"<prefix>: <what> ..." once it has run `after_s`, "<prefix>: still <what> (N s)" every `every_s`
after that, and "<prefix>: <what>: done in N s" (or "failed after N s") at its end: whether or
not the output is a terminal, so a log file shows every wait too. `write` receives each line
(default: stderr, flushed); it is called from a timer thread while the step runs.
"""
from __future__ import annotations

import sys
import threading
import time
from typing import Callable

__all__ = ["progress", "stderr_line"]


def stderr_line(line: str) -> None:
    """Write one line to stderr and flush it."""
    print(line, file=sys.stderr, flush=True)


class progress:
    """A context manager reporting one slow step (see the module docstring).

    prefix: the command ("pie run"; "": none, for a logger that adds its own); what: the step ("building app.py (componentize-py)");
    after_s: silence before the first line; every_s: between "still" lines;
    write: where lines go; quiet_while_running: no line until the end (a step that shows its own
    progress bar on a terminal), the closing line still written when it took past after_s.
    """

    def __init__(self, prefix: str, what: str, *, after_s: float = 2.0, every_s: float = 15.0,
                 write: Callable[[str], None] = stderr_line,
                 quiet_while_running: bool = False) -> None:
        if not after_s >= 0 or not every_s > 0:
            raise ValueError(f"progress: after_s must be >= 0 and every_s > 0, got {after_s}, "
                             f"{every_s}")
        self.prefix, self.what = prefix, what
        self.after_s, self.every_s = after_s, every_s
        self.write = write
        self.quiet_while_running = quiet_while_running
        self._done = threading.Event()
        self._started = 0.0
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "progress":
        self._started = time.monotonic()
        if not self.quiet_while_running:
            self._thread = threading.Thread(target=self._report, name="pie-progress",
                                            daemon=True)
            self._thread.start()
        return self

    def __exit__(self, exc_type: object, *_: object) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join()
        elapsed = time.monotonic() - self._started
        if elapsed >= self.after_s:
            outcome = "done in" if exc_type is None else "failed after"
            self._line(f"{self.what}: {outcome} {elapsed:.1f} s")

    def _report(self) -> None:
        if self._done.wait(self.after_s):
            return
        self._line(f"{self.what} ...")
        while not self._done.wait(self.every_s):
            self._line(f"still {self.what} ({time.monotonic() - self._started:.0f} s)")

    def _line(self, text: str) -> None:
        self.write(f"{self.prefix}: {text}" if self.prefix else text)
