"""Credit across turns: a trajectory's step rows as one timeline, for the temporal estimators (GAE, REINFORCE++).

A trajectory trained as step rows (one row per LLM call, or per prefix-merged run of calls) is cut in time; a
per-token estimator run on each row alone has no path from a turn to the rewards and values of the turns after it.
The timeline puts it back together: a trajectory's rows in step order, each row's own response positions
(``[R]`` wide, right-padded) one after the other, form one ``[L]`` sequence (``L = rows x R``, the longest
trajectory's). verl's estimators already skip positions with ``response_mask == 0`` (values and the accumulator are
carried over them: observation tokens inside a merged row, and the right padding of every row here), so on the
timeline

* the value of step ``i+1``'s first response token bootstraps step ``i``'s last (GAE), and a reward discounts back
  through every earlier turn (REINFORCE++);
* a trajectory whose rows prefix-merge gets the same per-token advantages and returns from its merged row as from its
  step rows (the merged row's extra positions are masked observation tokens: transparent);
* verl's whitening runs over the same set of loss tokens as on the rows (the batch's real response tokens).

:class:`Timeline` is the index map, built once per batch from the plan's ``traj_index`` and the rows' step order;
:meth:`Timeline.gather` / :meth:`Timeline.scatter` move ``[B, R]`` tensors to ``[T, L]`` and back with one advanced
index each (no loop over rows). Padding rows (``traj_index == -1``) are not on any timeline and get zeros.

Pure module (torch only). verl's estimator is passed in as a callable.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

import torch

__all__ = ["Timeline", "timeline_advantages"]


@dataclass(frozen=True)
class Timeline:
    """Where each real row's response positions sit on its trajectory's timeline.

    ``rows``: ``[N]`` the real rows (batch indices), ``traj``: ``[N]`` their trajectory (dense ``0..T-1``),
    ``slot``: ``[N]`` the row's place among its trajectory's rows in step order; ``width``: ``R``;
    ``num_slots``: the most rows of one trajectory. Position ``j`` of row ``rows[n]`` is timeline position
    ``(traj[n], slot[n] * R + j)``."""

    rows: torch.Tensor
    traj: torch.Tensor
    slot: torch.Tensor
    num_trajectories: int
    num_slots: int
    width: int

    @classmethod
    def build(cls, traj_index: torch.Tensor, step_index: torch.Tensor, width: int) -> "Timeline":
        """From the plan's ``traj_index`` ``[B]`` (``-1`` on padding) and each row's step (any increasing order
        within a trajectory: the expansion's ``step_index``, v1's output index)."""
        traj_index = torch.as_tensor(traj_index).reshape(-1).long().cpu()
        step_index = torch.as_tensor(step_index).reshape(-1).long().cpu()
        if step_index.numel() != traj_index.numel():
            raise ValueError(f"step_index has {step_index.numel()} rows, traj_index {traj_index.numel()}")
        rows = torch.nonzero(traj_index >= 0).reshape(-1)
        traj = traj_index[rows]
        num_t = int(traj.max()) + 1 if traj.numel() else 0
        # order real rows by (trajectory, step); a row's slot = its rank within its trajectory
        order = torch.argsort(traj * (int(step_index.max()) + 2 if step_index.numel() else 1) + step_index[rows],
                              stable=True)
        rows, traj = rows[order], traj[order]
        counts = torch.bincount(traj, minlength=num_t)
        starts = torch.cumsum(counts, 0) - counts
        slot = torch.arange(rows.numel()) - starts[traj]
        return cls(rows=rows, traj=traj, slot=slot, num_trajectories=num_t,
                   num_slots=int(counts.max()) if num_t else 0, width=int(width))

    @property
    def length(self) -> int:
        return self.num_slots * self.width

    def first_rows(self) -> torch.Tensor:
        """``[T]`` the batch index of each trajectory's first row (for per-trajectory fields such as the group id)."""
        return self.rows[self.slot == 0]

    def _index(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        cols = self.slot[:, None] * self.width + torch.arange(self.width)[None, :]
        return (self.rows.to(device), self.traj[:, None].expand_as(cols).to(device), cols.to(device))

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, R]`` -> ``[T, L]``; positions past a trajectory's last row are 0."""
        rows, traj, cols = self._index(x.device)
        out = x.new_zeros((self.num_trajectories, self.length))
        out[traj, cols] = x[rows]
        return out

    def scatter(self, y: torch.Tensor, num_rows: int) -> torch.Tensor:
        """``[T, L]`` -> ``[B, R]`` (``num_rows`` = B); rows on no timeline (padding) are 0."""
        rows, traj, cols = self._index(y.device)
        out = y.new_zeros((num_rows, self.width))
        out[rows] = y[traj, cols]
        return out


def timeline_advantages(
    estimator_fn: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    timeline: Timeline,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    values: Optional[torch.Tensor] = None,
    index: Optional[Any] = None,
    estimator_kwargs: Optional[Mapping[str, Any]] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run a temporal estimator (verl's ``compute_gae_advantage_return``, REINFORCE++, ...) on the trajectories'
    timelines and put the result back on each row's own positions.

    Args:
        estimator_fn: verl's registered estimator (called with the timeline tensors and ``estimator_kwargs``).
        timeline: the batch's :class:`Timeline`.
        token_level_rewards, response_mask, values: ``[B, R]`` per row (values for GAE).
        index: per-trajectory ``[T]`` group ids (estimators with a group baseline).
    Returns:
        ``(advantages [B, R], returns [B, R])``, zero on padding rows and masked positions as verl's are.
    """
    kwargs: dict[str, Any] = dict(estimator_kwargs or {})
    kwargs.update(token_level_rewards=timeline.gather(token_level_rewards),
                  response_mask=timeline.gather(response_mask.to(token_level_rewards.dtype)))
    if values is not None:
        kwargs["values"] = timeline.gather(values.to(token_level_rewards.dtype))
    if index is not None:
        kwargs["index"] = index
    advantages, returns = estimator_fn(**kwargs)
    n = token_level_rewards.shape[0]
    return timeline.scatter(advantages, n), timeline.scatter(returns, n)
