"""The scheduling room: turning every instance's submitted passes into engine batches.

- scheduler.py    BatchScheduler: the queues, one step (take, run, resolve), the engine thread
- policy.py       when a batch fires and what it holds: pure functions, and the fair shares
- lookahead.py    passes prepared ahead of the engine: depth 1 (overlap) or N (chained steps)
- decode_loop.py  DecodeLoop: a host-run decode loop (`forward.submit-decode`)
- items.py        one submission's life: its future, its Item while it waits (or a chunk of
                  one), the engine call of a batch (one bad request fails alone), its end
- types.py        SchedulerPolicy (config) and SchedulerStats
- work.py         PreparedForward / PreparedCopy: checked work on physical pages (made by host.kv)
- helper_thread.py the look-ahead's helper thread

May import: engine (batch types, EngineLike, errors, chunking), host.errors. Never host.kv, the
sandbox or the bindings (they reach it through its public methods).
"""
