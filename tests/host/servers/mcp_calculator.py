"""A tiny MCP calculator over stdio (the tests' and the example's MCP server).

`python mcp_calculator.py` serves `add`, `multiply` and `evaluate` on stdin/stdout;
`python mcp_calculator.py --hang` starts and then never answers anything (the hostile case).
"""
from __future__ import annotations

import ast
import operator
import sys
import time

_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
              ast.Div: operator.truediv, ast.Pow: operator.pow, ast.USub: operator.neg}


def _evaluate(node: ast.AST) -> float:
    """Arithmetic only: numbers and + - * / ** (no names, no calls)."""
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        if isinstance(node.op, ast.Pow) and abs(_evaluate(node.right)) > 64:
            raise ValueError("exponent too large")
        return _OPERATORS[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_evaluate(node.operand))
    raise ValueError(f"not arithmetic: {ast.dump(node)[:80]}")


def main() -> None:
    if "--hang" in sys.argv:
        sys.stdin.read()            # reads the handshake, answers nothing, until closed
        time.sleep(3600)
        return
    from mcp.server.mcpserver import MCPServer

    server = MCPServer("calculator")

    @server.tool()
    def add(a: float, b: float) -> float:
        """Add two numbers."""
        return a + b

    @server.tool()
    def multiply(a: float, b: float) -> float:
        """Multiply two numbers."""
        return a * b

    @server.tool()
    def evaluate(expression: str) -> float:
        """Evaluate an arithmetic expression of numbers and + - * / ** ( )."""
        return _evaluate(ast.parse(expression, mode="eval"))

    server.run("stdio")


if __name__ == "__main__":
    main()
