"""Prefix caching: the first instance computes a system prompt and exports its KV; later
instances import it and skip its prefill (only their own question is computed).

    pie run inferlets/examples/prefix_cache.py -- --question "What is a prime number?"

The export is persistent (it outlives the instance) under --name; --release drops it at the end.
Returns JSON: {imported, prefix_tokens, answer}.
"""
import inferlet

DEFAULT_SYSTEM = ("You are a patient math tutor. You explain ideas with one short example, "
                  "avoid jargon, and keep every answer under three sentences.")


@inferlet.main
def main(args: list[str]) -> dict:
    parser = inferlet.ArgumentParser(prog="prefix_cache", description="Reuse a system prompt's KV.")
    parser.add_argument("--system", default=DEFAULT_SYSTEM)
    parser.add_argument("--question", default="What is a prime number?")
    parser.add_argument("--name", default="prefix-cache/tutor")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--release", action="store_true", help="release the export at the end")
    opts = parser.parse_args(args)

    imported = opts.name in inferlet.list_exports()
    if imported:
        ctx = inferlet.Context.from_import(opts.name)
    else:
        ctx = inferlet.Context()
        ctx.fill_system(opts.system)
        try:
            ctx.export(opts.name, persistent=True)
        except inferlet.InferletError:
            pass   # another instance exported it first; this one computed its own copy
    prefix_tokens = len(ctx.token_ids)
    ctx.fill_user(opts.question)
    answer = ctx.generate(opts.max_tokens)
    if opts.release:
        inferlet.release_export(opts.name)
    return {"imported": imported, "prefix_tokens": prefix_tokens, "answer": answer}
