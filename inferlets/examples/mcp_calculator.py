"""MCP calculator: the model calls a tool of an MCP server, its arguments constrained by the
tool's own JSON schema, so they always parse and fit the tool.

    pie run --mcp calc="python tests/host/servers/mcp_calculator.py" \
        inferlets/examples/mcp_calculator.py -- --question "What is 12 times 7?" --tool multiply

The host reaches the server (an MCP server the operator configured: `pie run --mcp NAME=COMMAND`,
or a tenant's `mcp_servers` in pie.toml); the inferlet lists its tools (inferlet.mcp.tools),
asks the model for the chosen tool's arguments with `schema=tool.input_schema` (the host masks
every token to what keeps the JSON valid for that schema), calls the tool (inferlet.mcp.call)
and lets the model answer with the result in its context.
Returns JSON: {tools, tool, arguments, result, is_error, answer}.
"""
import json

import inferlet

SYSTEM = "You are a careful assistant that uses a calculator tool for arithmetic."


@inferlet.main
def main(args: list[str]) -> str:
    parser = inferlet.ArgumentParser(prog="mcp_calculator", description="Call an MCP tool.")
    parser.add_argument("--server", default="calc", help="the MCP server's name on the host")
    parser.add_argument("--question", default="What is 12 times 7?")
    parser.add_argument("--tool", default="multiply", help="the tool to call")
    parser.add_argument("--max-tokens", type=int, default=48, help="for the arguments")
    opts = parser.parse_args(args)

    tools = {tool.name: tool for tool in inferlet.mcp.tools(opts.server)}
    if opts.tool not in tools:
        raise inferlet.InferletError(f"server {opts.server!r} has no tool {opts.tool!r} "
                                     f"(it has {sorted(tools)})")
    tool = tools[opts.tool]
    ctx = inferlet.Context()
    ctx.fill_system(SYSTEM)
    ctx.fill_user(f"{opts.question}\nCall the tool `{tool.name}` ({tool.description}). "
                  f"Write only its arguments as JSON.")
    generation = ctx.generation(opts.max_tokens, schema=tool.input_schema).run()
    if generation.finish_reason == "length":
        raise inferlet.InferletError(f"the arguments did not end within {opts.max_tokens} tokens: "
                                     f"{generation.text!r}")
    arguments = json.loads(generation.text)
    result = tool.call(arguments)
    ctx.fill_user(f"The tool returned: {result.text}. Answer the question in one sentence.")
    answer = ctx.generate(32)
    ctx.close()
    return json.dumps({"tools": sorted(tools), "tool": tool.name, "arguments": arguments,
                       "result": result.structured, "is_error": result.is_error,
                       "answer": answer})
