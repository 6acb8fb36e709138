"""The package stays readable: no function over 60 lines, and every change to a verl module goes through
``verl_traj.integration.patches`` (no module outside it assigns to a verl module's attribute)."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "verl_traj"
MAX_LINES = 60


def _functions():
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield path.relative_to(PACKAGE.parent), node


def test_no_function_over_sixty_lines():
    long = [f"{path}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for path, node in _functions() if node.end_lineno - node.lineno + 1 > MAX_LINES]
    assert not long, long


def _verl_module_names(tree: ast.AST) -> set[str]:
    """Names a file binds to verl modules (``import verl.x as n``, ``from verl.x import module``)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.asname or a.name.split(".")[0] for a in node.names if a.name.split(".")[0] == "verl"}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "verl":
            names |= {a.asname or a.name for a in node.names if a.name.islower()}
    return names


def test_only_the_patch_module_and_the_cpu_plugin_set_verl_module_attributes():
    """``setattr(module, ...)`` / ``module.x = ...`` on a verl module lives in patches.py (scoped, restored)
    or the CPU plugin (process-lifetime platform registration); anywhere else it is an unlisted patch."""
    allowed = {"verl_traj/integration/patches.py", "verl_traj/cpu/plugin.py"}
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = str(path.relative_to(PACKAGE.parent))
        tree = ast.parse(path.read_text())
        verl_names = _verl_module_names(tree)
        if rel in allowed or not verl_names:
            continue
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr" and node.args:
                targets = [node.args[0]]
            elif isinstance(node, (ast.Assign, ast.AugAssign)):
                targets = [t.value for t in getattr(node, "targets", [getattr(node, "target", None)])
                           if isinstance(t, ast.Attribute)]
            offenders += [f"{rel}:{node.lineno}" for t in targets if isinstance(t, ast.Name) and t.id in verl_names]
    assert not offenders, offenders
