"""A tool-using agent: the model picks the tool's argument, the client runs the tool.

    pie run inferlets/examples/agent.py -- --task "What is the weather in Paris?"

Protocol with the client (JSON messages): the inferlet sends
{"type": "tool_call", "name": "get_weather", "arguments": {"city": ...}} and waits for one
message, the tool's result (any text). The model then writes the final answer from the result.
Returns JSON: {tool_calls: [...], observations: [...], answer}.
"""
import inferlet

SYSTEM = ("You are an assistant with one tool: get_weather(city) returns the current weather of "
          "a city. Call it as Action: get_weather(\"city\"), then answer from its Observation.")


@inferlet.main
def main(args: list[str]) -> dict:
    parser = inferlet.ArgumentParser(prog="agent", description="An agent that calls a tool.")
    parser.add_argument("--task", default="What is the weather in Paris?")
    parser.add_argument("--max-tokens", type=int, default=32)
    opts = parser.parse_args(args)

    ctx = inferlet.Context()
    ctx.fill_system(SYSTEM)
    ctx.fill_user(opts.task)
    ctx.fill_generation_prompt()
    ctx.fill('Action: get_weather("')     # the agent decides to act; the model names the city
    city = ctx.generate(8, stop=['"', "\n"]).strip() or "unknown"
    call = {"type": "tool_call", "name": "get_weather", "arguments": {"city": city}}
    inferlet.send_json(call)
    observation = inferlet.receive()
    ctx.fill(f'")\nObservation: {observation}\nAnswer:')
    answer = ctx.generate(opts.max_tokens, stop=["\n\n", "Action:"]).strip()
    return {"tool_calls": [call], "observations": [observation], "answer": answer}
