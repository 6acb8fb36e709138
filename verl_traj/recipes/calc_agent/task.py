"""Calculator-agent task: multi-step integer arithmetic solved with a calculator tool.

One episode: the user asks for the value of an expression such as ``(12 + 7) * 3 - 5``. The agent
calls ``calculator`` once per operation (two or three tool calls an episode), reading each result
from the tool response, then answers ``<answer>N</answer>``.

Reward (``compute_score``, verl's custom reward function signature), verifiable:
    1.0  if the last ``<answer>..</answer>`` equals the ground truth, else
    0.1 * (an answer tag is present) + 0.5 * progress,
where progress = the fraction of the problem's intermediate values (``extra_info["intermediates"]``)
that the agent's own calculator calls reach, in order (the calls' expressions are re-evaluated
here, so nothing the tool printed is trusted). Partial credit gives a small model a dense signal
before it solves whole problems.
Everything here is pure Python: no verl import, so data preparation and tests are fast.
"""

from __future__ import annotations

import ast
import operator
import random
import re
import threading
from pathlib import Path
from typing import NamedTuple

SYSTEM_PROMPT = (
    "You solve arithmetic with the calculator tool: one operation per call. "
    "When done, reply <answer>N</answer>."
)
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}
_SYMBOL = {"+": operator.add, "-": operator.sub, "*": operator.mul}
ANSWER_RE = re.compile(r"<answer>\s*(-?\d+)\s*</answer>")
CALL_RE = re.compile(r'"expression"\s*:\s*"([^"]*)"')
# CPython 3.11 keeps ast.parse's recursion depth per interpreter, not per thread: parses running concurrently in
# threads (verl runs a sync function tool with asyncio.to_thread, and reward functions in an executor) corrupt it
# and fail with "SystemError: AST constructor recursion depth mismatch". Parses here take turns.
_PARSE_LOCK = threading.RLock()


class CalculatorError(ValueError):
    """The expression is not integer arithmetic with + - * and parentheses."""


def evaluate(expression: str) -> int:
    """Evaluate integer arithmetic (+, -, *, parentheses) safely; raise CalculatorError otherwise."""
    try:
        with _PARSE_LOCK:
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


def make_problem(rng: random.Random, num_ops: int, max_operand: int = 9) -> Problem:
    """A left-nested expression ``((a op b) op c) ...`` with ``num_ops`` operations and operands in
    ``[2, max_operand]`` (intermediate values grow beyond it: the agent must carry tool results)."""
    value = rng.randint(2, max_operand)
    expression = str(value)
    steps = []
    for k in range(num_ops):
        symbol = rng.choice("+-*") if k else rng.choice("+-")
        operand = rng.randint(2, min(9, max_operand)) if symbol == "*" else rng.randint(2, max_operand)
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


def call_progress(solution_str: str, intermediates) -> float:
    """Fraction of ``intermediates`` reached, in order, by the calculator calls in ``solution_str``."""
    expected = [int(v) for v in (intermediates or [])]
    if not expected:
        return 0.0
    reached = 0
    for expression in CALL_RE.findall(solution_str or ""):
        try:
            value = evaluate(expression)
        except CalculatorError:
            continue
        if reached < len(expected) and value == expected[reached]:
            reached += 1
    return reached / len(expected)


def compute_score(data_source: str, solution_str: str, ground_truth=None, extra_info=None, **kwargs) -> float:
    """verl custom reward: 1.0 for a correct final answer, else format + progress partial credit."""
    found = ANSWER_RE.findall(solution_str or "")
    if found and ground_truth is not None and int(found[-1]) == int(ground_truth):
        return 1.0
    intermediates = (extra_info or {}).get("intermediates") if isinstance(extra_info, dict) else None
    return 0.1 * bool(found) + 0.5 * call_progress(solution_str, intermediates)


def calc_tools() -> list:
    """The recipe's function tools (``calculator``), loaded by verl's own ``load_function_tools_from_path``,
    as its agent loop loads ``multi_turn.function_tool_path``; verl caches by path, so every caller in a
    process shares one registration."""
    # local: task.py imports no verl (module doc: the reward function and data preparation stay pure Python)
    from verl.tools.function_tool import load_function_tools_from_path

    return load_function_tools_from_path(str(Path(__file__).resolve().parent / "tool.py"))
