"""Tool calls that no tool can run: answered with what is wrong, counted as malformed, never executed.

verl's ``ToolAgentLoop._call_tool`` runs a parsed call with whatever arguments the model wrote. A function tool is
called as ``fn(**arguments)``, so an argument its signature does not take, or lacks, raises inside the call
(``calculator() got an unexpected keyword argument 'arguments'``); an unknown tool name, arguments that are not JSON
and a raising tool are answered too, and each is logged at WARNING, once per call, for what is the policy still
learning the call format. :func:`check_tool_call` answers such a call before it runs, the way a tool server that
checks a call's argument names would: the text names what was wrong and what the tool takes (the model
sees it as the tool's answer), the call moves from the session's parsed to its malformed tool calls
(``traj_agent/malformed_tool_call_share``, :mod:`verl_traj.core.rollout.session_ledger`), and nothing is logged.

Only what would fail anyway is answered here: for a function tool (``FunctionTool``), an argument its signature does
not take or a required one missing (``fn(**arguments)`` would raise before the function runs; argument types are left
to the function, as Python leaves them); for a ``BaseTool``, which receives the
argument dict and decides itself, only an unknown name and arguments that are not a JSON object. Every call that
passes runs through verl's own ``_call_tool``.
"""

from __future__ import annotations

import json
from typing import Any, Mapping, Optional

from verl.tools.function_tool import FunctionTool

from verl_traj.core.rollout.session_ledger import current_ledger

__all__ = ["check_tool_call", "count_rejected_tool_call", "strict_parameters", "tool_call_problem"]

def _type_name(types: Any) -> str:
    """``string``, or ``integer/number`` for a list of JSON-schema types."""
    return types if isinstance(types, str) else "/".join(types or ["any"])


def _usage(name: str, parameters: Mapping[str, Any]) -> str:
    """``calculator takes: expression (string, required)``."""
    required = set(parameters.get("required") or ())
    listed = [f"{key} ({_type_name(spec.get('type'))}{', required' if key in required else ''})"
              for key, spec in (parameters.get("properties") or {}).items()]
    return f"{name} takes: {', '.join(listed) if listed else 'no arguments'}"


def tool_call_problem(name: str, arguments: Any, tools: Mapping[str, Optional[Mapping[str, Any]]]) -> Optional[str]:
    """What is wrong with the call ``name(arguments)``, as the tool's answer to the model, or ``None`` if it may run.

    ``arguments``: the call's JSON text (verl's ``FunctionCall.arguments``). ``tools``: each available tool's name ->
    the JSON-schema ``parameters`` object naming its arguments (``properties``: name -> ``{"type": ...}``, the types
    only shown in the answer; ``required``: names), or ``None`` for a tool that takes any JSON object. An unknown name
    and arguments that are not JSON get verl's own texts; the others name each wrong argument and what the tool takes.
    """
    if name not in tools:
        return f"Unknown function '{name}'. Available tools: {list(tools)}"
    try:
        args = json.loads(arguments)
    except (json.JSONDecodeError, TypeError) as exc:
        return f"Invalid JSON in arguments for '{name}': {exc}"
    parameters = tools[name]
    usage = "" if parameters is None else f" {_usage(name, parameters)}."
    if not isinstance(args, dict):
        return (f"Invalid arguments for '{name}': expected a JSON object of named arguments, got "
                f"{type(args).__name__} {json.dumps(args)[:80]}.{usage}")
    if parameters is None:
        return None
    properties = parameters.get("properties") or {}
    wrong = [f"unexpected argument '{str(key)[:40]}'" for key in args if key not in properties]
    wrong += [f"missing required argument '{key}'" for key in parameters.get("required") or () if key not in args]
    if len(wrong) > _MAX_NAMED:  # the answer enters the model's context: bounded whatever the model wrote
        wrong = wrong[:_MAX_NAMED] + [f"and {len(wrong) - _MAX_NAMED} more"]
    return f"Invalid arguments for '{name}': {'; '.join(wrong)}.{usage}" if wrong else None


_MAX_NAMED = 5  # wrong arguments named in one answer


def strict_parameters(tool: Any) -> Optional[Mapping[str, Any]]:
    """The ``parameters`` schema a call to ``tool`` must match: a function tool's own (verl calls it as
    ``fn(**arguments)``), ``None`` (any JSON object) for a ``BaseTool`` (it receives the dict and decides)."""
    if not isinstance(tool, FunctionTool):
        return None
    return tool.tool_schema.function.parameters.model_dump(exclude_none=True)


def count_rejected_tool_call() -> None:
    """In a session, one call the parser counted as parsed (``CountingToolParser``) becomes a malformed one."""
    ledger = current_ledger()
    if ledger is not None:
        ledger.tool_calls = max(ledger.tool_calls - 1, 0)
        ledger.malformed_tool_calls += 1


def check_tool_call(call: Any, tools: Mapping[str, Any]) -> Optional[str]:
    """The answer to a parsed ``call`` (verl's ``FunctionCall``) that no tool of ``tools`` (name -> verl tool) can run,
    counted as malformed in the session (:func:`count_rejected_tool_call`); ``None`` for a call that may run."""
    problem = tool_call_problem(call.name, call.arguments, {name: strict_parameters(t) for name, t in tools.items()})
    if problem is not None:
        count_rejected_tool_call()
    return problem
