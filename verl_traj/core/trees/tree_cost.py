"""Whether a planned micro-batch pays as a prefix tree: a cost model per device kind, and the decision per micro-batch.

The planner knows each micro-batch's row tokens (what the rows would forward) and tree tokens (each distinct prefix
once). A pass costs, in row-token units,

    rows: row_tokens            tree: tree_token x tree_tokens + micro_batch x 1

(``tree_token``: the tree path's cost of one forwarded token relative to the rows path's; ``micro_batch``: its fixed
cost per micro-batch: building the tree, its mask, the gathers back). A micro-batch forwards as a tree where
``tree <= (1 - margin) x rows``, and as rows otherwise, provided its row tokens fit the token cap (the cap was counted
in tree tokens; a micro-batch whose rows would not fit stays a tree). The break-even sharing (the share of row tokens
the tree saves, ``1 - tree_tokens / row_tokens``) above which a micro-batch of ``T`` row tokens is a tree is
``1 - ((1 - margin) - micro_batch / T) / tree_token``.

Fitted figures (:data:`DEVICE_COSTS`): ``cpu`` from the update A/B on this CPU with nothing shared (the tree at 0.69x the
rows' update time for the same tokens: ``scripts/bench_update.py``, docs/prefix_tree.md), so a tree pays at any sharing;
``cuda`` from the H100 update A/B (2.7x faster for 5.9x fewer tokens: 2.19 row tokens' time per tree token), until a GPU
run re-fits it. ``traj.tree_token_cost`` / ``traj.tree_margin`` override them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import numpy as np

__all__ = ["DEVICE_COSTS", "TreeCostModel", "tree_cost_model"]


@dataclass(frozen=True)
class TreeCostModel:
    """A device's tree cost in row-token units (module docstring); ``margin`` in ``[0, 1)``."""

    tree_token: float
    micro_batch: float = 0.0
    margin: float = 0.1

    def pays(self, tree_tokens: np.ndarray, row_tokens: np.ndarray) -> np.ndarray:
        """``[k]`` bool: the tree of each (``tree_tokens`` / ``row_tokens`` ``[k]``) is predicted to win by the
        margin: ``tree_token x tree_tokens + micro_batch <= (1 - margin) x row_tokens``."""
        return self.tree_token * tree_tokens + self.micro_batch <= (1.0 - self.margin) * row_tokens

    def trees(self, tree_tokens: np.ndarray, row_tokens: np.ndarray, cap: Optional[int]) -> np.ndarray:
        """``[k]`` bool: each micro-batch (``tree_tokens`` / ``row_tokens`` ``[k]``) forwards as a tree where it pays.
        A micro-batch whose rows exceed ``cap`` stays a tree (its memory was planned in tree tokens; the planner cuts
        the pieces that do not pay into rows, :mod:`verl_traj.core.plan.tree_planning`, so this is a mixed one)."""
        return self.pays(tree_tokens, row_tokens) | (row_tokens > cap if cap is not None else False)

    def break_even_sharing(self, row_tokens: float) -> float:
        """The share of row tokens a tree must save to run as one, for a micro-batch of ``row_tokens`` (0: always)."""
        return float(min(1.0, max(0.0, 1.0 - ((1.0 - self.margin) - self.micro_batch / row_tokens) / self.tree_token)))


DEVICE_COSTS = {"cpu": TreeCostModel(tree_token=0.69), "cuda": TreeCostModel(tree_token=5.9 / 2.7)}


def tree_cost_model(device: str, tree_token_cost: Optional[float] = None, margin: Optional[float] = None
                    ) -> TreeCostModel:
    """The cost model of ``device`` (``cpu``, else the CUDA figures), with the ``traj:`` overrides where given."""
    model = DEVICE_COSTS["cpu" if device == "cpu" else "cuda"]
    if tree_token_cost is not None:
        model = replace(model, tree_token=float(tree_token_cost))
    return model if margin is None else replace(model, margin=float(margin))
