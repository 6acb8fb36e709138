"""Every (verl module, name) the two patch catalogues declare, read by calling each factory with placeholders.

The factories are the public functions of :mod:`verl_traj.integration.patches.scoped` returning ``list[Patch]`` and of
:mod:`verl_traj.integration.patches.process` returning ``list[ProcessPatch]``; a new factory is found here
without a change. ``update_patches`` lists only engine modules the process has loaded, so the engine modules
are put in ``sys.modules`` (empty stand-ins) for a second call when they are not loaded; a factory given an engine
instance (``engine``) gets a stand-in of each engine class a seam names (:mod:`verl_traj.integration.engines`).
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import types

from verl_traj.integration.patches import scoped as patches
from verl_traj.integration.patches import process as process_patches

CATALOGUES = ((patches, "list[Patch]"), (process_patches, "list[ProcessPatch]"))


def _placeholder(*_args, **_kwargs):  # truthy and callable: every switch on, every patch listed
    return None


@contextlib.contextmanager
def _engine_modules_loaded():
    missing = [name for name in patches.ENGINE_MODULES if name not in sys.modules]
    sys.modules.update({name: types.ModuleType(name) for name in missing})
    try:
        yield
    finally:
        for name in missing:
            sys.modules.pop(name, None)


def _engine_instance(path: str):
    """An instance of a stand-in class named as the engine class ``path`` (a seam finds it by that name)."""
    module, name = path.rsplit(".", 1)
    return type(name, (), {"__module__": module, "__qualname__": name})()


def factories() -> list:
    return [fn for module, returns in CATALOGUES for name, fn in sorted(vars(module).items())
            if inspect.isfunction(fn) and fn.__module__ == module.__name__ and not name.startswith("_")
            and fn.__annotations__.get("return") == returns]


def declared_patches() -> dict[tuple[str, str], list[str]]:
    """(module, name) -> the factories that declare it."""
    def call(fn, engine):  # every parameter, optional switches too (fit_patches(trajectory_ratios=...)); a sequence: one
        given = {"engine": engine[0], "engine_class": engine[1]}
        return fn(**{name: given[name] if name in given else [_placeholder]
                     if str(p.annotation).startswith("Sequence") else _placeholder
                     for name, p in inspect.signature(fn).parameters.items()})

    out: dict[tuple[str, str], list[str]] = {}
    engines = [(_engine_instance(path), path) for path in patches.TREE_ENGINES]
    # first outside: whatever a factory imports is the real module
    found = [(fn, call(fn, engine)) for fn in factories() for engine in engines]
    with _engine_modules_loaded():
        found += [(fn, call(fn, engine)) for fn in factories() for engine in engines]
    for fn, patch_list in found:
        for patch in patch_list:
            names = out.setdefault((patch.module, patch.name), [])
            names += [fn.__name__] if fn.__name__ not in names else []
    return out
