"""A test inferlet for the CLI and the SDK's error paths; its first argument picks what it does."""
import json

import inferlet
from inferlet import _wit, sharing


@inferlet.main
def main(args: list[str]) -> str:
    mode = args[0] if args else "ok"
    if mode == "ok":
        return "probe ok " + " ".join(args[1:])
    if mode == "stream":
        for index in range(3):
            inferlet.send(f"line {index}\n")
        return "done"
    if mode == "echo":   # streams "ready" first, then waits for the client
        inferlet.send("ready\n")
        return "echo: " + inferlet.receive()
    if mode == "error":
        raise inferlet.InferletError("probe failed on purpose")
    if mode == "exception":
        return str(1 / 0)
    if mode == "trap":
        _wit.kv.free_pages([987654])   # an id this instance does not own: the host traps it
        return "unreachable"
    if mode == "memory":
        hog = []
        while True:
            hog.append(bytearray(1 << 20))
    if mode == "strings":   # doubling a str: CPython reports a TypeError when it no longer fits
        text = "x"
        while True:
            text = text + text
    if mode == "info":
        info = inferlet.model_info()
        return f"{info.name} page_size={info.page_size} stop={list(info.stop_token_ids)}"
    if mode == "forks":   # generate from contexts whose tokens are all computed
        prompt, num_tokens = args[1], int(args[2])
        ctx = inferlet.Context()
        ctx.fill(prompt)
        ctx.flush()
        forks = [ctx.fork() for _ in range(2)]   # nothing pending in ctx or the forks
        ctx.export("probe-forks")
        imported = inferlet.Context.from_import("probe-forks")
        runs = [c.generate_tokens(num_tokens, stop_token_ids=()) for c in forks + [ctx, imported]]
        return json.dumps(runs)
    if mode == "quota":   # one generation on host loops under the instance's page quota
        ctx = inferlet.Context()
        ctx.fill(args[1])
        return json.dumps(ctx.generate_tokens(int(args[2]), stop_token_ids=(),
                                              host_loop=args[3] == "loop"))
    if mode == "loops":   # the same greedy tokens step by step, on host loops, and resumed
        prompt, num_tokens, num_first = args[1], int(args[2]), int(args[3])
        runs = []
        for host_loop in (False, True):
            ctx = inferlet.Context()
            ctx.fill(prompt)
            runs.append(ctx.generate_tokens(num_tokens, stop_token_ids=(), host_loop=host_loop))
        ctx = inferlet.Context()
        ctx.fill(prompt)
        generation = ctx.generation(num_tokens, stop_token_ids=(), stream_text=True)
        for _ in zip(range(num_first), generation.steps()):   # stop reading early
            pass
        first = list(generation.token_ids)
        runs.append(first + ctx.generate_tokens(num_tokens - len(first), stop_token_ids=()))
        ctx = inferlet.Context()                 # read part-way on loops, then stepped
        ctx.fill(prompt)
        generation = ctx.generation(num_tokens, stop_token_ids=(), stream_text=True)
        for _ in zip(range(num_first), generation.steps()):
            pass
        while not generation.done:
            generation.step()
        runs.append(generation.token_ids)
        ctx = inferlet.Context()                 # two generations in a row on one context
        ctx.fill(prompt)
        first = ctx.generate_tokens(num_first, stop_token_ids=())
        runs.append(first + ctx.generate_tokens(num_tokens - num_first, stop_token_ids=()))
        return json.dumps(runs)
    if mode == "prefix":   # prefix_context beside a bogus export of its name, then alone
        token_ids, num_tokens = inferlet.encode(args[1]), int(args[2])
        num_shared = inferlet.model_info().page_size
        name = sharing.prefix_export_name(token_ids[:num_shared])
        bogus = inferlet.Context()                 # the right name, other tokens
        bogus.fill(list(reversed(token_ids[:num_shared])))
        bogus.export(name)
        runs = []
        for _ in range(4):                          # refused twice; then computed, imported
            if len(runs) == 2:
                inferlet.release_export(name)
            ctx = inferlet.prefix_context(token_ids, num_shared, 4)
            runs.append(ctx.generate_tokens(num_tokens, stop_token_ids=()))
            ctx.close()
        kept = name in inferlet.list_exports()
        inferlet.release_export(name)
        return json.dumps({"runs": runs, "kept": kept, "left": inferlet.list_exports()})
    raise inferlet.InferletError(f"unknown mode {mode!r}")
