"""The package stays readable and its changes to verl stay listed:

* no function over 60 lines; no module of ``verl_traj/integration`` over 300 lines;
* the v1 adapter's modules (``integration/trainers/v1*.py``) import at the top (a reader sees every dependency there);
  in the whole package at most 20 imports sit inside functions, each saying why on a ``# local:`` comment;
* ``verl_traj/integration`` is folders only, at most 12 modules each, each opening with what runs there and the
  folders it may import (its ``May import:`` line); every import follows those lines, and they form an order;
* driver code (config, rows, start-up, trainers) imports no module that runs only in worker or agent-loop processes;
  no module imports another's private names; no live object is retyped with ``obj.__class__ = ...``;
* every write to a verl module's attribute is declared in a patch catalogue: ``integration/patches/scoped.py``
  (scoped, restored) or ``integration/patches/process.py`` (process lifetime); the installers of those two
  modules are the only code that writes a name it does not spell out;
* ``verl_traj``'s imports (module level and inside functions) form no cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import NamedTuple, Optional

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "verl_traj"
MAX_LINES = 60
UNKNOWN = "?"  # a module or attribute name the source does not spell out
# The installers: they write whatever patch they are given (module and name are data there).
INSTALLERS = {("verl_traj/integration/patches/scoped.py", "patched"), ("verl_traj/integration/patches/process.py", "apply")}
# Import cycles being fixed elsewhere; a cycle not listed here fails the test.
KNOWN_IMPORT_CYCLES: set = set()


def _functions():
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield path.relative_to(PACKAGE.parent), node


def test_no_function_over_sixty_lines():
    long = [f"{path}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for path, node in _functions() if node.end_lineno - node.lineno + 1 > MAX_LINES]
    assert not long, long


MAX_INTEGRATION_MODULE_LINES = 300


def test_no_integration_module_over_three_hundred_lines():
    long = {str(path.relative_to(PACKAGE)): len(path.read_text().splitlines())
            for path in sorted((PACKAGE / "integration").rglob("*.py"))}
    over = {name: n for name, n in long.items() if n > MAX_INTEGRATION_MODULE_LINES}
    assert not over, over


MAX_MODULE_LINES = 400


def test_no_module_over_four_hundred_lines():
    """Issue 54, item 6: a module a reader takes in at once."""
    long = {str(path.relative_to(PACKAGE)): n for path in sorted(PACKAGE.rglob("*.py"))
            if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, long


def test_the_v1_adapter_imports_at_the_top():
    local = [f"{path.name}:{node.lineno}" for path in sorted((PACKAGE / "integration" / "trainers").glob("v1*.py"))
             for fn in ast.walk(ast.parse(path.read_text())) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
             for node in ast.walk(fn) if isinstance(node, (ast.Import, ast.ImportFrom))]
    assert not local, local


MAX_LOCAL_IMPORTS = 20


def _says_why(lines: list[str], line: int) -> bool:
    """``# local: <why>`` at the end of the import's first line or on the line above it."""
    return lines[line - 1].partition("#")[2].strip().startswith("local:") or lines[line - 2].strip().startswith("# local:")


def test_function_local_imports_are_few_and_say_why():
    """Imports go at the top of the module; one inside a function stays only for a reason it states (``# local:``):
    an optional dependency, a lazy loader, a module every ``import verl`` loads kept light, a pure module kept pure."""
    local = {}  # "path:line" -> whether it says why (an import in a nested function counts once)
    for path in sorted(PACKAGE.rglob("*.py")):
        lines = path.read_text().splitlines()
        for fn in ast.walk(ast.parse(path.read_text())):
            for node in ast.walk(fn) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) else ():
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    local[f"{path.relative_to(PACKAGE.parent)}:{node.lineno}"] = _says_why(lines, node.lineno)
    assert len(local) <= MAX_LOCAL_IMPORTS, sorted(local)
    assert all(local.values()), [where for where, why in sorted(local.items()) if not why]


# ----------------------------------------------------------------------------------------------
# the detector of writes to verl modules
# ----------------------------------------------------------------------------------------------
class Write(NamedTuple):
    line: int
    module: str  # the verl module written to, or UNKNOWN
    name: str  # the attribute written, or UNKNOWN
    function: Optional[str]  # the enclosing function (None: module level)


SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)


def _is_verl(module: str) -> bool:
    return module == "verl" or module.startswith("verl.")


def _literal(node: Optional[ast.AST]) -> Optional[str]:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _dotted(node: ast.AST) -> str:
    """``a.b.c`` for an attribute chain of names, else ''."""
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else ""
    return node.id if isinstance(node, ast.Name) else ""


def _named_module(arg: Optional[ast.AST]) -> Optional[str]:
    """The module ``import_module(arg)`` / ``sys.modules[arg]`` yields: verl's by literal, UNKNOWN by variable."""
    text = _literal(arg)
    if text is None:
        return UNKNOWN if arg is not None else None
    return text if _is_verl(text) else None


def _resolve(expr: ast.AST, env: dict) -> Optional[str]:
    """The verl module ``expr`` evaluates to (UNKNOWN: some module, maybe verl's), or None."""
    if isinstance(expr, ast.Name):
        return env.get(expr.id)
    if isinstance(expr, ast.Attribute):
        base = _resolve(expr.value, env)
        return None if base is None else base if base == UNKNOWN else f"{base}.{expr.attr}"
    if isinstance(expr, ast.Call):
        if _dotted(expr.func).split(".")[-1] in ("import_module", "__import__"):
            return _named_module(expr.args[0] if expr.args else None)
        if _dotted(expr.func) in ("sys.modules.get", "modules.get"):
            return _named_module(expr.args[0] if expr.args else None)
    if isinstance(expr, ast.Subscript) and _dotted(expr.value) in ("sys.modules", "modules"):
        return _named_module(expr.slice)
    if isinstance(expr, ast.IfExp):
        return _resolve(expr.body, env) or _resolve(expr.orelse, env)
    if isinstance(expr, ast.NamedExpr):
        return _resolve(expr.value, env)
    return None


def _own_nodes(scope: ast.AST):
    """The nodes of ``scope`` outside the functions and lambdas nested in it (class bodies are walked)."""
    todo = list(ast.iter_child_nodes(scope))
    while todo:
        node = todo.pop()
        yield node
        if not isinstance(node, SCOPES):
            todo.extend(ast.iter_child_nodes(node))


def _import_bindings(node: ast.AST) -> list[tuple[str, str]]:
    if isinstance(node, ast.Import):
        return [(a.asname, a.name) if a.asname else (a.name.split(".")[0], a.name.split(".")[0])
                for a in node.names if _is_verl(a.name)]
    if isinstance(node, ast.ImportFrom) and not node.level and _is_verl(node.module or ""):
        return [(a.asname or a.name, f"{node.module}.{a.name}") for a in node.names if a.name.islower()]
    return []


def _local_bindings(scope: ast.AST, env: dict) -> dict[str, Optional[str]]:
    """Names ``scope`` binds itself -> the verl module of one of their bindings (None: no binding is one)."""
    out: dict[str, Optional[str]] = {}

    def bind(target: ast.AST, value: Optional[str]) -> None:
        if isinstance(target, ast.Name):
            out[target.id] = out.get(target.id) or value
        elif isinstance(target, (ast.Tuple, ast.List)):
            for element in target.elts:
                bind(element, None)

    for node in _own_nodes(scope):
        for name, module in _import_bindings(node):
            out[name] = module
        if isinstance(node, ast.Assign):
            for target in node.targets:
                bind(target, _resolve(node.value, env))
        elif isinstance(node, (ast.AnnAssign, ast.NamedExpr)) and node.value is not None:
            bind(node.target, _resolve(node.value, env))
        elif isinstance(node, (ast.For, ast.comprehension)):
            items = node.iter.elts if isinstance(node.iter, (ast.Tuple, ast.List)) else []
            bind(node.target, next((m for m in (_resolve(i, env) for i in items) if m), None))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.setdefault(node.name, None)
    return out


class _Detector:
    """Scope-aware: module imports, locals from ``import_module`` / ``sys.modules``, aliases, loop variables, and
    parameters of functions that are called with a verl module or registered next to a verl module's name."""

    def __init__(self, tree: ast.Module):
        self.tree = tree
        self.defs = {n.name: n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        self.params: dict[int, dict[str, str]] = {}  # id(function or lambda) -> parameter -> verl module
        self._callbacks()
        self._annotations()

    def _callbacks(self) -> None:
        """``hook("verl.x", callback)``: the callback's first parameter is the module ``verl.x``."""
        for call in (n for n in ast.walk(self.tree) if isinstance(n, ast.Call)):
            args = call.args + [k.value for k in call.keywords]
            names = [t for t in map(_literal, args) if t and _is_verl(t)]
            for arg in args if names else []:
                fn = self.defs.get(arg.id) if isinstance(arg, ast.Name) else arg if isinstance(arg, ast.Lambda) else None
                if fn is not None and fn.args.args:
                    self.params.setdefault(id(fn), {})[fn.args.args[0].arg] = names[0]

    def _annotations(self) -> None:
        for fn in self.defs.values():
            for a in fn.args.args + fn.args.kwonlyargs + fn.args.posonlyargs:
                if a.annotation is not None and _dotted(a.annotation).split(".")[-1] == "ModuleType":
                    self.params.setdefault(id(fn), {})[a.arg] = UNKNOWN

    def _calls(self, scope: ast.AST, env: dict) -> bool:
        """Parameters bound by calls in ``scope`` to the file's functions; True when one was new."""
        new = False
        for call in (n for n in _own_nodes(scope) if isinstance(n, ast.Call)):
            name = call.func.id if isinstance(call.func, ast.Name) else getattr(call.func, "attr", None)
            fn = self.defs.get(name)
            if fn is None:
                continue
            params = [a.arg for a in fn.args.posonlyargs + fn.args.args]
            if isinstance(call.func, ast.Attribute) and params[:1] in (["self"], ["cls"]):
                params = params[1:]
            pairs = list(zip(params, call.args)) + [(k.arg, k.value) for k in call.keywords if k.arg]
            for param, arg in pairs:
                module, bound = _resolve(arg, env), self.params.setdefault(id(fn), {})
                merged = module if bound.get(param) in (None, module) else UNKNOWN  # two modules: some module
                if module and bound.get(param) != merged:
                    bound[param], new = merged, True
        return new

    def _scope_env(self, scope: ast.AST, parent: dict) -> dict:
        env = dict(parent)
        if isinstance(scope, SCOPES):
            args = scope.args
            for a in args.posonlyargs + args.args + args.kwonlyargs + [args.vararg, args.kwarg]:
                if a is not None:
                    env.pop(a.arg, None)
            env.update(self.params.get(id(scope), {}))
        for _ in range(2):  # aliases of aliases
            for name, module in _local_bindings(scope, env).items():
                if module:
                    env[name] = module
                elif name not in self.params.get(id(scope), {}):
                    env.pop(name, None)
        return env

    def writes(self) -> list[Write]:
        for _ in range(5):  # parameters bound through calls, until nothing changes
            if not any([self._calls(scope, env) for scope, env, _ in self._scopes()]):
                break
        return sorted({w for scope, env, fn in self._scopes() for w in _writes_in(scope, env, fn)})

    def _scopes(self):
        todo = [(self.tree, {}, None)]
        while todo:
            scope, parent, fn = todo.pop()
            env = self._scope_env(scope, parent)
            yield scope, env, fn
            todo += [(n, env, getattr(n, "name", fn)) for n in _own_nodes(scope) if isinstance(n, SCOPES)]


def _targets(node: ast.AST):
    if isinstance(node, (ast.Tuple, ast.List)):
        for element in node.elts:
            yield from _targets(element)
    elif isinstance(node, ast.Starred):
        yield from _targets(node.value)
    else:
        yield node


def _namespace_owner(expr: ast.AST) -> Optional[ast.AST]:
    """``m`` for ``m.__dict__`` and ``vars(m)``."""
    if isinstance(expr, ast.Attribute) and expr.attr == "__dict__":
        return expr.value
    if isinstance(expr, ast.Call) and _dotted(expr.func) == "vars" and expr.args:
        return expr.args[0]
    return None


def _written(node: ast.AST) -> list[tuple[ast.AST, str]]:
    """(object, attribute name or UNKNOWN) pairs ``node`` writes, whatever the object is."""
    if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
        out = []
        for target in (t for ts in getattr(node, "targets", [getattr(node, "target", None)]) for t in _targets(ts)):
            if isinstance(target, ast.Attribute):
                out.append((target.value, target.attr))
            elif isinstance(target, ast.Subscript) and _namespace_owner(target.value) is not None:
                out.append((_namespace_owner(target.value), _literal(target.slice) or UNKNOWN))
        return out
    if isinstance(node, ast.Call) and node.args:
        func = _dotted(node.func).split(".")[-1]
        if func in ("setattr", "delattr") or (func in ("__setattr__", "__delattr__")
                                               and isinstance(node.func, ast.Attribute)):
            obj = node.args[0] if func in ("setattr", "delattr") else node.func.value
            name = node.args[1] if func in ("setattr", "delattr") and len(node.args) > 1 else node.args[0]
            return [(obj, _literal(name) or UNKNOWN)]
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in (
            "update", "setdefault", "pop", "__setitem__") and _namespace_owner(node.func.value) is not None:
        return [(_namespace_owner(node.func.value), _literal(node.args[0]) if node.args else UNKNOWN)]
    return []


def _writes_in(scope: ast.AST, env: dict, function: Optional[str]) -> list[Write]:
    out = []
    for node in _own_nodes(scope):
        for obj, name in _written(node):
            module = _resolve(obj, env)
            if module:
                out.append(Write(node.lineno, module, name or UNKNOWN, function))
    return out


def verl_attribute_writes(source: str) -> list[Write]:
    return _Detector(ast.parse(source)).writes()


# one spelling each: source, then the (line, module, name) it must report
SPELLINGS = {
    "import_chain": ("import verl.utils.seqlen_balancing\nverl.utils.seqlen_balancing.f = None\n",
                     [(2, "verl.utils.seqlen_balancing", "f")]),
    "import_as": ("import verl.workers as w\nw.x = 1\n", [(2, "verl.workers", "x")]),
    "from_import_setattr": ("from verl.trainer import ppo\nsetattr(ppo, 'y', 2)\n", [(2, "verl.trainer.ppo", "y")]),
    "augmented_submodule": ("from verl.trainer import ppo\nppo.core.z += 1\n", [(2, "verl.trainer.ppo.core", "z")]),
    "setattr_chain": ("import verl.utils\nsetattr(verl.utils, 'q', 3)\n", [(2, "verl.utils", "q")]),
    "setattr_dynamic_name": ("import verl.utils as u\ndef f(n):\n    setattr(u, n, 3)\n", [(3, "verl.utils", UNKNOWN)]),
    "delete": ("import verl.utils as u\ndel u.a\ndelattr(u, 'b')\n", [(2, "verl.utils", "a"), (3, "verl.utils", "b")]),
    "module_dict": ("import verl.utils as u\nu.__dict__['a'] = 1\nvars(u)['b'] = 2\nvars(u).update(c=3)\n",
                    [(2, "verl.utils", "a"), (3, "verl.utils", "b"), (4, "verl.utils", UNKNOWN)]),
    "dunder_setattr": ("import verl.utils as u\nu.__setattr__('a', 1)\n", [(2, "verl.utils", "a")]),
    "alias": ("import verl.utils.model as m\ndef f():\n    alias = m\n    alias.x = 1\n", [(4, "verl.utils.model", "x")]),
    "import_module_literal": ("import importlib\ndef f():\n    m = importlib.import_module('verl.a')\n    m.x = 1\n",
                              [(4, "verl.a", "x")]),
    "import_module_variable": ("from importlib import import_module\ndef f(n):\n    import_module(n).x = 1\n",
                               [(3, UNKNOWN, "x")]),
    "sys_modules_subscript": ("import sys\nm = sys.modules['verl.a']\nm.x = 1\n", [(3, "verl.a", "x")]),
    "sys_modules_get_loop": ("import sys\nfor n in ('verl.a', 'verl.b'):\n    m = sys.modules.get(n)\n    m.x = 1\n",
                             [(4, UNKNOWN, "x")]),
    "loop_over_modules": ("import verl.a as a\nfor m in (a,):\n    m.x = 1\n", [(3, "verl.a", "x")]),
    "callback_parameter": ("def replace(module):\n    module.load = None\nhook.add('verl.utils.model', replace)\n",
                           [(2, "verl.utils.model", "load")]),
    "callback_lambda": ("hook.add('verl.m', lambda m: setattr(m, 'x', 1))\n", [(1, "verl.m", "x")]),
    "parameter_by_call": ("import verl.a as a\ndef put(obj, mod):\n    mod.y = 2\nput(1, a)\n", [(3, "verl.a", "y")]),
    "parameter_by_keyword": ("import verl.a as a\ndef put(obj, mod):\n    mod.y = 2\nput(1, mod=a)\n",
                             [(3, "verl.a", "y")]),
    "parameter_by_method_call": ("import verl.a as a\nclass C:\n    def put(self, mod):\n        mod.y = 2\n"
                                 "    def run(self):\n        self.put(a)\n", [(4, "verl.a", "y")]),
    "parameter_of_parameter": ("import verl.a as a\ndef inner(m):\n    m.z = 1\ndef outer(m):\n    inner(m)\nouter(a)\n",
                               [(3, "verl.a", "z")]),
    "module_type_annotation": ("from types import ModuleType\ndef f(m: ModuleType):\n    m.z = 1\n", [(3, UNKNOWN, "z")]),
    "tuple_target": ("import verl.a as a\na.x, a.y = 1, 2\n", [(2, "verl.a", "x"), (2, "verl.a", "y")]),
}
NOT_WRITES = {
    "other_object": "other = object()\nother.a = 1\nsetattr(other, 'b', 2)\n",
    "self": "import verl.a as a\nclass C:\n    def __init__(self):\n        self.a = a\n",
    "class_import": "from verl.workers.engine.base import EngineRegistry\nEngineRegistry.x = 1\n",
    "other_module": "import importlib, sys\nimportlib.import_module('torch').x = 1\nsys.modules['os'].y = 2\n",
    "unrelated_parameter": "import verl.a as a\ndef g(module):\n    module.weight = 1\ng(object())\n",
    "shadowed_in_function": "import verl.a as m\ndef f():\n    m = object()\n    m.x = 1\n",
    "shadowed_by_parameter": "import verl.a as m\ndef f(m):\n    m.x = 1\n",
    "new_module": "import types\nmod = types.ModuleType('verl.fake')\nmod.x = 1\n",
}


@pytest.mark.parametrize("spelling", sorted(SPELLINGS))
def test_the_patch_detector_sees_every_spelling(spelling):
    source, expected = SPELLINGS[spelling]
    assert [w[:3] for w in verl_attribute_writes(source)] == expected


@pytest.mark.parametrize("case", sorted(NOT_WRITES))
def test_the_patch_detector_ignores_other_objects(case):
    assert verl_attribute_writes(NOT_WRITES[case]) == []


def _package_writes():
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = str(path.relative_to(PACKAGE.parent))
        for write in verl_attribute_writes(path.read_text()):
            yield rel, write


def test_every_write_to_a_verl_module_is_declared_in_a_patch_catalogue():
    """Outside the two installers, ``module.x = ...`` (any spelling) on a verl module needs ``(module, x)`` in
    ``patches/scoped.py`` or ``patches/process.py``: a write the catalogues do not list is an unlisted patch."""
    from tests.patch_catalogue import declared_patches

    declared = set(declared_patches())
    offenders = [f"{rel}:{w.line} {w.module}.{w.name}" for rel, w in _package_writes()
                 if (rel, w.function) not in INSTALLERS and (w.module, w.name) not in declared]
    assert not offenders, offenders


def test_the_installers_are_where_the_writes_are():
    """The allow-list names real code: each installer writes a module attribute the detector sees."""
    found = {(rel, w.function) for rel, w in _package_writes()}
    assert INSTALLERS <= found, INSTALLERS - found


# ----------------------------------------------------------------------------------------------
# imports
# ----------------------------------------------------------------------------------------------
def _module_names() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imported(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """verl_traj modules ``name`` imports anywhere in its file (module level, in functions, under TYPE_CHECKING)."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in modules}
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else [])) \
                if node.level else node.module or ""
            for a in node.names:
                target = f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                if target in modules:
                    out.add(target)
    return out - {name}


def import_graph() -> dict[str, set[str]]:
    modules = _module_names()
    return {name: _imported(name, path, modules) for name, path in modules.items()}


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph[todo.pop()] - seen:
            seen.add(nxt)
            todo.append(nxt)
    return seen


def import_cycles(graph: dict[str, set[str]]) -> set[tuple[str, ...]]:
    """The strongly connected components of more than one module, each as a sorted tuple."""
    reach = {name: _reachable(graph, name) for name in graph}
    return {tuple(sorted({name} | {o for o in reach[name] if name in reach[o]})) for name in graph if name in reach[name]}


def test_the_import_graph_reader_sees_cycles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert import_cycles(graph) == {("a", "b", "c")}


def test_no_import_cycles():
    cycles = import_cycles(import_graph())
    assert cycles == KNOWN_IMPORT_CYCLES, sorted(cycles ^ KNOWN_IMPORT_CYCLES)


def test_the_patch_lists_depend_on_nothing_that_uses_them():
    graph = import_graph()
    for catalogue in ("verl_traj.integration.patches.scoped", "verl_traj.integration.patches.process"):
        users = {name for name in graph if catalogue in _reachable(graph, name)}
        assert not (_reachable(graph, catalogue) & users), (catalogue, sorted(_reachable(graph, catalogue) & users))


# ----------------------------------------------------------------------------------------------
# the layout of verl_traj/integration (issue 42)
# ----------------------------------------------------------------------------------------------
INTEGRATION = "verl_traj.integration"
MAX_FOLDER_MODULES = 12
DRIVER_FOLDERS = ("config", "rows", "startup", "trainers")
# modules that run only in worker or agent-loop processes
WORKER_SIDE = ("workers.", "agent_loops.", "tree.tree_forward")


def _folders() -> dict[str, Path]:
    return {path.name: path for path in sorted((PACKAGE / "integration").iterdir())
            if path.is_dir() and (path / "__init__.py").exists()}


def _may_import(folder: Path) -> set[str]:
    """The folders named on the ``May import:`` line of ``folder``'s docstring (``nothing ...``: none)."""
    doc = ast.get_docstring(ast.parse((folder / "__init__.py").read_text())) or ""
    lines = [line for line in doc.splitlines() if line.startswith("May import:")]
    assert len(lines) == 1, f"{folder.name}/__init__.py: its docstring needs one 'May import:' line"
    names = lines[0].removeprefix("May import:").split("(")[0].strip().rstrip(".")
    return set() if names.startswith("nothing") else {n.strip() for n in names.split(",")}


def _folder_of(module: str) -> Optional[str]:
    parts = module.split(".")
    return parts[2] if module.startswith(INTEGRATION + ".") and len(parts) > 3 else None


def test_integration_is_folders_that_say_what_runs_there():
    loose = sorted(p.name for p in (PACKAGE / "integration").glob("*.py") if p.name != "__init__.py")
    assert not loose, f"modules outside a folder: {loose}"
    folders = _folders()
    for name, folder in folders.items():
        modules = [p for p in folder.glob("*.py") if p.name != "__init__.py"]
        assert 0 < len(modules) <= MAX_FOLDER_MODULES, (name, len(modules))
        assert _may_import(folder) <= set(folders) - {name}, (name, _may_import(folder) - set(folders))
    described = ast.get_docstring(ast.parse((PACKAGE / "integration" / "__init__.py").read_text())) or ""
    assert all(name in described for name in folders), "integration/__init__.py maps every folder"


def test_the_folders_form_an_order():
    graph = {name: _may_import(folder) for name, folder in _folders().items()}
    assert not import_cycles(graph), import_cycles(graph)


def test_every_integration_import_is_one_its_folder_allows():
    allowed = {name: _may_import(folder) for name, folder in _folders().items()}
    wrong = sorted(f"{module} -> {target}" for module, targets in import_graph().items() for target in targets
                   if _folder_of(module) and _folder_of(target) not in (None, _folder_of(module))
                   and _folder_of(target) not in allowed[_folder_of(module)])
    assert not wrong, wrong


def test_driver_code_imports_no_worker_or_agent_loop_module():
    graph = import_graph()
    driver = [m for m in graph if _folder_of(m) in DRIVER_FOLDERS]
    wrong = sorted(f"{m} -> {t}" for m in driver for t in graph[m]
                   if t.startswith(INTEGRATION + ".") and t.removeprefix(INTEGRATION + ".").startswith(WORKER_SIDE))
    assert not wrong, wrong


CORE = "verl_traj.core"
CORE_ROOT = {"errors.py", "keys.py", "sorting.py"}  # what every core folder may import


def _core_folders() -> dict[str, Path]:
    return {path.name: path for path in sorted((PACKAGE / "core").iterdir())
            if path.is_dir() and (path / "__init__.py").exists()}


def _core_folder_of(module: str) -> Optional[str]:
    parts = module.split(".")
    return parts[2] if module.startswith(CORE + ".") and len(parts) > 3 else None


def test_the_core_is_folders_that_say_who_runs_them():
    """Issue 54, item 1: at most 12 modules a folder, each folder's docstring says who runs it and what it may
    import; at the root only the modules every folder shares."""
    loose = {p.name for p in (PACKAGE / "core").glob("*.py")} - CORE_ROOT - {"__init__.py"}
    assert not loose, f"core modules outside a folder: {sorted(loose)}"
    for name, folder in _core_folders().items():
        modules = [p for p in folder.glob("*.py") if p.name != "__init__.py"]
        assert 0 < len(modules) <= MAX_FOLDER_MODULES, (name, len(modules))
        doc = ast.get_docstring(ast.parse((folder / "__init__.py").read_text())) or ""
        assert sum(line.startswith("Runs on:") for line in doc.splitlines()) == 1, f"core/{name}: a 'Runs on:' line"
        assert _may_import(folder) <= set(_core_folders()) - {name}, name
    described = ast.get_docstring(ast.parse((PACKAGE / "core" / "__init__.py").read_text())) or ""
    assert all(f"verl_traj.core.{name}" in described for name in _core_folders()), "core/__init__.py maps them"


def test_the_docs_name_every_core_folder():
    """docs/architecture.md's and docs/design.md's folder tables match the tree (issue 54, item 6)."""
    for doc in ("architecture.md", "design.md"):
        text = (PACKAGE.parent / "docs" / doc).read_text()
        row = next(line for line in text.splitlines() if line.startswith("| `verl_traj/core/` |"))
        assert all(f"`{name}/`" in row for name in _core_folders()), (doc, sorted(_core_folders()))
    adapters = sorted(p.name for p in (PACKAGE / "integration").iterdir() if (p / "__init__.py").exists())
    table = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    assert all(f"\n| `{name}/` |" in table for name in adapters), adapters  # the adapters' table: a row each
    row = next(line for line in (PACKAGE.parent / "docs" / "design.md").read_text().splitlines()
               if line.startswith("| `verl_traj/integration/` |"))
    assert all(name in row for name in adapters), adapters


def test_every_core_import_is_one_its_folder_allows_and_they_form_an_order():
    folders = _core_folders()
    allowed = {name: _may_import(folder) for name, folder in folders.items()}
    assert not import_cycles(allowed), import_cycles(allowed)
    wrong = sorted(f"{module} -> {target}" for module, targets in import_graph().items() for target in targets
                   if _core_folder_of(module) and _core_folder_of(target) not in (None, _core_folder_of(module))
                   and _core_folder_of(target) not in allowed[_core_folder_of(module)])
    assert not wrong, wrong


# the package's top-level order, lowest first (docs/architecture.md): a module imports only from its own entry or
# from entries before it; the entries of the last row import nothing of each other
PACKAGE_ORDER = (("configs",), ("core",), ("stepwise",), ("config",), ("integration",), ("cpu",), ("metrics_log",),
                 ("plots",), ("summary",), ("agent_loops", "main_ppo", "quickstart", "recipes", "testing"))


def test_the_package_imports_one_way():
    """Issue 54, item 2: no arrow of the house runs back up (``cpu/`` and ``integration/`` included)."""
    rank = {name: i for i, row in enumerate(PACKAGE_ORDER) for name in row}
    top = {m: m.split(".")[1] for m in import_graph() if m.startswith("verl_traj.") and m.count(".")}
    assert set(top.values()) <= set(rank), sorted(set(top.values()) - set(rank))
    wrong = sorted(f"{m} -> {t}" for m, targets in import_graph().items() if m in top for t in targets
                   if t in top and top[t] != top[m] and rank[top[t]] >= rank[top[m]])
    assert not wrong, wrong


def test_the_core_imports_no_adapter():
    graph = import_graph()
    wrong = sorted(f"{m} -> {t}" for m in graph if m.startswith(("verl_traj.core", "verl_traj.stepwise"))
                   for t in graph[m] if t.startswith(INTEGRATION))
    assert not wrong, wrong


def private_imports(tree: ast.AST) -> list[str]:
    """``from verl_traj... import _name`` anywhere in ``tree`` (a module's private name used by another)."""
    return [f"{node.lineno}: {node.module}.{a.name}" for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("verl_traj"))
            for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]


def test_the_private_import_reader_sees_them():
    assert private_imports(ast.parse("from verl_traj.core.x import _p, q\nfrom .y import _r\nfrom os import _x")) == [
        "1: verl_traj.core.x._p", "2: y._r"]


def test_no_module_imports_another_modules_private_names():
    found = {str(p.relative_to(PACKAGE)): private_imports(ast.parse(p.read_text())) for p in PACKAGE.rglob("*.py")}
    assert not {k: v for k, v in found.items() if v}


def class_assignments(tree: ast.AST) -> list[int]:
    """Lines of ``obj.__class__ = ...`` (a live object retyped) in ``tree``."""
    return [node.lineno for node in ast.walk(tree) if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign))
            for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
            if isinstance(target, ast.Attribute) and target.attr == "__class__"]


def test_no_live_object_is_retyped():
    assert class_assignments(ast.parse("a.__class__ = B\nb = a.__class__")) == [1]
    found = {str(p.relative_to(PACKAGE)): class_assignments(ast.parse(p.read_text())) for p in PACKAGE.rglob("*.py")}
    assert not {k: v for k, v in found.items() if v}


UPDATE_MARKERS = ("OLD_LOG_PROBS_AT_START", "RATIO_IN_LOSS", "CRITIC_UNION_KEY", "PLANNED_FIELDS")


def test_the_update_markers_are_written_by_one_contract_and_read_by_the_workers():
    """Both trainers hand the workers one contract (trainers/update_contract.py); the workers read it."""
    users = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
                   if any(name in p.read_text() for name in UPDATE_MARKERS))
    allowed = ("core/keys.py", "integration/trainers/update_contract.py", "integration/workers/",
               "testing/engine.py")  # the engine tests' harness stages updates by hand (its own ratio groups)
    assert [u for u in users if not u.startswith(allowed)] == [], users


README = PACKAGE.parent / "README.md"


def test_the_readme_is_read_in_five_minutes():
    """Issue 42, item 6: at most 150 lines; every feature-table row one line, with a link to its details."""
    lines = README.read_text().splitlines()
    assert len(lines) <= 150, len(lines)
    table = lines[lines.index("## Features"):]
    rows = [line for line in table[:next(i for i, l in enumerate(table) if l.startswith("## ") and i)]
            if line.startswith("| ") and not line.startswith("| feature")]
    assert rows and all("](docs/" in row and len(row) <= 220 for row in rows), [r for r in rows if len(r) > 220]
