"""Runs the wasmtime-py 50.0.1 thread-safety race (a script, run in a subprocess by
test_wasmtime_fix.py so that the unfixed run never imports `host`).

usage: python tests/host/wasmtime_race.py COMPONENT.wasm fixed|unfixed NUM_THREADS NUM_CALLS

Each thread runs the race guest (tests/host/wat/race.wat) NUM_CALLS times, each in a fresh Store:
many `result`/`option` lowerings, then a host function that raises ValueError("boom <thread>").
A call is correct when it raises exactly its own thread's ValueError. Prints a JSON summary.
"""
from __future__ import annotations

import json
import sys
import threading


def main() -> None:
    path, mode, num_threads, num_calls = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    if mode == "fixed":
        from host.sandbox.wasm import wasmtime_fix
        wasmtime_fix.apply()
    from wasmtime import Engine, Store
    from wasmtime.component import Component, Linker

    sys.setswitchinterval(1e-6)   # switch threads as often as possible: make the race likely
    engine = Engine()
    component = Component(engine, open(path, "rb").read())
    tags = threading.local()
    linker = Linker(engine)
    with linker.root() as root:
        with root.add_instance("pie:inferlet/kv@0.1.0") as kv:
            kv.add_func("import-pages", lambda store, name: [1, 2, 3] if tags.even else "nope")
            kv.add_func("list-exports", lambda store: (_ for _ in ()).throw(
                ValueError(f"boom {tags.name}")))
        with root.add_instance("pie:inferlet/messaging@0.1.0") as messaging:
            messaging.add_func("try-receive", lambda store: None if tags.even else "msg")
    errors: list[str] = []
    lock = threading.Lock()
    barrier = threading.Barrier(num_threads)

    def worker(index: int) -> None:
        tags.name, tags.even = f"t{index}", index % 2 == 0
        barrier.wait()
        for _ in range(num_calls):
            store = Store(engine)
            try:
                instance = linker.instantiate(store, component)
                instance.get_func(store, "run")(store)
                problem = "no exception"
            except ValueError as exc:
                problem = None if str(exc) == f"boom {tags.name}" else f"wrong exception: {exc}"
            except Exception as exc:  # noqa: BLE001
                problem = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0]}"
            if problem is not None:
                with lock:
                    errors.append(problem)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(num_threads)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    print(json.dumps({"calls": num_threads * num_calls, "errors": len(errors),
                      "samples": sorted(set(errors))[:5]}))


if __name__ == "__main__":
    main()
