"""The tools of the agent examples, for the API path of bench/apps.py: the very functions the
inferlets run, taken from their source (the examples import `inferlet`, which exists only inside
a component, so they cannot be imported here; their tool functions use only the stdlib)."""
from __future__ import annotations

import ast
import re
from pathlib import Path

__all__ = ["react_observation", "codeact_tools", "turn_sizes"]

EXAMPLES = Path(__file__).resolve().parents[1] / "inferlets" / "examples"


def load_definitions(example: str, names: set[str]) -> dict:
    """Execute the top-level functions and constants called `names` of an example's source."""
    tree = ast.parse((EXAMPLES / f"{example}.py").read_text())
    kept = [node for node in tree.body
            if isinstance(node, ast.FunctionDef) and node.name in names
            or isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id in names
                                                    for t in node.targets)
            or isinstance(node, ast.Assign) and any(isinstance(t, ast.Tuple) and
                                                    {e.id for e in t.elts} & names
                                                    for t in node.targets)]
    namespace: dict = {"ast": ast, "re": re}
    exec(compile(ast.Module(body=kept, type_ignores=[]), f"{example}.py", "exec"), namespace)
    return namespace


_REACT = load_definitions("react", {"observe", "turn_sizes"})
_CODEACT = load_definitions("codeact", {"evaluate", "run_actions", "run_expression", "_EXPRESSION",
                                        "_OPERATORS", "NO_EXPRESSION", "MAX_EXPRESSION_CHARS",
                                        "MAX_EXPONENT", "MAX_CALLS"})


def react_observation(call_index: int) -> str:
    """react.py's simulated tool answer to the `call_index`-th action."""
    return _REACT["observe"](call_index)


def codeact_tools(text: str, num_actions: int) -> list[tuple[str, str]]:
    """codeact.py's actions of one turn: (expression, output) of the first `num_actions`
    expressions found in `text`."""
    return _CODEACT["run_actions"](text, num_actions)


def turn_sizes(num_calls: int, calls_per_turn: int) -> list[int]:
    """react.py's split of `num_calls` tool calls into turns (codeact.py's is the same)."""
    return _REACT["turn_sizes"](num_calls, calls_per_turn)
