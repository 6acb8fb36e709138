"""The calculator tool, loaded by verl's agent loop from its file path
(``actor_rollout_ref.rollout.multi_turn.function_tool_path=${verl_traj_pkg:}/recipes/calc_agent/tool.py``)."""

from verl.tools.function_tool import function_tool

from verl_traj.recipes.calc_agent.task import CalculatorError, evaluate


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
