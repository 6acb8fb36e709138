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


def _root_name(expr: ast.AST) -> str | None:
    """``a`` for ``a``, ``a.b``, ``a.b.c`` (the name an attribute chain starts from)."""
    while isinstance(expr, ast.Attribute):
        expr = expr.value
    return expr.id if isinstance(expr, ast.Name) else None


def _verl_attribute_writes(source: str) -> list[int]:
    """Lines that set an attribute on a verl module: ``setattr(m, ...)``, ``m.x = ...``, ``verl.a.b.x = ...``
    (``import verl.a.b`` binds ``verl``), ``m.x += ...``, where ``m`` is a name bound to a verl module."""
    tree = ast.parse(source)
    verl_names = _verl_module_names(tree)
    lines = []
    for node in ast.walk(tree):
        modules = []
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr" and node.args:
            modules = [node.args[0]]
        elif isinstance(node, (ast.Assign, ast.AugAssign)):
            modules = [t.value for t in getattr(node, "targets", [getattr(node, "target", None)])
                       if isinstance(t, ast.Attribute)]
        lines += [node.lineno for m in modules if _root_name(m) in verl_names]
    return sorted(lines)


def test_the_patch_detector_sees_every_spelling():
    source = ("import verl.utils.seqlen_balancing\nimport verl.workers as w\nfrom verl.trainer import ppo\n"
              "verl.utils.seqlen_balancing.f = None\nw.x = 1\nsetattr(ppo, 'y', 2)\nppo.core.z += 1\n"
              "setattr(verl.utils, 'q', 3)\nother = object()\nother.a = 1\n")
    assert _verl_attribute_writes(source) == [4, 5, 6, 7, 8]


def test_only_the_patch_module_and_the_cpu_plugin_set_verl_module_attributes():
    """``setattr(module, ...)`` / ``module.x = ...`` on a verl module lives in patches.py (scoped, restored)
    or the CPU plugin (process-lifetime platform registration); anywhere else it is an unlisted patch."""
    allowed = {"verl_traj/integration/patches.py", "verl_traj/cpu/plugin.py"}
    offenders = [f"{path.relative_to(PACKAGE.parent)}:{line}" for path in sorted(PACKAGE.rglob("*.py"))
                 if str(path.relative_to(PACKAGE.parent)) not in allowed
                 for line in _verl_attribute_writes(path.read_text())]
    assert not offenders, offenders
