"""Multi-turn chat: each message from the client is a user turn; each reply is one message back.

    pie run inferlets/examples/chat.py -- --system "You are terse."

The conversation ends when the client sends "/quit" (or an empty message). The result is the
transcript as JSON: [[role, content], ...]. The KV of earlier turns is kept: a turn only
computes its own tokens.
"""
import inferlet


@inferlet.main
def main(args: list[str]) -> list:
    parser = inferlet.ArgumentParser(prog="chat", description="Chat with the model.")
    parser.add_argument("--system", default="You are a helpful assistant. Answer briefly.")
    parser.add_argument("--max-tokens", type=int, default=48, help="per reply")
    opts = parser.parse_args(args)

    ctx = inferlet.Context()
    ctx.fill_system(opts.system)
    transcript = []
    while True:
        message = inferlet.receive()
        if message.strip() in ("", "/quit", "/exit"):
            break
        ctx.fill_user(message)
        reply = ctx.generate(opts.max_tokens).strip()
        inferlet.send(reply)
        transcript += [["user", message], ["assistant", reply]]
    return transcript
