"""A guest that runs one greedy generation of N tokens (stop tokens ignored) on host decode
loops, reading the tokens in bulk (Generation.run), and returns how many it got."""
import inferlet


@inferlet.main
def main(args: list[str]) -> str:
    ctx = inferlet.Context()
    ctx.fill([97])
    generation = ctx.generation(int(args[0]), inferlet.sampling.greedy(), stop_token_ids=())
    generation.run()
    return str(len(generation.token_ids))
