"""A test inferlet for outgoing HTTP and MCP calls through the SDK (inferlet.http, inferlet.mcp).
Every mode returns JSON; an HttpError / McpError is returned as {"error": message}."""
import json

import inferlet


def _answer(response) -> dict:
    return {"status": response.status, "text": response.text()[:300], "url": response.url,
            "type": response.headers.get("Content-Type")}


def _guarded(action) -> dict:
    try:
        return action()
    except (inferlet.http.HttpError, inferlet.mcp.McpError) as err:
        return {"error": str(err)}


@inferlet.main
def main(args: list[str]) -> str:
    mode = args[0]
    if mode == "get":                     # get URL
        return json.dumps(_guarded(lambda: _answer(inferlet.http.get(args[1]))))
    if mode == "post":                    # post URL JSON
        return json.dumps(_guarded(lambda: {**_answer(inferlet.http.post(
            args[1], json=json.loads(args[2]))), "json": inferlet.http.post(
            args[1], json=json.loads(args[2])).json()}))
    if mode == "many":                    # many URL N: N requests in flight at once
        pending = [inferlet.http.start("GET", args[1]) for _ in range(int(args[2]))]
        return json.dumps([_guarded(lambda p=p: _answer(p.result())) for p in pending])
    if mode == "tools":                   # tools SERVER
        return json.dumps(_guarded(lambda: {"servers": inferlet.mcp.servers(), "tools": [
            {"name": t.name, "schema": t.input_schema} for t in inferlet.mcp.tools(args[1])]}))
    if mode == "call":                    # call SERVER TOOL JSON
        return json.dumps(_guarded(lambda: {"structured": inferlet.mcp.call(
            args[1], args[2], json.loads(args[3])).structured}))
    raise inferlet.InferletError(f"unknown mode {mode!r}")
