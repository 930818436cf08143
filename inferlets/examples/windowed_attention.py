"""Attention sink + sliding window: generate far past the window with bounded KV memory.

    pie run inferlets/examples/windowed_attention.py -- --max-tokens 200 --sink 4 --window 32

After every page's worth of tokens, every KV slot but the first --sink and the last --window is
masked, and pages that are fully masked are freed. Every --report-every tokens the inferlet
sends {"tokens": n, "pages": held} to the client. Returns JSON: {text, num_tokens, max_pages}.
"""
import inferlet


@inferlet.main
def main(args: list[str]) -> dict:
    parser = inferlet.ArgumentParser(prog="windowed_attention", description=__doc__)
    parser.add_argument("--prompt", default="Once upon a time, in a small village by the sea,")
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--sink", type=int, default=4, help="first tokens always attended")
    parser.add_argument("--window", type=int, default=32, help="most recent tokens attended")
    parser.add_argument("--report-every", type=int, default=0, help="0: never")
    opts = parser.parse_args(args)

    ctx = inferlet.Context()
    ctx.fill(opts.prompt)
    # stop_token_ids=(): keep going past an end-of-text token, to exercise the window
    generation = ctx.generation(opts.max_tokens, stop_token_ids=())
    max_pages = 0
    while not generation.done:
        generation.receive(generation.submit())
        num_tokens = len(generation.token_ids)
        if num_tokens % ctx.page_size == 0:
            ctx.keep_window(opts.sink, opts.window)
        max_pages = max(max_pages, len(ctx.page_ids))
        if opts.report_every and num_tokens % opts.report_every == 0:
            inferlet.send_json({"tokens": num_tokens, "pages": len(ctx.page_ids)})
    return {"text": generation.text, "num_tokens": len(generation.token_ids),
            "max_pages": max_pages}
