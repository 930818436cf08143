"""ReAct: think, act, observe, repeat. The KV of the whole episode stays in the context: each
observation is appended to it and nothing earlier is recomputed.

    pie run inferlets/examples/react.py -- --task "Plan a trip to Rome." --num-calls 3

Each turn the model writes a thought and an action (one assistant turn, greedy, at most
--turn-tokens tokens); the action runs as a simulated tool that takes --delay-ms (100 ms by
default, as in the Pie paper's evaluation) and returns a fixed observation, appended as the next
user turn. With --system-export NAME the system prompt's KV is imported from the export NAME when
it exists (no prefill) and exported there (persistent) otherwise.
Returns JSON: {turns, observations, answer, num_generated, num_context_tokens, imported}.
"""
import time

import inferlet

SYSTEM = ("You are an agent that solves tasks step by step. Each turn write one short Thought "
          "and one Action: search(query). You then get an Observation.")


def observe(call_index: int) -> str:
    """The simulated tool's answer to the `call_index`-th action (0-based)."""
    return f"Observation {call_index + 1}: the search found one more useful fact."


@inferlet.main
def main(args: list[str]) -> dict:
    parser = inferlet.ArgumentParser(prog="react", description="A ReAct agent with a simulated tool.")
    parser.add_argument("--task", default="Find the tallest mountain in Europe.")
    parser.add_argument("--system", default=SYSTEM)
    parser.add_argument("--num-calls", type=int, default=3, help="tool calls before the answer")
    parser.add_argument("--delay-ms", type=float, default=100.0, help="simulated tool latency")
    parser.add_argument("--turn-tokens", type=int, default=16)
    parser.add_argument("--system-export", default="", help="export name of the system prompt")
    parser.add_argument("--release", action="store_true", help="release the export at the end")
    opts = parser.parse_args(args)
    if opts.num_calls < 0 or opts.delay_ms < 0:
        raise inferlet.InferletError("--num-calls and --delay-ms must be >= 0")

    ctx, imported = inferlet.shared_system_context(opts.system, opts.system_export)
    ctx.fill_user(opts.task)
    turns, observations, num_generated = [], [], 0
    for call_index in range(opts.num_calls):
        generation = ctx.generation(opts.turn_tokens).run()   # thought + action
        turns.append(generation.text)
        num_generated += len(generation.token_ids)
        time.sleep(opts.delay_ms / 1000)                      # the tool runs
        observations.append(observe(call_index))
        ctx.fill_user(observations[-1])
    final = ctx.generation(opts.turn_tokens).run()
    num_generated += len(final.token_ids)
    num_context_tokens = len(ctx.token_ids)
    ctx.close()
    if opts.release and opts.system_export:
        inferlet.release_export(opts.system_export)
    return {"turns": turns, "observations": observations, "answer": final.text,
            "num_generated": num_generated, "num_context_tokens": num_context_tokens,
            "imported": imported}
