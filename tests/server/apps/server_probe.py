"""A test inferlet for the server tests; the first argument picks what it does.

echo                  send back every client message until "quit"; result "bye"
store-set K V         set K=V in the tenant's store; result "ok"
store-get K           result: the value, or "<none>"
export NAME           fill a prompt, export its KV as NAME, then wait for a client message
import NAME           result "imported N tokens" or "import failed: <cause>"
generate N            stream N generated tokens' text (one message per delta); result the text
forge                 free a page id it does not own (the host traps it)
log                   write "from inferlet.log" with inferlet.log and "from print" with print;
                      result "logged"
spawn P ARGS...       a child of program P ("self": this one) with ARGS; result "child: <its
                      result>" or "refused: <why>"
"""
import inferlet
from inferlet import _wit
from inferlet import Context, InferletError, receive, send, store_get, store_set


@inferlet.main
def main(args: list[str]) -> str:
    command = args[0] if args else "echo"
    if command == "log":
        inferlet.log("from inferlet.log")
        print("from print")
        return "logged"
    if command == "forge":
        _wit.kv.free_pages([987654])
        return "unreachable"
    if command == "echo":
        while True:
            message = receive()
            if message == "quit":
                return "bye"
            send(message)
    if command == "store-set":
        store_set(args[1], args[2])
        return "ok"
    if command == "store-get":
        value = store_get(args[1])
        return "<none>" if value is None else value
    if command == "export":
        ctx = Context()
        ctx.fill("a shared prefix of some length to fill a few pages")
        ctx.export(args[1])
        send("exported")
        receive()
        return "ok"
    if command == "import":
        try:
            ctx = Context.from_import(args[1])
        except InferletError as exc:
            return f"import failed: {exc}"
        return f"imported {len(ctx.token_ids)} tokens"
    if command == "generate":
        ctx = Context()
        ctx.fill("Once upon a time")
        text = ""
        for delta in ctx.stream(max_tokens=int(args[1])):
            send(delta)
            text += delta
        return text
    if command == "spawn":
        program = "" if args[1] == "self" else args[1]
        try:
            return "child: " + inferlet.spawn(program, args[2:]).result()
        except inferlet.ChildError as exc:
            return f"refused: {exc}"
    raise InferletError(f"unknown command {command!r}")
