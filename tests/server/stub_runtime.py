"""TEMPORARY stand-in with Runtime's method names, until host/runtime.py lands. Echo instances."""
from __future__ import annotations

import hashlib
import itertools
import queue
import threading
from dataclasses import dataclass

from host.config import InstanceLimits, RuntimeConfig
from host.events import InstanceEvent, InstanceOutcome


@dataclass(frozen=True)
class StubProgram:
    hash: str


class StubRuntime:
    def __init__(self, engine, config=RuntimeConfig()):
        self.engine, self.config = engine, config
        self._ids = itertools.count(1)
        self._inboxes, self._threads, self._outcomes = {}, {}, {}

    def load_program(self, data):
        if not data.startswith(b"\0asm"):
            raise ValueError("bad magic")
        return StubProgram(hashlib.sha256(data).hexdigest())

    def launch(self, program, args=(), *, tenant="default", limits=None, on_event=None):
        iid = f"i{next(self._ids)}"
        inbox = queue.Queue()
        self._inboxes[iid] = inbox

        def run():
            while True:
                msg = inbox.get()
                if msg is None:
                    outcome = InstanceOutcome("terminated", "terminated")
                    break
                if msg == "quit":
                    outcome = InstanceOutcome("ok", "bye")
                    break
                on_event(InstanceEvent(iid, "message", msg))
            self._outcomes[iid] = outcome
            on_event(InstanceEvent(iid, outcome.event_kind, outcome.value))

        thread = threading.Thread(target=run, daemon=True)
        self._threads[iid] = thread
        thread.start()
        return iid

    def send(self, iid, message):
        self._inboxes[iid].put(message)

    def terminate(self, iid, reason=""):
        self._inboxes[iid].put(None)

    def wait(self, iid, timeout=None):
        self._threads[iid].join(timeout)
        return self._outcomes.get(iid)

    def close(self):
        for iid in list(self._inboxes):
            self.terminate(iid)

    def statistics(self):
        from types import SimpleNamespace as NS
        running = sum(t.is_alive() for t in self._threads.values())
        return NS(num_running=running, pool=NS(num_used=0, num_free=64),
                  scheduler=NS(num_pending=0, num_batches=0, batch_size_histogram=()),
                  engine=NS(num_output_tokens=0, num_input_tokens=0))
