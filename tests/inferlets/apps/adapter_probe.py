"""A test inferlet for LoRA adapters: generate with Context(adapter=...) and per-call overrides."""
import json

import inferlet


@inferlet.main
def main(args: list[str]) -> str:
    mode = args[0]
    if mode == "available":
        return json.dumps(inferlet.available_adapters())
    if mode == "unknown":
        try:
            inferlet.Context(adapter=args[1])
        except inferlet.InferletError as err:
            return "refused: " + str(err)
        return "accepted"
    # generate NAME NUM_TOKENS TOKEN_IDS...: with the adapter, then the same prompt on the base
    # model through a per-call override, then once more with the adapter after the override
    name, num_tokens = args[1], int(args[2])
    prompt = [int(t) for t in args[3:]]
    ctx = inferlet.Context(adapter=name)
    base = inferlet.Context()
    other = inferlet.Context(adapter=name)
    ctx.fill(prompt)
    base.fill(prompt)
    other.fill(prompt)
    with_adapter = ctx.generate_tokens(num_tokens, stop_token_ids=[])
    overridden = other.generate_tokens(num_tokens, stop_token_ids=[], adapter=None)
    plain = base.generate_tokens(num_tokens, stop_token_ids=[])
    bound_after = other.adapter.name if other.adapter else None
    return json.dumps({"adapter": with_adapter, "override": overridden, "base": plain,
                       "bound_after": bound_after})
