"""Beam search: keep the `--beam-width` most likely continuations at every step.

    pie run inferlets/examples/beam_search.py -- --prompt "The best way to learn is" --beam-width 3

Each beam is a fork; a step asks every beam's pass for its top tokens (a distribution output),
all passes in flight together. Returns JSON: [{text, token_ids, log_prob}, ...], best first.
"""
import inferlet


@inferlet.main
def main(args: list[str]) -> list:
    parser = inferlet.ArgumentParser(prog="beam_search", description="Beam search decoding.")
    parser.add_argument("--prompt", default="The best way to learn a language is")
    parser.add_argument("--beam-width", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=12)
    opts = parser.parse_args(args)

    ctx = inferlet.Context()
    ctx.fill(opts.prompt)
    beams = inferlet.beam_search(ctx, opts.beam_width, opts.max_tokens)
    return [{"text": b.text, "token_ids": list(b.token_ids), "log_prob": b.log_prob} for b in beams]
