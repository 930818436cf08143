"""Text completion: continue a prompt.

    pie run inferlets/examples/text_completion.py -- --prompt "The capital of France is" --max-tokens 16

Greedy by default (--temperature 0); --seed makes sampling reproducible. --stream sends the text
to the client as it is generated (and returns ""); --json returns {text, token_ids, finish_reason}.
--step-by-step decodes with one forward.submit per token instead of the SDK's host loops (the
same tokens; for comparison).
"""
import inferlet


@inferlet.main
def main(args: list[str]) -> str:
    parser = inferlet.ArgumentParser(prog="text_completion", description="Continue a prompt.")
    parser.add_argument("--prompt", default="The capital of France is")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--chat", action="store_true", help="send the prompt as a user message")
    parser.add_argument("--stream", action="store_true", help="send text as it is generated")
    parser.add_argument("--json", action="store_true", help="return text, token ids, finish reason")
    parser.add_argument("--ignore-eos", action="store_true", help="do not stop at stop tokens")
    parser.add_argument("--step-by-step", action="store_true",
                        help="one forward.submit per token, not host loops")
    opts = parser.parse_args(args)

    if opts.temperature == 0:
        sampler = inferlet.sampling.greedy()
    else:
        sampler = inferlet.Sampler("sample", temperature=opts.temperature, top_p=opts.top_p,
                                   seed=opts.seed)
    ctx = inferlet.Context()
    if opts.chat:
        ctx.fill_user(opts.prompt)
    else:
        ctx.fill(opts.prompt)
    generation = ctx.generation(opts.max_tokens, sampler, stream_text=opts.stream,
                                stop_token_ids=() if opts.ignore_eos else None,
                                host_loop=not opts.step_by_step)
    if opts.stream:
        for delta in generation.steps():
            inferlet.send(delta)
    else:
        generation.run()
    if opts.json:
        return {"text": generation.text, "token_ids": generation.token_ids,
                "finish_reason": generation.finish_reason}
    return "" if opts.stream else generation.text
