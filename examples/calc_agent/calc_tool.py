"""The calculator tool, loaded by verl's agent loop via
``actor_rollout_ref.rollout.multi_turn.function_tool_path=examples/calc_agent/calc_tool.py``."""

import os
import sys

from verl.tools.function_tool import function_tool

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from task import CalculatorError, evaluate  # noqa: E402


@function_tool
def calculator(expression: str) -> str:
    """Evaluate one integer arithmetic expression.

    Args:
        expression: integers with + - * and parentheses, e.g. "12 + 7".
    """
    try:
        return str(evaluate(expression))
    except CalculatorError as exc:
        return f"error: {exc}"
