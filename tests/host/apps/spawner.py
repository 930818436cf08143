"""A test inferlet for child inferlets; its first argument picks what it does (a parent's modes
spawn children of this same program in a child's mode)."""
import json

import inferlet
from inferlet import _wit


@inferlet.main
def main(args: list[str]) -> str:
    mode, rest = (args[0], args[1:]) if args else ("echo", [])
    return MODES[mode](rest)


def echo(args: list[str]) -> str:
    """Child: tell the parent it runs, answer one message upper-cased, return."""
    inferlet.send("ready")
    message = inferlet.receive()
    inferlet.send(message.upper())
    return "done " + " ".join(args)


def hold(args: list[str]) -> str:
    """Child: hold pages, say so, then wait for a message that never comes."""
    _wit.kv.allocate_pages(int(args[0]))
    inferlet.send("holding")
    return inferlet.receive()


def fan(args: list[str]) -> str:
    """Parent: one echo child per argument; each is sent its argument and answers."""
    kids = [inferlet.spawn("", ["echo", word]) for word in args]
    answers = []
    for kid, word in zip(kids, args):
        assert kid.receive() == "ready"
        kid.send(word)
        answers.append([kid.receive(), kid.result(), kid.receive()])
    return json.dumps(answers)


def flood(args: list[str]) -> str:
    """Parent: spawn up to N children, each killed at once (kill=1) or kept; stop at the first
    refusal and return how many were spawned and the refusal."""
    num_spawns, kill_each = int(args[0]), args[1] == "1"
    spawned = 0
    for _ in range(num_spawns):
        try:
            kid = inferlet.spawn("", ["hold", "0"])
        except inferlet.ChildError as exc:
            return json.dumps({"spawned": spawned, "refused": str(exc)})
        spawned += 1
        if kill_each:        # ended before the next spawn: only max_spawns can refuse
            kid.kill()
            try:
                kid.result()
            except inferlet.ChildError:
                pass
    return json.dumps({"spawned": spawned, "refused": None})


def bomb(args: list[str]) -> str:
    """Every instance spawns as many bombs as it may, each holding a page, then waits on them."""
    _wit.kv.allocate_pages(1)
    kids, refusal = [], None
    while True:
        try:
            kids.append(inferlet.spawn("", ["bomb"]))
        except inferlet.ChildError as exc:
            refusal = str(exc)
            break
    counts = {"instances": 1, "refusals": [refusal]}
    for kid in kids:
        try:
            below = json.loads(kid.result())
        except inferlet.ChildError as exc:
            counts["refusals"].append(str(exc))
            continue
        counts["instances"] += below["instances"]
        counts["refusals"] += below["refusals"]
    return json.dumps(counts)


def parent_hold(args: list[str]) -> str:
    """Parent: N children holding P pages each (one detached when the third argument is 1),
    tell the client their ids, then wait for a message that never comes."""
    num_kids, num_pages, detach_one = int(args[0]), args[1], args[2] == "1"
    kids = [inferlet.spawn("", ["hold", num_pages], detached=detach_one and i == 0)
            for i in range(num_kids)]
    for kid in kids:
        assert kid.receive() == "holding"
    inferlet.send(json.dumps([kid.id for kid in kids]))
    return inferlet.receive()


def kill(args: list[str]) -> str:
    """Parent: a child holding pages, killed once it holds them; its result and kill's answers."""
    kid = inferlet.spawn("", ["hold", args[0]])
    assert kid.receive() == "holding"
    first, second = kid.kill(), kid.kill()
    try:
        result = kid.result()
    except inferlet.ChildError as exc:
        result = f"ChildError: {exc}"
    return json.dumps([first, second, result, kid.receive()])


def other(args: list[str]) -> str:
    """Parent: spawn a program by name or hash; the refusal or the child's result."""
    try:
        return "result: " + inferlet.spawn(args[0], ["echo-none"] + args[1:]).result()
    except inferlet.ChildError as exc:
        return f"refused: {exc}"


def chatty(args: list[str]) -> str:
    """Child: send 1 MiB messages until stopped."""
    block = "x" * (1 << 20)
    while True:
        inferlet.send(block)


def deaf(args: list[str]) -> str:
    """Parent: a chatty child it never reads; how the child ended."""
    try:
        return "result: " + inferlet.spawn("", ["chatty"]).result()
    except inferlet.ChildError as exc:
        return f"ChildError: {exc}"


def quick(args: list[str]) -> str:
    """Child: return at once."""
    return "quick " + " ".join(args)


MODES = {"echo": echo, "hold": hold, "fan": fan, "flood": flood, "bomb": bomb,
         "parent_hold": parent_hold, "kill": kill, "other": other, "quick": quick,
         "echo-none": quick, "chatty": chatty, "deaf": deaf}
