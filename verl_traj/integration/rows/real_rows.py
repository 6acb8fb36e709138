"""Real rows of a planned verl batch: the one reader of the padding flag, and real-row views for verl's
batch-level functions (advantages, KL-in-reward, metrics).

Padding rows exist so every DP rank holds the same number of rows of a mini-batch; nothing of them may
reach an advantage, a group statistic or a metric. verl's functions know nothing of padding, so the
wrappers here hand them the real rows only:

* :func:`advantage_on_real_rows`: any estimator runs on the real rows; padding rows get zero
  advantages and returns. Estimators proven not to be moved by padding rows (each padding row is a
  group of one with no loss token; ``padding_safe`` in :mod:`verl_traj.core.plan.estimators`, each checked by a test against
  the real-row result) run on the whole batch, and only the padding rows' outputs are zeroed: no copy.
* :func:`kl_penalty_on_real_rows`: KL-in-reward statistics and the adaptive controller see real rows.
* :func:`metrics_on_real_rows`: the metric functions that run at the end of a step (data, timing,
  throughput, variance proxy) share ONE real-row view, built by the first of them.

The views never copy the wide ``[B, prompt + response]`` tensors (token ids, positions, attention mask:
most of a batch's bytes): verl's estimators read only per-row and per-response-token fields, and its
metric functions read the prompt / response lengths (verl's own ``prompt_length`` / ``response_length``
fields, computed here from the attention mask without a copy) and only the widths of ``prompts`` /
``responses`` (zero-stride placeholders of the right shape). Without padding rows every wrapper passes
the batch itself.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, Callable, Optional

import numpy as np
import torch

from verl_traj.core.errors import check_finite
from verl_traj.core.plan.estimators import estimator_traits
from verl_traj.core.keys import ADVANTAGE_METRICS, IS_PADDING

__all__ = [
    "is_padding",
    "real_rows",
    "advantage_on_real_rows",
    "kl_penalty_on_real_rows",
    "metric_view",
    "metrics_on_real_rows",
    "reward_on_real_rows",
    "shared_view",
    "spec_decode_on_real_rows",
]

# [B, prompt + response]-wide tensors no estimator or metric reads by value (the largest per-row tensors).
_WIDE_KEYS = ("input_ids", "prompts", "responses", "position_ids", "attention_mask")
_ZERO_ON_PADDING = ("advantages", "returns")


def is_padding(batch: Any) -> Optional[np.ndarray]:
    """``[B]`` bool of the padding rows of a verl ``DataProto``, or None when it has none.

    The plan writes the flag as a tensor only (:mod:`verl_traj.core.keys`)."""
    td = getattr(batch, "batch", None)
    if td is None or IS_PADDING not in td.keys():
        return None
    pad = td[IS_PADDING].detach().cpu().numpy().astype(bool)
    return pad if pad.any() else None


def real_rows(batch: Any, keys: Optional[list[str]] = None) -> Any:
    """The batch without its padding rows (a copy, ``meta_info`` copied, ``global_token_num`` filtered);
    ``keys``: only these tensor fields. The batch itself when it has no padding row."""
    pad = is_padding(batch)
    if pad is None:
        return batch
    keep = ~pad
    source = batch if keys is None else batch.select(batch_keys=keys)
    sub = source.select_idxs(keep)
    sub.meta_info = dict(batch.meta_info)
    gtn = sub.meta_info.get("global_token_num")
    if isinstance(gtn, (list, tuple)) and len(gtn) == len(pad):
        sub.meta_info["global_token_num"] = [t for t, k in zip(gtn, keep) if k]
    return sub


def _scatter_back(full: Any, sub: Any, keep: np.ndarray) -> None:
    """Tensors ``sub`` (real rows) added or recomputed go into ``full``; padding rows get zeros there.
    New non-tensor fields get ``None`` on padding rows."""
    idx = torch.from_numpy(np.flatnonzero(keep))
    for key, val in sub.batch.items():
        if key in full.batch.keys() and key not in _ZERO_ON_PADDING:
            continue
        base = torch.zeros((len(keep),) + tuple(val.shape[1:]), dtype=val.dtype, device=val.device)
        base[idx.to(base.device)] = val
        full.batch[key] = base
    for key, val in sub.non_tensor_batch.items():
        if key not in full.non_tensor_batch:
            arr = np.empty(len(keep), dtype=object)
            arr[np.flatnonzero(keep)] = val
            full.non_tensor_batch[key] = arr


def _estimator_view(data: Any) -> Optional[tuple[np.ndarray, Any]]:
    """``(real-row mask, real rows without the wide tensors)``, or None when there is no padding row."""
    pad = is_padding(data)
    if pad is None:
        return None
    return ~pad, real_rows(data, [k for k in data.batch.keys() if k not in _WIDE_KEYS])


def metric_view(batch: Any) -> Any:
    """Real rows for verl's metric functions: the narrow fields copied, ``prompt_length`` /
    ``response_length`` (float, as verl computes them) from the attention mask, ``prompts`` / ``responses``
    as zero-stride placeholders of the real widths. The batch itself when it has no padding row."""
    view = _estimator_view(batch)
    if view is None:
        return batch
    keep, sub = view
    td = batch.batch
    width = td["responses"].shape[-1]
    index = torch.from_numpy(np.flatnonzero(keep)).to(td["attention_mask"].device)
    sub.batch["prompt_length"] = td["attention_mask"][:, :-width].sum(-1).float().index_select(0, index)
    sub.batch["response_length"] = td["attention_mask"][:, -width:].sum(-1).float().index_select(0, index)
    for key in ("prompts", "responses"):
        sub.batch[key] = td[key][:1].expand(int(keep.sum()), *td[key].shape[1:])
    return sub


def advantage_on_real_rows(fn: Callable) -> Callable:
    """Wrap verl's ``compute_advantage(data, adv_estimator, ...)``: padding rows get zeros and move nothing."""

    @functools.wraps(fn)
    def wrapper(data: Any, *args: Any, **kwargs: Any) -> Any:
        estimator = kwargs.get("adv_estimator", args[0] if args else None)
        pad = is_padding(data)
        rewards = data.batch["token_level_rewards"]
        check_finite("token_level_rewards", rewards if pad is None else rewards[torch.from_numpy(~pad)],
                     "make the reward function return a finite number for every row (a NaN poisons the advantages "
                     "of its whole group)")
        if pad is not None and estimator_traits(estimator).padding_safe:
            out = fn(data, *args, **kwargs)
            index = torch.from_numpy(np.flatnonzero(pad))
            for key in _ZERO_ON_PADDING:
                if key in out.batch.keys():
                    out.batch[key][index.to(out.batch[key].device)] = 0
            return out
        view = _estimator_view(data)
        if view is None:
            return fn(data, *args, **kwargs)
        _scatter_back(data, fn(view[1], *args, **kwargs), view[0])
        return data

    return wrapper


def kl_penalty_on_real_rows(fn: Callable) -> Callable:
    """Wrap verl's ``apply_kl_penalty(data, kl_ctrl, ...)``: statistics and the adaptive KL controller
    see real rows; padding rows keep their (zero) scores as rewards."""

    @functools.wraps(fn)
    def wrapper(data: Any, *args: Any, **kwargs: Any) -> Any:
        view = _estimator_view(data)
        if view is None:
            return fn(data, *args, **kwargs)
        out, metrics = fn(view[1], *args, **kwargs)
        rewards = data.batch["token_level_scores"].clone()
        rewards[torch.from_numpy(np.flatnonzero(view[0])).to(rewards.device)] = out.batch["token_level_rewards"]
        data.batch["token_level_rewards"] = rewards
        return data, metrics

    return wrapper


def reward_on_real_rows(fn: Callable) -> Callable:
    """Wrap verl's ``extract_reward(batch) -> (reward_tensor, extra)``: padding rows' rewards are 0 (a
    colocated reward model scores every row after ``_balance_batch``; a padding row's score stops here)."""

    @functools.wraps(fn)
    def wrapper(batch: Any, *args: Any, **kwargs: Any) -> Any:
        reward, extra = fn(batch, *args, **kwargs)
        pad = is_padding(batch)
        if pad is None:
            return reward, extra
        reward = reward.clone()
        reward[torch.from_numpy(np.flatnonzero(pad)).to(reward.device)] = 0
        return reward, extra

    return wrapper


def spec_decode_on_real_rows(fn: Callable, real_row_mask: Callable[[], Optional[np.ndarray]]) -> Callable:
    """Wrap verl's ``compute_spec_decode_metrics(drafts, accepts, verifies, non_padding_mask=None)``: ``fit``
    passes no mask, so the current planned batch's real-row mask is filled in."""

    @functools.wraps(fn)
    def wrapper(drafts: Any, accepts: Any, verifies: Any, non_padding_mask: Any = None) -> Any:
        mask = real_row_mask()
        if non_padding_mask is None and drafts is not None and mask is not None and len(mask) == len(drafts):
            non_padding_mask = mask
        return fn(drafts, accepts, verifies, non_padding_mask=non_padding_mask)

    return wrapper


class _LastView:
    """The real-row copy of the last batch seen, reused while that batch object and its fields are unchanged."""

    def __init__(self) -> None:
        self._batch: Optional[weakref.ref] = None
        self._key: Optional[tuple] = None
        self._view: Any = None

    def get(self, batch: Any) -> Any:
        key = (id(batch.batch), tuple(batch.batch.keys()), tuple(batch.non_tensor_batch.keys()))
        if self._batch is None or self._batch() is not batch or self._key != key:
            self._batch, self._key, self._view = weakref.ref(batch), key, metric_view(batch)
        return self._view


def metrics_on_real_rows(fn: Callable, view: Optional[_LastView] = None, with_meta_metrics: bool = False) -> Callable:
    """Wrap a verl metric function ``fn(batch, ...)``. Wrappers given the same ``view`` share one copy.
    ``with_meta_metrics``: add the metrics the advantage step left in ``batch.meta_info`` (v0's channel from
    ``compute_advantage`` to the step's metrics: :data:`~verl_traj.core.keys.ADVANTAGE_METRICS`)."""
    view = view or _LastView()

    @functools.wraps(fn)
    def wrapper(batch: Any, *args: Any, **kwargs: Any) -> Any:
        out = fn(view.get(batch) if is_padding(batch) is not None else batch, *args, **kwargs)
        extra = getattr(batch, "meta_info", {}).get(ADVANTAGE_METRICS) if with_meta_metrics else None
        return {**out, **extra} if extra else out

    return wrapper


def shared_view() -> _LastView:
    """A view that several :func:`metrics_on_real_rows` wrappers share (one copy per step)."""
    return _LastView()
