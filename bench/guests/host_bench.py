"""Benchmark guest for bench/host_overhead.py, through the SDK.

    noop            return at once (launch to result)
    idle            send "ready", then block in receive() until a message arrives; return it
    decode N        fill one token, then N greedy decode steps (stop tokens ignored), on host
                    decode loops (the SDK's default)
    decode-steps N  the same, one forward.submit + get per token (host_loop=False)
"""
import inferlet


@inferlet.main
def main(args: list[str]) -> str:
    mode = args[0] if args else "noop"
    if mode == "idle":
        inferlet.send("ready")
        return inferlet.receive()
    if mode in ("decode", "decode-steps"):
        ctx = inferlet.Context()
        ctx.fill([97])
        generation = ctx.generation(int(args[1]), inferlet.sampling.greedy(), stop_token_ids=(),
                                    host_loop=mode == "decode")
        generation.run()
        return str(len(generation.token_ids))
    return "ok"
