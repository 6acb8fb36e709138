"""Per-row loss weights: every loss aggregation mode as one weighted token sum, as a registry by name.

Pure module (torch only). Before each update the trainer computes ``loss_weight`` (float32, one value
per row) from the plan's per-row facts carried in the batch (``mini_batch_id``, ``traj_index``,
``is_padding``) and the final ``response_mask`` (verl's rollout correction may still mask tokens after
planning, so the weights are computed when the mask is final, once per update). The loss functions
(``verl_traj.integration.workers.losses``) then aggregate every loss term ``loss_t`` (policy, entropy, KL,
value) of a mini-batch ``m`` as

    loss(m) = sum_{rows i in m} sum_t  loss_{i,t} * response_mask_{i,t} * w_i

(verl's ``agg_loss(..., loss_agg_mode="token-sum", dp_size=...)`` with the weighted mask; the
``* dp_size`` there cancels the DP gradient averaging of FSDP). Because ``w_i`` already holds the
mini-batch-global normaliser, the gradient of a mini-batch does not depend on how its rows are spread
over DP ranks or cut into micro-batches, and padding rows (``w = 0``) contribute nothing.

Notation, for the mini-batch ``m`` of row ``i``; only *real* rows enter any statistic:

* ``l_i``   = loss tokens of row i = ``response_mask[i].sum()``
* ``N_m``   = real rows in m (rows with ``l_i == 0`` included, as verl's ``global_batch_size`` counts rows)
* ``L_m``   = sum of ``l_i`` over the real rows of m
* ``T_m``   = trajectories with a real row in m
* ``L_k``   = sum of ``l_i`` over the real rows of trajectory k
* ``S``     = ``loss_scale_factor`` if given, else the response width ``R = response_mask.shape[1]``

Modes (``w_i = 0`` for padding rows and wherever a formula divides by a zero count):

- ``token-mean``:              ``w_i = 1 / L_m``            (mean over all loss tokens of the mini-batch)
- ``seq-mean-token-sum``:      ``w_i = 1 / N_m``            (mean over rows of each row's token sum)
- ``seq-mean-token-mean``:     ``w_i = 1 / (N_m * l_i)``    (mean over rows of each row's token mean)
- ``seq-mean-token-sum-norm``: ``w_i = 1 / (N_m * S)``      (row token sums over a constant S, mean over rows)
- ``traj-mean``:               ``w_i = 1 / (T_m * L_k(i))`` (mean over trajectories of each trajectory's
  token mean over all its step rows together; every trajectory weighs the same whatever its steps)

Differences from verl's own ``agg_loss``: the statistics are those of the real mini-batch (verl uses the
configured ``ppo_mini_batch_size * n`` row count, which counts padding and is wrong for variable-size
mini-batches), and ``seq-mean-token-sum-norm`` uses a constant ``S`` (verl falls back to the current
micro-batch's padded width, which varies between micro-batches). With one row per trajectory
``traj-mean`` equals ``seq-mean-token-mean``.

A new mode is one decorated function of :class:`RowStats`::

    @register_loss_weight("my-mode")
    def _my_mode(s: RowStats) -> torch.Tensor:   # [B] float64, padding rows are zeroed afterwards
        return s.per_mini_batch(s.real)[s.mini_batch].reciprocal()
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from verl_traj.core.errors import TrajInputError, check_binary_mask, check_finite, check_index, check_positive_number, check_shape

__all__ = ["LOSS_WEIGHT_FNS", "RowStats", "compute_loss_weights", "compute_loss_weights_from_counts",
           "loss_weight_modes", "register_loss_weight"]

LOSS_WEIGHT_FNS: dict[str, Callable[["RowStats"], torch.Tensor]] = {}


def register_loss_weight(name: str, *, override: bool = False) -> Callable:
    """Register ``fn(RowStats) -> [B] float64`` as loss aggregation mode ``name`` (verl's
    ``register_policy_loss`` style).

    A name already registered is refused (as verl's ``register_adv_est`` refuses duplicates): a second
    registration would silently replace the first, built-in modes included. Pass ``override=True`` to
    replace it on purpose."""
    if not isinstance(name, str) or not name:
        raise TrajInputError.invalid("loss_agg_mode", name, "is not a mode name",
                                     "register a loss weight under a non-empty str name")

    def decorator(fn: Callable[["RowStats"], torch.Tensor]) -> Callable[["RowStats"], torch.Tensor]:
        if not callable(fn):
            raise TrajInputError.invalid("loss_agg_mode", name, f"was registered with a non-callable {fn!r}",
                                         "decorate a function fn(RowStats) -> [B] tensor")
        existing = LOSS_WEIGHT_FNS.get(name)
        if existing is not None and existing is not fn and not override:
            raise TrajInputError.invalid(
                "loss_agg_mode", name,
                f"is already registered (by {getattr(existing, '__module__', '?')}."
                f"{getattr(existing, '__qualname__', existing)!s})",
                f"pick another name, or pass register_loss_weight({name!r}, override=True) to replace it",
            )
        LOSS_WEIGHT_FNS[name] = fn
        return fn

    return decorator


def loss_weight_modes() -> tuple[str, ...]:
    """The registered mode names (what ``traj.loss_agg_mode`` accepts)."""
    return tuple(LOSS_WEIGHT_FNS)


def safe_reciprocal(x: torch.Tensor) -> torch.Tensor:
    """``1 / x`` where ``x > 0``, else 0 (float64)."""
    x = x.to(torch.float64)
    return torch.where(x > 0, 1.0 / x.clamp(min=1e-300), torch.zeros_like(x))


@dataclass(frozen=True)
class RowStats:
    """What a weight function may use; every ``[B]`` tensor on the mask's device, float64 unless stated.

    mini_batch: ``[B]`` int64 dense 0..M-1; traj: ``[B]`` int64 dense 0..T-1 (-1 on padding);
    real: 1.0 on real rows; loss_tokens: ``l_i`` (0 on padding); scale: ``S``."""

    mini_batch: torch.Tensor
    traj: torch.Tensor
    real: torch.Tensor
    loss_tokens: torch.Tensor
    num_mini_batches: int
    num_trajectories: int
    scale: float

    def per_mini_batch(self, values: torch.Tensor) -> torch.Tensor:
        """``[M]`` sums of ``values`` ``[B]`` per mini-batch."""
        return values.new_zeros(self.num_mini_batches).index_add_(0, self.mini_batch, values)

    def per_trajectory(self, values: torch.Tensor) -> torch.Tensor:
        """``[T]`` sums of ``values`` ``[B]`` over the real rows of each trajectory."""
        real = self.traj >= 0
        return values.new_zeros(self.num_trajectories).index_add_(0, self.traj[real], values[real])


@register_loss_weight("token-mean")
def _token_mean(s: RowStats) -> torch.Tensor:
    return safe_reciprocal(s.per_mini_batch(s.loss_tokens))[s.mini_batch]


@register_loss_weight("seq-mean-token-sum")
def _seq_mean_token_sum(s: RowStats) -> torch.Tensor:
    return safe_reciprocal(s.per_mini_batch(s.real))[s.mini_batch]


@register_loss_weight("seq-mean-token-mean")
def _seq_mean_token_mean(s: RowStats) -> torch.Tensor:
    return _seq_mean_token_sum(s) * safe_reciprocal(s.loss_tokens)


@register_loss_weight("seq-mean-token-sum-norm")
def _seq_mean_token_sum_norm(s: RowStats) -> torch.Tensor:
    return _seq_mean_token_sum(s) / s.scale


@register_loss_weight("traj-mean")
def _traj_mean(s: RowStats) -> torch.Tensor:
    """A trajectory lives in one mini-batch (the plan never splits one), so ``T_m`` counts trajectories."""
    traj = s.traj.clamp(min=0)
    has_real = (s.per_trajectory(s.real) > 0).to(torch.float64)
    traj_mini_batch = torch.zeros(s.num_trajectories, dtype=torch.long, device=traj.device)
    traj_mini_batch[s.traj[s.traj >= 0]] = s.mini_batch[s.traj >= 0]
    per_mb = has_real.new_zeros(s.num_mini_batches).index_add_(0, traj_mini_batch, has_real)
    return safe_reciprocal(per_mb)[s.mini_batch] * safe_reciprocal(s.per_trajectory(s.loss_tokens))[traj]


def _check_shapes(response_mask: torch.Tensor, **per_row: torch.Tensor) -> None:
    if not isinstance(response_mask, torch.Tensor) or response_mask.dim() != 2:
        raise TrajInputError(
            f"response_mask must be [B, R], got {type(response_mask).__name__} of shape "
            f"{tuple(getattr(response_mask, 'shape', ()))}. Fix: pass batch['response_mask'].", field="response_mask",
        )
    rows = response_mask.shape[0]
    for name, t in per_row.items():
        if not isinstance(t, torch.Tensor) or t.shape != (rows,):
            raise TrajInputError(
                f"{name} must have shape [{rows}] (one value per row), got {tuple(getattr(t, 'shape', ()))}. "
                f"Fix: pass the {name} that apply_plan wrote into the batch.", field=name,
            )


def _check_mode(mode: str) -> None:
    if not isinstance(mode, str) or mode not in LOSS_WEIGHT_FNS:
        raise TrajInputError(
            f"loss aggregation mode {mode!r} is not one of {list(LOSS_WEIGHT_FNS)}; set traj.loss_agg_mode "
            "(or actor/critic loss_agg_mode) to one of them.", field="loss_agg_mode",
        )


def compute_loss_weights(
    mode: str,
    response_mask: torch.Tensor,
    mini_batch_id: torch.Tensor,
    traj_index: torch.Tensor,
    is_padding: torch.Tensor,
    *,
    loss_scale_factor: Optional[float] = None,
) -> torch.Tensor:
    """Per-row weights ``w`` (float32 ``[B]``) such that ``sum(loss * response_mask * w[:, None])`` over a
    mini-batch is that mini-batch's loss under aggregation ``mode`` (formulas: module docstring). Counts each row's
    loss tokens ``l_i = response_mask[i].sum()`` and delegates to :func:`compute_loss_weights_from_counts`.

    Args:
        mode: a registered name (:func:`loss_weight_modes`).
        response_mask: ``[B, R]`` 0/1 (bool/int/float; 1 = loss token; any other value is refused).
        mini_batch_id: ``[B]`` int, dense ``0..M-1`` (the plan's ids).
        traj_index: ``[B]`` int, dense ``0..T-1`` on real rows (the plan's ``traj_index``).
        is_padding: ``[B]`` bool; padding rows get weight 0 and enter no statistic.
        loss_scale_factor: ``S`` of ``seq-mean-token-sum-norm`` (default: ``R``); a finite number > 0.
    Raises:
        TrajInputError: unknown mode, wrong shapes, a mask value other than 0/1, a NaN / inf / non-positive
            ``loss_scale_factor``, ids out of range (negative ``mini_batch_id``, ``traj_index`` below -1 or -1 on
            a real row, fractional ids), a weight function whose output is not ``[B]`` finite floats >= 0.
    """
    _check_mode(mode)
    _check_shapes(response_mask, mini_batch_id=mini_batch_id, traj_index=traj_index, is_padding=is_padding)
    check_binary_mask("response_mask", response_mask)
    scale = float(response_mask.shape[1]) if loss_scale_factor is None else loss_scale_factor
    return compute_loss_weights_from_counts(mode, (response_mask != 0).sum(-1), mini_batch_id, traj_index, is_padding,
                                            loss_scale_factor=scale)


def compute_loss_weights_from_counts(
    mode: str,
    loss_tokens: torch.Tensor,
    mini_batch_id: torch.Tensor,
    traj_index: torch.Tensor,
    is_padding: torch.Tensor,
    *,
    loss_scale_factor: float,
) -> torch.Tensor:
    """:func:`compute_loss_weights` from each row's loss-token count ``l_i`` instead of the ``[B, R]`` mask (what a
    driver that keeps only the counts passes; the weights are the same for the same counts).

    Args:
        mode: a registered name (:func:`loss_weight_modes`).
        loss_tokens: ``[B]`` int, ``l_i >= 0`` (the final ``response_mask``'s row sums).
        mini_batch_id / traj_index / is_padding: as for :func:`compute_loss_weights`.
        loss_scale_factor: ``S`` of ``seq-mean-token-sum-norm``, required (no mask, so no response width to default
            to); a finite number > 0.
    Raises:
        TrajInputError: as :func:`compute_loss_weights`; ``loss_tokens`` not ``[B]`` whole numbers >= 0.
    """
    _check_mode(mode)
    tokens = check_index("loss_tokens", loss_tokens, "pass each row's count of loss tokens (response_mask.sum(-1))")
    rows = tokens.shape[0]
    check_shape("is_padding", is_padding, (rows,), "pass the is_padding that apply_plan wrote into the batch")
    scale = check_positive_number(
        "loss_scale_factor", loss_scale_factor,
        "set loss_scale_factor (actor/critic config) to a positive constant, e.g. the response width "
        "data.max_response_length",
    )
    device = loss_tokens.device if isinstance(loss_tokens, torch.Tensor) else torch.device("cpu")
    fix = "pass the {} that apply_plan wrote into the batch"
    check_binary_mask("is_padding", is_padding, fix.format("is_padding"))
    real = (~is_padding.to(device=device, dtype=torch.bool)).to(torch.float64)
    mb = check_index("mini_batch_id", mini_batch_id, fix.format("dense 0..M-1 mini_batch_id"), rows=rows).to(device)
    traj_index = check_index("traj_index", traj_index, fix.format("dense 0..T-1 traj_index (-1 on padding rows)"),
                             rows=rows, low=-1).to(device)
    if bool(((traj_index < 0) & (real > 0)).any()):
        r = int(torch.nonzero((traj_index < 0) & (real > 0))[0, 0])
        raise TrajInputError.invalid(f"traj_index[{r}]", int(traj_index[r]), "is negative on a real row (is_padding "
                                     "False)", fix.format("traj_index and is_padding"))
    hi = int(mb.max()) if mb.numel() else -1
    traj = torch.where(real > 0, traj_index, torch.full_like(mb, -1))
    stats = RowStats(
        mini_batch=mb, traj=traj, real=real,
        loss_tokens=tokens.to(device=device, dtype=torch.float64) * real,
        num_mini_batches=hi + 1,
        num_trajectories=max(int(traj.max()) + 1 if traj.numel() else 0, 1),  # >= 1: padding rows gather slot 0
        scale=scale,
    )
    return (_checked_weights(mode, LOSS_WEIGHT_FNS[mode](stats), rows) * real).to(torch.float32)


def _checked_weights(mode: str, w: object, rows: int) -> torch.Tensor:
    """A weight function's output: a real ``[rows]`` tensor of finite values >= 0 (else a :class:`TrajInputError`)."""
    fix = f"the function registered as {mode!r} must return fn(RowStats) -> [B] float tensor of finite weights >= 0"
    check_shape("loss_agg_mode", w, (rows,), fix)
    if not w.is_floating_point():
        raise TrajInputError.invalid("loss_agg_mode", w, f"(mode {mode!r}) returned dtype {w.dtype}", fix)
    check_finite("loss_agg_mode", w, fix)
    if w.numel() and float(w.min()) < 0:
        raise TrajInputError.invalid("loss_agg_mode", w, f"(mode {mode!r}) returned a negative weight", fix)
    return w
