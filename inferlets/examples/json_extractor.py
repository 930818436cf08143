"""JSON extractor: pull structured fields out of free text, as JSON that always parses.

    pie run inferlets/examples/json_extractor.py -- --text "Ada Lovelace, 36, lives in London."

The output is constrained on the host by a JSON schema (`schema=...`): every token is masked to
what keeps the answer valid, in the same pass as the sampling, so the result parses and
validates whatever the seed, provided it ends within --max-tokens: cut off there it is valid so
far but unfinished (`finish_reason == "length"`), and the inferlet fails saying so.
--seed samples (temperature 0.7) instead of greedy.
"""
import json

import inferlet

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"type": "string", "maxLength": 40},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}


@inferlet.main
def main(args: list[str]) -> str:
    parser = inferlet.ArgumentParser(prog="json_extractor", description="Extract JSON fields.")
    parser.add_argument("--text", default="Ada Lovelace is 36 years old and lives in London.")
    parser.add_argument("--schema", default=None, help="a JSON schema (default: name/age/city)")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--max-tokens", type=int, default=80)
    opts = parser.parse_args(args)

    schema = json.loads(opts.schema) if opts.schema else PERSON
    sampler = inferlet.sampling.greedy() if opts.seed is None else \
        inferlet.sampling.temperature(0.7, seed=opts.seed)
    with inferlet.Context() as ctx:
        ctx.fill_system("Extract the fields as JSON.")
        ctx.fill_user(opts.text)
        answer = ctx.generation(opts.max_tokens, sampler, schema=schema).run()
        if answer.finish_reason == "length":   # the grammar was not complete: no valid JSON yet
            raise inferlet.InferletError(f"the answer was cut off at --max-tokens "
                                         f"{opts.max_tokens} before the JSON was complete: "
                                         f"{answer.text!r}")
        return answer.text
