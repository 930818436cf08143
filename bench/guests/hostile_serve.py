"""Hostile guest for bench/hostile_serve.py, through the SDK; the first argument picks the attack.

    memory          double a str until the memory limit stops it
    topic N         subscribe to "news", then broadcast N messages of 512 Ki characters to it,
                    never reading one (the subscription's inbox must drop the oldest)
    result N        return a string of N characters (past max_result_chars)
    log N           print N lines of 8,000 characters to stdout (the log keeps its newest)
"""
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
    raise inferlet.InferletError(f"unknown attack {attack!r}")
