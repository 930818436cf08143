"""CodeAct: the agent's action is code, run inside the inferlet (no round trip to a client).

    pie run inferlets/examples/codeact.py -- --task "What is (17 + 25) * 3?" --num-calls 2

Each turn the model writes an assistant turn; its first --calls-per-turn arithmetic expressions
(digits, + - * / // % ** and parentheses; 1 by default, a missing one is an error output) are the
turn's actions. Each is evaluated by a small evaluator over Python's `ast` that accepts nothing
else (no names, calls or attributes; exponents up to 64; at most 200 characters), and their
outputs ("Output: 42" or "Output: error: ..."), one line each, are appended as the next user
turn. --delay-ms simulates each action's run time (0 by default); the actions of one turn run
concurrently, so the turn waits --delay-ms once. --num-calls actions in all (the last turn
takes the remainder). With --system-export NAME the system prompt's KV is imported/exported as
in react.py.
Returns JSON: {turns, actions, observations, answer, num_generated, imported}; with --run CODE
only {action, observation} of running CODE.
"""
import ast
import re
import time

import inferlet

SYSTEM = ("You solve math problems by writing one Python arithmetic expression per turn, "
          "like (3 + 4) * 2. You then get its Output.")
_EXPRESSION = re.compile(r"[\d(][\d\s+\-*/%().]*[\d)]")
_OPERATORS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b,
              ast.Mult: lambda a, b: a * b, ast.Div: lambda a, b: a / b,
              ast.FloorDiv: lambda a, b: a // b, ast.Mod: lambda a, b: a % b}
MAX_EXPRESSION_CHARS, MAX_EXPONENT, MAX_CALLS = 200, 64, 4096
NO_EXPRESSION = "Output: error: no arithmetic expression"


def evaluate(node: ast.AST):
    """The value of an arithmetic `ast` node; ValueError for anything else."""
    if isinstance(node, ast.Expression):
        return evaluate(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = evaluate(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
        base, exponent = evaluate(node.left), evaluate(node.right)
        if abs(exponent) > MAX_EXPONENT:
            raise ValueError(f"exponent {exponent} over {MAX_EXPONENT}")
        return base ** exponent
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](evaluate(node.left), evaluate(node.right))
    raise ValueError(f"{type(node).__name__} is not arithmetic")


def turn_sizes(num_calls: int, calls_per_turn: int) -> list[int]:
    """The number of actions of each turn: `calls_per_turn`, the remainder in the last."""
    return [min(calls_per_turn, num_calls - first) for first in range(0, num_calls, calls_per_turn)]


def run_actions(text: str, num_actions: int) -> list[tuple[str, str]]:
    """(expression, observation) of the first `num_actions` expressions found in `text`; a
    missing one is ("", NO_EXPRESSION)."""
    candidates = [m.group().strip() for m in _EXPRESSION.finditer(text)]
    candidates = [c for c in candidates if any(op in c for op in "+-*/%")][:num_actions]
    return [run_expression(c) for c in candidates] + [("", NO_EXPRESSION)] * (
        num_actions - len(candidates))


def run_action(text: str) -> tuple[str, str]:
    """(the first expression found in `text`, the observation of running it)."""
    return run_actions(text, 1)[0]


def run_expression(candidate: str) -> tuple[str, str]:
    """(the expression, its output) of one candidate expression."""
    expression = candidate[:MAX_EXPRESSION_CHARS]
    try:
        value = evaluate(ast.parse(expression, mode="eval"))
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError) as err:
        return expression, f"Output: error: {type(err).__name__}"
    return expression, f"Output: {value:g}" if isinstance(value, float) else f"Output: {value}"


@inferlet.main
def main(args: list[str]) -> dict:
    parser = inferlet.ArgumentParser(prog="codeact", description="An agent whose actions are code.")
    parser.add_argument("--task", default="What is (17 + 25) * 3?")
    parser.add_argument("--system", default=SYSTEM)
    parser.add_argument("--num-calls", type=int, default=2)
    parser.add_argument("--calls-per-turn", type=int, default=1, help="concurrent actions a turn")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="simulated run time of the code")
    parser.add_argument("--turn-tokens", type=int, default=16)
    parser.add_argument("--system-export", default="")
    parser.add_argument("--run", default=None, help="only run this code as an action; no model")
    opts = parser.parse_args(args)
    if opts.run is not None:
        return dict(zip(("action", "observation"), run_action(opts.run)))
    if not 0 <= opts.num_calls <= MAX_CALLS or opts.delay_ms < 0 or opts.calls_per_turn < 1:
        raise inferlet.InferletError(f"--num-calls must be in [0, {MAX_CALLS}], --delay-ms >= 0 "
                                     f"and --calls-per-turn >= 1")

    ctx, imported = inferlet.shared_system_context(opts.system, opts.system_export)
    ctx.fill_user(opts.task)
    turns, actions, observations, num_generated = [], [], [], 0
    for num_turn_calls in turn_sizes(opts.num_calls, opts.calls_per_turn):
        generation = ctx.generation(opts.turn_tokens).run()
        turns.append(generation.text)
        num_generated += len(generation.token_ids)
        results = run_actions(generation.text, num_turn_calls)
        time.sleep(opts.delay_ms / 1000)   # the turn's actions run together: one delay
        actions += [action for action, _ in results]
        observations += [observation for _, observation in results]
        ctx.fill_user("\n".join(observation for _, observation in results))
    final = ctx.generation(opts.turn_tokens).run()
    ctx.close()
    return {"turns": turns, "actions": actions, "observations": observations,
            "answer": final.text, "num_generated": num_generated + len(final.token_ids),
            "imported": imported}
