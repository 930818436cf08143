"""Text completion: continue a prompt.

    pie run inferlets/examples/text_completion.py -- --prompt "The capital of France is" --max-tokens 16

Greedy by default (--temperature 0); --seed makes sampling reproducible. --stream sends the text
to the client as it is generated (and returns ""); --json returns {text, token_ids, finish_reason}.
--step-by-step decodes with one forward.submit per token instead of the SDK's host loops (the
same tokens; for comparison).
"""
import inferlet


# Built at import time, so it is part of the component's pre-initialized heap: each instance
# only parses (building it took ~1.7 of the ~3 ms from an instance's start to its first pass).
PARSER = inferlet.ArgumentParser(prog="text_completion", description="Continue a prompt.")
PARSER.add_argument("--prompt", default="The capital of France is")
PARSER.add_argument("--max-tokens", type=int, default=32)
PARSER.add_argument("--temperature", type=float, default=0.0)
PARSER.add_argument("--top-p", type=float, default=1.0)
PARSER.add_argument("--seed", type=int, default=None)
PARSER.add_argument("--chat", action="store_true", help="send the prompt as a user message")
PARSER.add_argument("--stream", action="store_true", help="send text as it is generated")
PARSER.add_argument("--json", action="store_true", help="return text, token ids, finish reason")
PARSER.add_argument("--ignore-eos", action="store_true", help="do not stop at stop tokens")
PARSER.add_argument("--step-by-step", action="store_true",
                    help="one forward.submit per token, not host loops")


@inferlet.main
def main(args: list[str]) -> str:
    opts = PARSER.parse_args(args)

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
