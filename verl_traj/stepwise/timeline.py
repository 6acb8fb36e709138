"""Credit across turns: a trajectory's step rows as one timeline, for the temporal estimators (GAE, REINFORCE++).

A trajectory trained as step rows (one row per LLM call, or per prefix-merged run of calls) is cut in time; a
per-token estimator run on each row alone has no path from a turn to the rewards and values of the turns after it.
The timeline puts it back together: a trajectory's rows in step order, each row's loss tokens one after the other,
form one sequence. verl's estimators skip positions with ``response_mask == 0`` (values and the accumulator are
carried over them, their rewards ignored: observation tokens inside a merged row, every row's right padding), so
leaving those positions out changes nothing, and on the timeline

* the value of step ``i+1``'s first response token bootstraps step ``i``'s last (GAE), and a reward discounts back
  through every earlier turn (REINFORCE++);
* a trajectory whose rows prefix-merge gets the same per-token advantages and returns from its merged row as from its
  step rows (the merged row's extra positions are masked observation tokens: transparent);
* verl's whitening runs over the same set of loss tokens as on the rows (the batch's real response tokens).

:class:`Timeline` is the index map, built once per batch from the plan's ``traj_index``, the rows' step order and
their response masks; :meth:`Timeline.gather` / :meth:`Timeline.scatter` move ``[B, R]`` tensors to ``[T, L]`` and
back with one advanced index each (no loop over rows). Padding rows (``traj_index == -1``) are not on any timeline
and get zeros.

Pure module (torch and numpy). verl's estimator is passed in as a callable.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

import numpy as np
import torch

from verl_traj.core.errors import TrajInputError, check_binary_mask, check_finite, check_index, check_shape

__all__ = ["Timeline", "timeline_advantages"]


@dataclass(frozen=True)
class Timeline:
    """Where each loss token of a real row sits on its trajectory's timeline.

    Positions with ``response_mask == 0`` (observations inside a merged row, every row's right padding) are
    transparent to verl's temporal estimators (values and accumulators are carried over them, their rewards
    ignored), so the timeline holds the loss tokens only: trajectory ``t``'s rows in step order, each row's loss
    tokens in order; ``L`` is the most loss tokens of one trajectory (not rows x R: a long agent's padding would
    otherwise dominate verl's per-position loop). Token ``k``: batch position ``(row[k], col[k])``, timeline position
    ``(traj[k], pos[k])``."""

    row: torch.Tensor
    col: torch.Tensor
    traj: torch.Tensor
    pos: torch.Tensor
    first_row: torch.Tensor  # [T] batch index of each trajectory's first row (step order)
    num_trajectories: int
    length: int
    shape: tuple[int, int]  # [B, R] of the batch

    @classmethod
    def build(cls, traj_index: torch.Tensor, step_index: torch.Tensor, response_mask: torch.Tensor) -> "Timeline":
        """From the plan's ``traj_index`` ``[B]`` (dense ``0..T-1``, ``-1`` on padding), each row's step ``[B]`` (any
        increasing order within a trajectory, no step twice: the expansion's ``step_index``, v1's output index) and
        ``response_mask`` ``[B, R]`` (0/1). Anything else is a :class:`TrajInputError` naming the field."""
        mask = _checked_mask(response_mask)
        rows_in = mask.shape[0]
        traj_index = check_index("traj_index", traj_index, "pass the traj_index apply_plan wrote (dense 0..T-1, -1 on "
                                 "padding rows), one per row of response_mask", rows=rows_in, low=-1)
        step_index = check_index("step_index", step_index, "pass each row's step (>= 0, one per row of "
                                 "response_mask)", rows=rows_in)
        rows = torch.nonzero(traj_index >= 0).reshape(-1)
        rows = rows[torch.argsort(step_index[rows], stable=True)]
        rows = rows[torch.argsort(traj_index[rows], stable=True)]  # (trajectory, step)
        traj = traj_index[rows]
        num_t = int(traj.max()) + 1 if traj.numel() else 0
        rows_per_traj = torch.bincount(traj, minlength=num_t)
        _check_trajectories(traj, step_index[rows], rows, rows_per_traj)
        counts = mask[rows].sum(-1)  # loss tokens per row
        per_traj = torch.zeros(num_t, dtype=torch.long).index_add_(0, traj, counts)
        offset = torch.cumsum(counts, 0) - counts - (torch.cumsum(per_traj, 0) - per_traj)[traj]  # within trajectory
        n, col = torch.nonzero(mask[rows], as_tuple=True)
        pos = offset[n] + torch.cumsum(mask[rows].long(), -1)[n, col] - 1
        starts = torch.cumsum(rows_per_traj, 0) - rows_per_traj
        return cls(row=rows[n], col=col, traj=traj[n], pos=pos, first_row=rows[starts[:num_t]] if rows.numel() else rows,
                   num_trajectories=num_t, length=int(per_traj.max()) if num_t else 0, shape=tuple(mask.shape))

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, R]`` -> ``[T, L]`` (loss tokens only; positions past a trajectory's last are 0)."""
        out = x.new_zeros((self.num_trajectories, self.length))
        out[self.traj.to(x.device), self.pos.to(x.device)] = x[self.row.to(x.device), self.col.to(x.device)]
        return out

    def mask(self, like: torch.Tensor) -> torch.Tensor:
        """``[T, L]`` 1 on every timeline position that holds a loss token."""
        out = like.new_zeros((self.num_trajectories, self.length))
        out[self.traj.to(like.device), self.pos.to(like.device)] = 1
        return out

    def scatter(self, y: torch.Tensor) -> torch.Tensor:
        """``[T, L]`` -> ``[B, R]``: each loss token's value back at its row and position; everything else 0 (as
        verl's estimators leave masked positions of their advantages)."""
        out = y.new_zeros(self.shape)
        out[self.row.to(y.device), self.col.to(y.device)] = y[self.traj.to(y.device), self.pos.to(y.device)]
        return out


def _checked_mask(response_mask: Any) -> torch.Tensor:
    """``[B, R]`` bool of a 0/1 ``response_mask`` (CPU)."""
    if not isinstance(response_mask, torch.Tensor) or response_mask.dim() != 2:
        raise TrajInputError.invalid("response_mask", response_mask, "is not a [B, R] tensor",
                                     "pass the batch's response_mask")
    check_binary_mask("response_mask", response_mask)
    return response_mask.detach().cpu() != 0


def _check_trajectories(traj: torch.Tensor, steps: torch.Tensor, rows: torch.Tensor,
                        rows_per_traj: torch.Tensor) -> None:
    """Real rows sorted by (trajectory, step): every trajectory ``0..T-1`` has a row, no step repeats in one."""
    if rows_per_traj.numel() and not bool((rows_per_traj > 0).all()):
        t = int(torch.nonzero(rows_per_traj == 0)[0, 0])
        raise TrajInputError.invalid(
            "traj_index", traj, f"skips trajectory {t} (no row has it; {rows_per_traj.numel()} trajectories)",
            "pass the plan's dense traj_index 0..T-1 (apply_plan writes it; do not drop or renumber rows)")
    dup = (traj[1:] == traj[:-1]) & (steps[1:] == steps[:-1])
    if bool(dup.any()):
        i = int(torch.nonzero(dup)[0, 0])
        raise TrajInputError.invalid(
            f"step_index[{int(rows[i + 1])}]", int(steps[i + 1]), f"repeats the step of row {int(rows[i])} in "
            f"trajectory {int(traj[i])}: its timeline order is ambiguous",
            "give every row of a trajectory its own step (the expansion's step_index; keep each step row once)")


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
        token_level_rewards, response_mask, values: ``[B, R]`` per row (values for GAE), the timeline's shape;
            rewards and values finite on the loss tokens.
        index: per-trajectory ``[T]`` group ids (estimators with a group baseline).
    Returns:
        ``(advantages [B, R], returns [B, R])``, zero on padding rows and masked positions as verl's are.
    """
    fix = "pass [B, R] tensors of the batch the timeline was built from (Timeline.build on its response_mask)"
    for name, tensor in (("token_level_rewards", token_level_rewards), ("response_mask", response_mask),
                         ("values", values)):
        if tensor is not None or name != "values":
            check_shape(name, tensor, timeline.shape, fix)
    if estimator_kwargs is not None and not isinstance(estimator_kwargs, Mapping):
        raise TrajInputError.invalid("estimator_kwargs", estimator_kwargs, "is not a mapping", "pass a dict or None")
    if index is not None and np.shape(index)[:1] != (timeline.num_trajectories,):
        raise TrajInputError.invalid("index", index, f"has shape {np.shape(index)}, expected "
                                     f"[{timeline.num_trajectories}] (one group id per trajectory)",
                                     "pass uid[timeline.first_row]")
    kwargs: dict[str, Any] = dict(estimator_kwargs or {})
    kwargs.update(token_level_rewards=timeline.gather(token_level_rewards),
                  response_mask=timeline.mask(token_level_rewards))
    check_finite("token_level_rewards", kwargs["token_level_rewards"], "make the reward function return finite "
                 "numbers for every row (a NaN spreads through every earlier turn of its trajectory)")
    if values is not None:
        kwargs["values"] = timeline.gather(values.to(token_level_rewards.dtype))
        check_finite("values", kwargs["values"], "the critic returned non-finite values: check its training")
    if index is not None:
        kwargs["index"] = index
    advantages, returns = estimator_fn(**kwargs)
    return timeline.scatter(advantages), timeline.scatter(returns)
