"""verl_traj's actor and critic loss functions: verl's losses aggregated as weighted token sums.

The trainer attaches a per-row ``loss_weight`` (``verl_traj.core.compute_loss_weights``: the
mini-batch-global normaliser of the chosen loss mode, 0 for padding rows). Every loss term is then

    agg_loss(loss_mat, response_mask * loss_weight[:, None], "token-sum", dp_size=dp_size)
    = dp_size * sum_{local rows, tokens} loss * mask * w

The FSDP engine sums micro-batch losses by ``backward`` and averages gradients over DP ranks, so the
applied gradient is ``sum over the whole mini-batch of loss * mask * w``: independent of the DP
layout and the micro-batch cut, and padding rows contribute nothing.

Only verl's functions compute the losses (``get_policy_loss_fn``, ``agg_loss``, ``kl_penalty``,
``compute_value_loss``). For the policy loss the weight enters through the loss fn's
``rollout_is_weights`` argument (multiplied into the per-token loss before ``agg_loss``) and the loss
fn gets the boolean ``response_mask``, so its metrics (clip fractions, ppo_kl) stay unweighted token
means, as in verl. Loss fns that use ``rollout_is_weights`` differently or aggregate with a
hard-coded mode are refused at start-up (``verl_traj.integration.startup.verl_checks.SUPPORTED_POLICY_LOSS_MODES``).

Both require ``loss_weight`` (:func:`require_loss_weight`): they are installed only on verl_traj's workers, which run
planned updates only; a micro-batch without it raises, naming the field (it never falls back to verl's loss).

No device-to-host sync beyond verl's own loss: what verl_traj adds (``*/loss_weight_mass``, GSPO's trajectory-ratio
shift and its non-finite check) goes to the update's :class:`~verl_traj.integration.workers.planned_update.LossSink`,
read once when the update ends, and GSPO's in-loss trajectory ratio is computed without a host read
(:func:`~verl_traj.stepwise.ratios.micro_batch_ratio_shift`).
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch
from tensordict import TensorDict

from verl.trainer.ppo.core_algos import agg_loss, compute_value_loss, get_policy_loss_fn, kl_penalty
from verl.utils.metric import AggregationType, Metric
from verl.utils import tensordict_utils as tu
from verl.utils.torch_functional import masked_mean
from verl.workers.utils.padding import no_padding_2_padding

from verl_traj.core.errors import TrajInputError
from verl_traj.core.keys import ADVANTAGES_NEGATIVE, LOSS_WEIGHT, PATH_COPIES, RATIO_GROUP, RATIO_IN_LOSS, SEQ_RATIO_SHIFT
from verl_traj.integration.workers.planned_update import LOSS_SINK, LossSink, record, record_nonfinite
from verl_traj.stepwise.ratios import micro_batch_ratio_shift, nonfinite_rows


# policy losses with loss(r, A) = |A| loss(r, sign A) (verl 0.9.1's vanilla, dual-clip included, and gpg's -A log p):
# a branching call's two-part loss equals its root-to-leaf paths' (tests/stepwise/test_tree_credit.py)
TWO_PART_LOSS_MODES = ("vanilla", "gpg")


def _set_global_batch_info(config: Any, dp_size: int) -> None:
    # token-sum needs only dp_size; the other keys must not leak a stale value into agg_loss.
    info = config.global_batch_info
    info["dp_size"] = dp_size
    info["batch_num_tokens"] = None
    info["global_batch_size"] = None
    info["loss_scale_factor"] = None


def weighted_policy_loss(
    config: Any,
    *,
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_weight: torch.Tensor,
    dp_size: int,
    entropy: Optional[torch.Tensor] = None,
    ref_log_prob: Optional[torch.Tensor] = None,
    rollout_is_weights: Optional[torch.Tensor] = None,
    seq_ratio_shift: Optional[torch.Tensor] = None,
    sink: Optional[LossSink] = None,
    negative: Optional[torch.Tensor] = None,
    copies: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """Policy (+ entropy + KL) loss of one micro-batch on padded ``[b, R]`` tensors (see module doc).
    ``negative`` ``[b, R]``: the part of ``advantages`` a branching session's call with leaves of both signs trains
    with on its own (:data:`~verl_traj.core.keys.ADVANTAGES_NEGATIVE`): the policy term is then
    ``loss(r, advantages - negative) + loss(r, negative)``, its root-to-leaf paths under PPO's clipping
    (docs/branching.md); 0 where a call's leaves share a sign (``loss(r, 0) = 0``). ``copies`` ``[b, R]``
    (``traj.branch_weighting=expanded``, :data:`~verl_traj.core.keys.PATH_COPIES`): each token weighted by its
    root-to-leaf paths in every term (the trainer's ``loss_weight`` counted them too).
    ``seq_ratio_shift`` ``[b]``: GSPO at trajectory scope, each row's old log-probs shifted by a constant so that the
    loss fn's per-row mean log-ratio is its trajectory's (:func:`~verl_traj.stepwise.ratios.sequence_ratio_shift`).
    ``sink``: where verl_traj's own metrics go (read once per update); None: verl's ``Metric`` now."""
    _set_global_batch_info(config, dp_size)
    if seq_ratio_shift is not None:
        old_log_prob = old_log_prob + seq_ratio_shift.to(device=old_log_prob.device, dtype=old_log_prob.dtype)[:, None]
    mask = response_mask.to(torch.bool)
    w_row = loss_weight.to(torch.float32)[:, None]  # [b, 1]: fp32 whatever the log-probs' dtype (bf16 rounds 1/3)
    token_weights = w_row.expand(log_prob.shape)
    if copies is not None:
        w_row = w_row * copies.to(torch.float32)  # [b, R] from here: each token's paths
        token_weights = w_row
    if rollout_is_weights is not None:
        token_weights = token_weights * rollout_is_weights.to(torch.float32)
    loss_mode = config.policy_loss.get("loss_mode", "vanilla") if config.policy_loss is not None else "vanilla"
    policy_loss = functools.partial(get_policy_loss_fn(loss_mode), old_log_prob=old_log_prob, log_prob=log_prob,
                                    response_mask=mask, loss_agg_mode="token-sum", config=config,
                                    rollout_is_weights=token_weights)
    pg_loss, pg_metrics, split = _policy_term(policy_loss, loss_mode, advantages, negative, mask)
    metrics: dict[str, Any] = dict(Metric.from_dict(pg_metrics, aggregation=AggregationType.MEAN))
    # each micro-batch holds a partial sum of the mini-batch loss: SUM over micro-batches, mean over DP
    # (= sum over ranks / dp, and every rank's partial sum carries the * dp_size factor).
    metrics["actor/pg_loss"] = Metric(value=pg_loss, aggregation=AggregationType.SUM)
    if split is not None:  # over the mini-batch (x dp: verl averages metrics over ranks)
        record(metrics, sink, "sum", "actor/tree_split_tokens", split * dp_size)
    if seq_ratio_shift is not None:  # how far each row's own sequence ratio was from its trajectory's
        record(metrics, sink, "max", "actor/traj_seq_ratio_shift_abs_max", seq_ratio_shift.detach().abs().max())
    weighted_mask = mask.to(torch.float32) * w_row  # [b, R] fp32
    # sum of weight x tokens over the mini-batch (x dp: verl averages metrics over ranks): 1 for the token-mean,
    # seq-mean-token-mean and traj-mean modes; shows the trainer's weights reached this loss
    record(metrics, sink, "sum", "actor/loss_weight_mass", weighted_mask.sum() * dp_size)
    extra, extra_metrics = _entropy_and_kl(config, log_prob, weighted_mask, dp_size, entropy, ref_log_prob)
    metrics.update(extra_metrics)
    return pg_loss + extra, metrics


def _policy_term(policy_loss: Any, loss_mode: str, advantages: torch.Tensor, negative: Optional[torch.Tensor],
                 mask: torch.Tensor) -> tuple[torch.Tensor, dict, Optional[torch.Tensor]]:
    """verl's policy loss on ``advantages``; with a two-sign part, ``loss(A - neg) + loss(neg)`` (the metrics, clip
    fractions and ppo_kl, are the first evaluation's: every token, its positive part) and the count of tokens trained
    with both parts."""
    if negative is None:
        return (*policy_loss(advantages=advantages), None)
    if loss_mode not in TWO_PART_LOSS_MODES:
        raise TrajInputError(
            f"actor_rollout_ref.actor.policy_loss.loss_mode={loss_mode!r} on a batch whose branching sessions have "
            "calls with leaves of both signs: their two-part loss is exact only for a loss positively homogeneous in "
            f"the advantage ({list(TWO_PART_LOSS_MODES)}). Fix: set loss_mode=vanilla, or an estimator whose leaves of "
            "one session share a sign (grpo with the session's outcome on every leaf).",
            field="actor_rollout_ref.actor.policy_loss.loss_mode")
    negative = negative.to(advantages.dtype)
    pg_loss, pg_metrics = policy_loss(advantages=advantages - negative)
    pg_loss = pg_loss + policy_loss(advantages=negative)[0]
    return pg_loss, pg_metrics, ((negative != 0) & mask).sum()


def _entropy_and_kl(config: Any, log_prob: torch.Tensor, weighted_mask: torch.Tensor, dp_size: int,
                    entropy: Optional[torch.Tensor], ref_log_prob: Optional[torch.Tensor]):
    """``- entropy_coeff * entropy + kl_loss_coef * kl`` as weighted token sums, and their metrics."""
    total = torch.zeros((), dtype=torch.float32, device=log_prob.device)
    metrics: dict[str, Any] = {}
    if entropy is not None:
        entropy_loss = agg_loss(loss_mat=entropy, loss_mask=weighted_mask, loss_agg_mode="token-sum", dp_size=dp_size)
        total = total - config.entropy_coeff * entropy_loss
        metrics["actor/entropy_loss"] = Metric(value=entropy_loss, aggregation=AggregationType.SUM)
    if config.use_kl_loss:
        if ref_log_prob is None:
            raise KeyError("actor.use_kl_loss=true but the batch has no 'ref_log_prob'")
        kld = kl_penalty(logprob=log_prob, ref_logprob=ref_log_prob, kl_penalty=config.kl_loss_type)
        kl_loss = agg_loss(loss_mat=kld, loss_mask=weighted_mask, loss_agg_mode="token-sum", dp_size=dp_size)
        total = total + kl_loss * config.kl_loss_coef
        metrics["kl_loss"] = Metric(value=kl_loss, aggregation=AggregationType.SUM)
        metrics["kl_coef"] = config.kl_loss_coef
    return total, metrics


def weighted_value_loss(
    config: Any,
    *,
    vpreds: torch.Tensor,
    values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    loss_weight: torch.Tensor,
    dp_size: int,
    sink: Optional[LossSink] = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """Clipped value loss of one micro-batch on padded [b, R] tensors (see module doc); ``sink`` as for
    :func:`weighted_policy_loss`."""
    mask = response_mask.to(torch.bool)
    weighted_mask = mask.to(torch.float32) * loss_weight.to(torch.float32)[:, None]  # fp32 (bf16 rounds weights)
    vf_loss, _ = compute_value_loss(
        vpreds=vpreds,
        values=values,
        returns=returns,
        response_mask=weighted_mask,
        cliprange_value=config.cliprange_value,
        loss_agg_mode="token-sum",
        dp_size=dp_size,
    )
    with torch.no_grad():  # clip fraction over the boolean mask, as verl reports it
        _, vf_clipfrac = compute_value_loss(
            vpreds=vpreds.detach(), values=values, returns=returns, response_mask=mask,
            cliprange_value=config.cliprange_value, loss_agg_mode="token-sum", dp_size=dp_size,
        )
    metrics = {  # verl's value_loss reads the same three now
        "critic/vf_loss": Metric(value=vf_loss, aggregation=AggregationType.SUM),
        "critic/vf_clipfrac": vf_clipfrac.detach().item(),
        "critic/vpred_mean": masked_mean(vpreds, mask).detach().item(),
    }
    record(metrics, sink, "sum", "critic/loss_weight_mass", weighted_mask.sum() * dp_size)
    return vf_loss, metrics


def require_loss_weight(data: TensorDict, loss: str) -> None:
    """Raise :class:`TrajInputError` naming ``loss_weight`` when a micro-batch reached ``loss`` without it."""
    if LOSS_WEIGHT not in data.keys():
        raise TrajInputError(
            f"{loss} received a micro-batch without {LOSS_WEIGHT!r} (fields: {sorted(data.keys())}): verl_traj's loss "
            "aggregates with the trainer's per-row weights and never falls back to verl's. Fix: train through "
            "verl_traj's trainer with traj.enable=true (it writes the weights and names them in the update), or "
            "use verl's own loss for traj.enable=false.", field=LOSS_WEIGHT)


def traj_ppo_loss(config: Any, model_output, data: TensorDict, dp_group=None):
    """Drop-in for ``verl.workers.utils.losses.ppo_loss`` (same signature, engine no-padding format)."""
    require_loss_weight(data, "traj_ppo_loss")
    log_prob = no_padding_2_padding(model_output["log_probs"], data)
    entropy = model_output.get("entropy", None)
    if entropy is not None:
        entropy = no_padding_2_padding(entropy, data)
    dp_size = int(data["dp_size"])
    fields = ["response_mask", "old_log_probs", "advantages", LOSS_WEIGHT]
    for optional in ("rollout_is_weights", "ref_log_prob", SEQ_RATIO_SHIFT, ADVANTAGES_NEGATIVE, PATH_COPIES):
        if optional in data.keys():
            fields.append(optional)
    in_loss = bool(tu.get_non_tensor_data(data=data, key=RATIO_IN_LOSS, default=False))
    if in_loss:
        fields.append(RATIO_GROUP)
    padded = data.select(*fields).to_padded_tensor()
    sink = tu.get_non_tensor_data(data=data, key=LOSS_SINK, default=None)
    shift = padded.get(SEQ_RATIO_SHIFT, None)
    if in_loss and shift is None:  # every trajectory's rows in this micro-batch: the pre-pass's value, no pre-pass
        old, mask, group = padded["old_log_probs"], padded["response_mask"], padded[RATIO_GROUP]
        shift = micro_batch_ratio_shift(log_prob, old, mask, group)
        for name, values in (("old_log_probs", old), ("log_probs", log_prob.detach())):
            record_nonfinite(sink, name, nonfinite_rows(values, mask, group))
    return weighted_policy_loss(
        config, log_prob=log_prob, old_log_prob=padded["old_log_probs"], advantages=padded["advantages"],
        response_mask=padded["response_mask"], loss_weight=padded[LOSS_WEIGHT], dp_size=dp_size, entropy=entropy,
        ref_log_prob=padded.get("ref_log_prob", None), rollout_is_weights=padded.get("rollout_is_weights", None),
        seq_ratio_shift=shift, sink=sink, negative=padded.get(ADVANTAGES_NEGATIVE, None),
        copies=padded.get(PATH_COPIES, None),
    )


def traj_value_loss(config: Any, model_output, data: TensorDict, dp_group=None):
    """Drop-in for ``verl.workers.utils.losses.value_loss`` (same signature)."""
    require_loss_weight(data, "traj_value_loss")
    vpreds = no_padding_2_padding(model_output["values"], data)
    dp_size = int(data["dp_size"])
    padded = data.select("values", "returns", "response_mask", LOSS_WEIGHT).to_padded_tensor()
    return weighted_value_loss(config, vpreds=vpreds, values=padded["values"], returns=padded["returns"],
                               response_mask=padded["response_mask"], loss_weight=padded[LOSS_WEIGHT], dp_size=dp_size,
                               sink=tu.get_non_tensor_data(data=data, key=LOSS_SINK, default=None))


__all__ = [
    "TWO_PART_LOSS_MODES",
    "require_loss_weight",
    "traj_ppo_loss",
    "traj_value_loss",
    "weighted_policy_loss",
    "weighted_value_loss",
]

