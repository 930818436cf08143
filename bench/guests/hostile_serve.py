"""Hostile guest for bench/hostile_serve.py, through the SDK; the first argument picks the attack.

    memory          double a str until the memory limit stops it
    topic N         subscribe to "news", then broadcast N messages of 512 Ki characters to it,
                    never reading one (the subscription's inbox must drop the oldest)
    result N        return a string of N characters (past max_result_chars)
    log N           print N lines of 8,000 characters to stdout (the log keeps its newest)
    spawn-flood N   spawn N children one after another, each killed at once (max_spawns stops
                    it); result: how many, and the refusal
    fork-bomb       every instance spawns fork bombs until refused, then waits for them;
                    result: the instances of its tree and the limits that stopped it
"""
import json

import inferlet


@inferlet.main
def main(args: list[str]) -> str:
    attack = args[0]
    if attack == "memory":
        text = "x" * 1024
        while True:
            text = text + text
    if attack == "topic":
        inferlet.subscribe("news")
        chunk = "n" * (512 * 1024)
        for _ in range(int(args[1])):
            inferlet.broadcast("news", chunk)
        return f"broadcast {args[1]} messages"
    if attack == "result":
        return "r" * int(args[1])
    if attack == "log":
        line = "l" * 8000
        for _ in range(int(args[1])):
            print(line)
        return f"printed {args[1]} lines"
    if attack == "spawn-flood":
        for count in range(int(args[1])):
            try:
                child = inferlet.spawn("", ["fork-leaf"])
            except inferlet.ChildError as exc:
                return f"spawned {count}, then refused: {exc}"
            child.kill()
        return f"spawned {args[1]}"
    if attack == "fork-bomb":
        return json.dumps(fork_bomb())
    if attack == "fork-leaf":
        return "leaf"
    raise inferlet.InferletError(f"unknown attack {attack!r}")


def fork_bomb() -> dict:
    """Spawn fork bombs until refused, then wait for them: the tree's size and refusals."""
    kids, refusals = [], set()
    while True:
        try:
            kids.append(inferlet.spawn("", ["fork-bomb"]))
        except inferlet.ChildError as exc:
            refusals.add(str(exc).split(": refused", 1)[-1][:80])
            break
    size = 1
    for kid in kids:
        try:
            below = json.loads(kid.result())
        except inferlet.ChildError as exc:
            refusals.add(str(exc)[:80])
            continue
        size += below["instances"]
        refusals.update(below["refusals"])
    return {"instances": size, "refusals": sorted(refusals)}
