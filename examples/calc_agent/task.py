"""Calculator-agent task: multi-step integer arithmetic solved with a calculator tool.

One episode: the user asks for the value of an expression such as ``(12 + 7) * 3 - 5``. The agent
calls ``calculator`` once per operation (two or three tool calls an episode), reading each result
from the tool response, then answers ``<answer>N</answer>``.

Reward (``compute_score``, verl's custom reward function signature), verifiable:
    1.0  if the last ``<answer>..</answer>`` equals the ground truth
    0.1  if an answer tag is present but wrong (format credit)
    0.0  otherwise
Everything here is pure Python: no verl import, so data preparation and tests are fast.
"""

from __future__ import annotations

import ast
import operator
import random
import re
from typing import NamedTuple

SYSTEM_PROMPT = (
    "You solve arithmetic with the calculator tool: one operation per call. "
    "When done, reply <answer>N</answer>."
)
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}
_SYMBOL = {"+": operator.add, "-": operator.sub, "*": operator.mul}
ANSWER_RE = re.compile(r"<answer>\s*(-?\d+)\s*</answer>")


class CalculatorError(ValueError):
    """The expression is not integer arithmetic with + - * and parentheses."""


def evaluate(expression: str) -> int:
    """Evaluate integer arithmetic (+, -, *, parentheses) safely; raise CalculatorError otherwise."""
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise CalculatorError(f"cannot parse {expression!r}") from exc

    def walk(node: ast.AST) -> int:
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -walk(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = walk(node.left), walk(node.right)
            if abs(left) > 10**12 or abs(right) > 10**12:
                raise CalculatorError("numbers too large")
            return _OPS[type(node.op)](left, right)
        raise CalculatorError(f"unsupported element {type(node).__name__} in {expression!r}")

    return walk(tree)


class Problem(NamedTuple):
    """A NamedTuple, not a dataclass: verl loads reward files without registering them in
    ``sys.modules``, where ``@dataclass`` fails. ``steps``: the calls a correct agent makes, e.g. [("12 + 7", 19), ("19 * 3", 57)]."""

    question: str
    expression: str
    steps: tuple[tuple[str, int], ...]
    answer: int


def make_problem(rng: random.Random, num_ops: int) -> Problem:
    """A left-nested expression ``((a op b) op c) ...`` with ``num_ops`` operations."""
    value = rng.randint(2, 30)
    expression = str(value)
    steps = []
    for k in range(num_ops):
        symbol = rng.choice("+-*") if k else rng.choice("+-")
        operand = rng.randint(2, 9) if symbol == "*" else rng.randint(2, 30)
        call = f"{value} {symbol} {operand}"
        result = _SYMBOL[symbol](value, operand)
        steps.append((call, result))
        expression = f"({expression} {symbol} {operand})" if k < num_ops - 1 else f"{expression} {symbol} {operand}"
        value = result
    return Problem(f"What is {expression}?", expression, tuple(steps), value)


def transcript(problem: Problem) -> list[dict]:
    """The chat messages of a correct episode (for the supervised warm start)."""
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": problem.question}]
    for call, result in problem.steps:
        messages.append(
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"type": "function", "function": {"name": "calculator", "arguments": {"expression": call}}}],
            }
        )
        messages.append({"role": "tool", "content": str(result)})
    messages.append({"role": "assistant", "content": f"<answer>{problem.answer}</answer>"})
    return messages


def compute_score(data_source: str, solution_str: str, ground_truth=None, extra_info=None, **kwargs) -> float:
    """verl custom reward: 1.0 correct final answer, 0.1 wrong but well-formed answer, else 0."""
    found = ANSWER_RE.findall(solution_str or "")
    if not found:
        return 0.0
    return 1.0 if ground_truth is not None and int(found[-1]) == int(ground_truth) else 0.1
