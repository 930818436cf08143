"""The Wasm wing of the sandbox: wasmtime-py glue that every instance shares.

- wasmtime_fix.py  patches of two wasmtime-py 50.0.1 races (applied when `host` is imported)
- fast_calls.py    host functions registered with converters frozen per signature
- gil_calls.py     value helpers that keep the GIL (pinned to wasmtime-py 50.0.1 like wasmtime_fix)
- wit_codec.py     host-call values converted in C (`_wit_values`: wit_values.c, wit_lift.c,
                   wit_lower.c), wasmtime-py's converters where it is not built

May import: wasmtime, leaves. Nothing else of the host.
"""
