"""The scheduling room: turning every instance's submitted passes into engine batches.

- work.py       PreparedForward / PreparedCopy: checked work on physical pages (made by host.kv)
- types.py      SchedulerPolicy (config), SchedulerStats, SubmissionFuture
- scheduler.py  BatchScheduler: per-queue FIFO order, priorities, the batch policy, one engine
                thread; fails only the request the engine names (engine.errors.RequestError)

May import: engine (batch types, EngineLike, errors), host.errors. Never host.kv or the sandbox.
"""
