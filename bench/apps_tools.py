"""The tools of the agent examples, for the API path of bench/apps.py: the very functions the
inferlets run, taken from their source (the examples import `inferlet`, which exists only inside
a component, so they cannot be imported here; their tool functions use only the stdlib)."""
from __future__ import annotations

import ast
import re
from pathlib import Path

__all__ = ["react_observation", "codeact_tool"]

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


_REACT = load_definitions("react", {"observe"})
_CODEACT = load_definitions("codeact", {"evaluate", "run_action", "_EXPRESSION", "_OPERATORS",
                                        "MAX_EXPRESSION_CHARS", "MAX_EXPONENT"})


def react_observation(call_index: int) -> str:
    """react.py's simulated tool answer to the `call_index`-th action."""
    return _REACT["observe"](call_index)


def codeact_tool(text: str) -> tuple[str, str]:
    """codeact.py's action: (the expression found in `text`, its output)."""
    return _CODEACT["run_action"](text)
