"""The sandbox room: running untrusted WebAssembly components.

- programs.py     ProgramCache: validate a component against the world, compile, cache on disk
- build.py        `pie build`: a Python inferlet -> a component (componentize-py)
- instance.py     Instance: one guest's thread, Store, limits (memory, idle, blocking) and lifecycle
- instance_log.py InstanceLog: an instance's log and stdout / stderr lines, bounded in characters
- tables.py       InstanceTables: the per-instance queue, forward-future and page tables
- traps.py        a trap message -> the cause a user reads
- events.py       InstanceEvent / InstanceOutcome: what an instance reports
- wasmtime_fix.py patches of two wasmtime-py 50.0.1 races (applied when `host` is imported)
- fast_calls.py, gil_calls.py  host-function registration with frozen converters, GIL-keeping
                  value helpers (pinned to wasmtime-py 50.0.1 like wasmtime_fix)

May import: host.errors, host.kv (the page tables an instance owns), host.scheduling.types.
Never host.bindings (the runtime hands the linker in) or host.server.
"""
