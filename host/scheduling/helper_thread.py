"""`HelperThread`: one thread that runs one call at a time for another (the overlapped engine
loop's helper, host/scheduling/lookahead.py).

Handing a call over is two lock releases (no Future, no queue, no Condition): on the engine
thread's path between two batches every microsecond counts.
"""
from __future__ import annotations

import threading
from typing import Any, Callable

__all__ = ["HelperThread"]


class _Raised:
    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


class HelperThread:
    """`start(function, *args)`, then `result()` (its return value, or its exception raised),
    strictly alternating, from one thread. A context manager: leaving it ends the thread."""

    def __init__(self, name: str) -> None:
        self._go = threading.Lock()
        self._done = threading.Lock()
        self._go.acquire()
        self._done.acquire()
        self._call: tuple[Callable[..., Any] | None, tuple] = (None, ())
        self._outcome: Any = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def start(self, function: Callable[..., Any], *args: Any) -> None:
        self._call = (function, args)
        self._go.release()

    def result(self) -> Any:
        """Wait for the call started last; its value, or its exception raised here."""
        self._done.acquire()
        outcome, self._outcome = self._outcome, None
        if isinstance(outcome, _Raised):
            raise outcome.error
        return outcome

    def __enter__(self) -> "HelperThread":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._call = (None, ())
        self._go.release()
        self._thread.join()

    def _run(self) -> None:
        while True:
            self._go.acquire()
            (function, args), self._call = self._call, (None, ())
            if function is None:
                return
            try:
                self._outcome = function(*args)
            except BaseException as error:  # noqa: BLE001 -- handed to result()
                self._outcome = _Raised(error)
            del function, args
            self._done.release()
