"""One engine's seam (:class:`EngineSeam`) and the registry of seams by strategy (the package doc says what for)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

__all__ = ["ENGINES", "EngineSeam", "engine_of", "micro_batch_modules", "planned_strategies",
           "register_engine", "tree_engines", "tree_strategies"]


@dataclass(frozen=True)
class EngineSeam:
    """One training engine, as verl_traj drives it.

    * ``strategies``: the ``<role>.strategy`` values that select it;
    * ``micro_batch_modules``: modules whose module-level ``prepare_micro_batches`` the engine's
      ``forward_backward_batch`` calls to cut a mini-batch into micro-batches: the plan's micro-batches replace it for
      one call (:func:`~verl_traj.integration.patches.scoped.micro_batch_patches`; empty: verl's own cut, unplanned);
    * ``tree_engine``: the engine class (dotted path) whose instance's ``prepare_model_inputs`` /
      ``prepare_model_outputs`` a prefix-tree pass wraps (:mod:`~verl_traj.integration.tree.tree_forward`); ``None``:
      no trees on this engine (``traj.prefix_tree=auto`` settles to rows, ``true`` is refused);
    * ``model_attribute``: the engine's attribute holding the model it trains (its Hugging Face ``config``'s attention
      implementation is checked before a tree pass).

    Data only: the workers resolve their engine's seam once, when they are built (:func:`engine_of`), so an update
    calls nothing here."""

    name: str
    strategies: tuple[str, ...]
    micro_batch_modules: tuple[str, ...] = ()
    tree_engine: Optional[str] = None
    model_attribute: str = "module"


ENGINES: dict[str, EngineSeam] = {}


def register_engine(seam: EngineSeam) -> EngineSeam:
    """Add ``seam`` (its strategies must be new)."""
    taken = sorted(s for s in seam.strategies if any(s in e.strategies for e in ENGINES.values() if e is not seam))
    if taken:
        raise ValueError(f"engine seam {seam.name!r}: strategies {taken} already have a seam")
    ENGINES[seam.name] = seam
    return seam


def engine_of(engine: Any) -> Optional[EngineSeam]:
    """The seam whose ``tree_engine`` class ``engine`` (an instance) is, or derives from; ``None`` if none."""
    names = {f"{c.__module__}.{c.__qualname__}" for c in type(engine).__mro__}
    return next((e for e in ENGINES.values() if e.tree_engine in names), None)


def planned_strategies() -> tuple[str, ...]:
    """Strategies whose micro-batches are the plan's."""
    return tuple(s for e in ENGINES.values() if e.micro_batch_modules for s in e.strategies)


def tree_strategies() -> tuple[str, ...]:
    """Strategies that forward prefix trees."""
    return tuple(s for e in ENGINES.values() if e.tree_engine for s in e.strategies)


def micro_batch_modules() -> tuple[str, ...]:
    """Every module whose ``prepare_micro_batches`` a planned update replaces."""
    return tuple(m for e in ENGINES.values() for m in e.micro_batch_modules)


def tree_engines() -> tuple[str, ...]:
    """Every engine class a prefix-tree pass wraps."""
    return tuple(e.tree_engine for e in ENGINES.values() if e.tree_engine)


