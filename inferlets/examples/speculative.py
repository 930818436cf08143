"""Speculative completion with prompt lookup: drafts copied from the prompt, verified in one pass.

    pie run inferlets/examples/speculative.py -- --text "The quick brown fox jumps over the lazy dog."

The task copies from its prompt (rewrite a text), so an n-gram drafter (`PromptLookupDrafter`)
guesses several next tokens at once; each step verifies them in one pass and keeps the longest
prefix the model agrees with. Greedy output is token for token the same as without drafting
(--no-draft). --json returns the text, token ids and the drafting statistics.
"""
import inferlet


@inferlet.main
def main(args: list[str]) -> str:
    parser = inferlet.ArgumentParser(prog="speculative", description="Copy-heavy completion.")
    parser.add_argument("--text", default="The quick brown fox jumps over the lazy dog near "
                                          "the river bank, while the old cat sleeps in the sun.")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--num-drafts", type=int, default=6)
    parser.add_argument("--no-draft", action="store_true", help="decode one token per pass")
    parser.add_argument("--json", action="store_true")
    opts = parser.parse_args(args)

    drafter = None if opts.no_draft else inferlet.PromptLookupDrafter(num_drafts=opts.num_drafts)
    with inferlet.Context() as ctx:
        ctx.fill_user(f"Repeat this text exactly:\n{opts.text}")
        generation = ctx.generation(opts.max_tokens, drafter=drafter).run()
    if not opts.json:
        return generation.text
    return {"text": generation.text, "token_ids": generation.token_ids,
            "num_verify_passes": generation.num_verify_passes,
            "num_drafted": generation.num_drafted, "num_accepted": generation.num_accepted}
