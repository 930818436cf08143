"""Attention sink over a long input: read a document far longer than the window, then answer,
with the KV memory bounded all along (StreamingLLM: the first tokens + a sliding window).

    pie run inferlets/examples/attention_sink.py -- --num-chunks 20 --sink 4 --window 64

The input is read --chunk-tokens at a time; after every chunk (and every page of the answer)
every KV slot but the first --sink and the last --window is masked and the fully masked pages are
freed (`Context.keep_window`). Positions keep growing, so RoPE stays consistent. Unlike
windowed_attention.py (which windows only the generation), the prompt itself never lives in full.
Returns JSON: {text, num_input_tokens, num_generated, max_pages, num_pages_freed}.
"""
import inferlet

DEFAULT_TEXT = ("The river ran past the old mill, where the miller counted sacks of grain each "
                "morning and sang to the birds on the roof. ")


@inferlet.main
def main(args: list[str]) -> dict:
    parser = inferlet.ArgumentParser(prog="attention_sink", description=__doc__)
    parser.add_argument("--text", default=DEFAULT_TEXT, help="one chunk of the long input")
    parser.add_argument("--num-chunks", type=int, default=12, help="times the text is read")
    parser.add_argument("--sink", type=int, default=4, help="first tokens always attended")
    parser.add_argument("--window", type=int, default=48, help="most recent tokens attended")
    parser.add_argument("--max-tokens", type=int, default=32)
    opts = parser.parse_args(args)
    if opts.sink < 0 or opts.window < 1 or opts.num_chunks < 1:
        raise inferlet.InferletError("--sink must be >= 0, --window and --num-chunks >= 1")

    ctx = inferlet.Context()
    chunk_ids = inferlet.encode(opts.text)
    max_pages, num_freed = 0, 0
    for _ in range(opts.num_chunks):
        ctx.fill(chunk_ids)
        ctx.flush()
        ctx.synchronize()   # the chunk's KV is written before its window is cut
        max_pages = max(max_pages, len(ctx.page_ids))
        num_freed += ctx.keep_window(opts.sink, opts.window)
    ctx.fill("\nIn short,")
    generation = ctx.generation(opts.max_tokens)
    while not generation.done:
        generation.receive(generation.submit())
        max_pages = max(max_pages, len(ctx.page_ids))
        if len(generation.token_ids) % ctx.page_size == 0:
            num_freed += ctx.keep_window(opts.sink, opts.window)
    ctx.close()
    return {"text": generation.text, "num_input_tokens": opts.num_chunks * len(chunk_ids),
            "num_generated": len(generation.token_ids), "max_pages": max_pages,
            "num_pages_freed": num_freed}
