"""Prefix tree: prompts that share prefixes, each shared part computed once.

    pie run inferlets/examples/prefix_tree.py -- --root "Write a note." \
        --level " About cats.|About dogs." --level " Short.| Long."

The tree has a root and one level per --level ("|" separates a node's children texts, the same
for every node of the level): the default is 1x2x2x2, 8 leaves. Each node is a fork of its
parent (its KV pages shared, not copied) with its own text filled; a node's text is computed
once whatever the number of its descendants. All leaves then generate together, in the same
batches. Returns JSON: {leaves: [{path, text, token_ids}], num_node_tokens} where
num_node_tokens counts the prompt tokens of every node (what the tree computes).
"""
import inferlet

DEFAULT_LEVELS = ("Topic: the ocean.|Topic: the desert.", " Tone: happy.| Tone: sad.",
                  " Form: one line.\n| Form: a title.\n")


def expand(parents: list, texts: list[str]) -> list:
    """Every (path, context) of `parents` forked once per text, the text filled."""
    children = []
    for path, ctx in parents:
        for text in texts:
            child = ctx.fork()
            child.fill(text)
            children.append((path + [text], child))
        ctx.close()   # its pages live on in its children
    return children


@inferlet.main
def main(args: list[str]) -> dict:
    parser = inferlet.ArgumentParser(prog="prefix_tree", description="Generate from a tree of prompts.")
    parser.add_argument("--root", default="Write about nature.\n")
    parser.add_argument("--level", action="append", help='children texts of one level, "|"-separated')
    parser.add_argument("--max-tokens", type=int, default=16)
    opts = parser.parse_args(args)
    levels = [level.split("|") for level in (opts.level or DEFAULT_LEVELS)]

    root = inferlet.Context()
    root.fill(opts.root)
    num_node_tokens = len(root.token_ids)
    nodes = [([], root)]
    for texts in levels:
        nodes = expand(nodes, texts)
        num_node_tokens += len(nodes) // len(texts) * sum(len(inferlet.encode(t)) for t in texts)
    generations = inferlet.generate_parallel([ctx for _, ctx in nodes], opts.max_tokens)
    leaves = [{"path": path, "text": gen.text, "token_ids": gen.token_ids}
              for (path, _), gen in zip(nodes, generations)]
    for _, ctx in nodes:
        ctx.close()
    return {"leaves": leaves, "num_node_tokens": num_node_tokens}
