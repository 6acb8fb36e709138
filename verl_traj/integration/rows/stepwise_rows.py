"""Step-wise rows inside verl's trainers: expansion before planning (v0), advantages after (v0 and v1).

* :func:`expand_dataproto_step_rows`: called by ``TrajRayPPOTrainer._balance_batch`` before planning;
  replaces the batch, in place, by one row per LLM call (or prefix-merged rows), reward on the last
  step row only (:func:`verl_traj.stepwise.expand.expand_step_rows`).
* :func:`stepwise_advantage`: wraps verl's ``compute_advantage`` (installed by
  :func:`verl_traj.integration.patches.scoped.fit_patches`; v1's ``planned_advantage`` calls it too). On a planned
  step-wise batch an outcome estimator runs once per trajectory -- the plan's ``traj_index`` names them -- and each
  row gets its trajectory's scalar on its own ``response_mask``; a temporal one (GAE, REINFORCE++) runs on each
  trajectory's timeline of rows (:mod:`verl_traj.stepwise.timeline`); any other batch goes to verl's function
  unchanged.
* :func:`trajectory_scoped_correction`: wraps verl's ``compute_rollout_correction_and_add_to_batch`` (v0:
  ``fit_patches``; v1: ``TrajV1Mixin._compute_advantage``) for ``traj.ratio_scope=trajectory``: verl's
  sequence-level rollout correction over each trajectory's timeline (:mod:`verl_traj.stepwise.ratios`).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Optional

import numpy as np
import torch
from tensordict import TensorDict
from verl.trainer.ppo import core_algos

from verl_traj.core.errors import check_finite
from verl_traj.core.plan.estimators import estimator_traits
from verl_traj.core.keys import IS_LAST_STEP, TRAJ_INDEX, TURN_REWARDS
from verl_traj.integration.rows.branching import has_trees, outcome_on_trees, refuse_trajectory_ratios
from verl_traj.integration.rows.credit import credit_advantage
from verl_traj.stepwise.advantages import (StepwiseAdvantageError, check_stepwise_estimator,
                                           compute_trajectory_advantages)
from verl_traj.stepwise.expand import DEFAULT_STEPS_KEY, expand_step_rows
from verl_traj.stepwise.inputs import checked_flags, checked_traj_index
from verl_traj.stepwise.ratios import trajectory_ratio_metrics, trajectory_rollout_correction
from verl_traj.stepwise.credit_rules import credit_rule
from verl_traj.stepwise.step_groups import StepGroupOptions
from verl_traj.stepwise.timeline import Timeline, timeline_advantages

__all__ = ["batch_timeline", "expand_dataproto_step_rows", "is_stepwise_batch", "row_steps", "stepwise_advantage",
           "trajectory_scoped_correction"]


def is_stepwise_batch(data: Any) -> bool:
    """A planned batch of step rows: it carries the plan's ``traj_index`` and the expansion's ``is_last_step``."""
    td = getattr(data, "batch", None)
    return td is not None and TRAJ_INDEX in td.keys() and IS_LAST_STEP in data.non_tensor_batch


def expand_dataproto_step_rows(
    data: Any,
    *,
    merge_prefix: bool = False,
    pad_token_id: int = 0,
    steps_key: str = DEFAULT_STEPS_KEY,
    traj_id_key: str = "traj_id",
    step_index_key: str = "step_index",
    drop_keys: tuple[str, ...] = (),
    step_anchors: bool = False,
    branch_paths: bool = False,
) -> dict[str, float]:
    """Replace ``data`` (a verl ``DataProto``, one row per trajectory) IN PLACE by its step rows.

    Returns the expansion's metrics (``traj_stepwise/rows_before``, ``rows_after``, ``tokens_before``, ...).
    A batch that is already expanded (has ``step_index_key`` and ``is_last_step``) is left unchanged.
    """
    if step_index_key in data.non_tensor_batch and IS_LAST_STEP in data.non_tensor_batch:
        return {}
    out = expand_step_rows(
        {k: data.batch[k] for k in data.batch.keys()}, dict(data.non_tensor_batch), steps_key=steps_key,
        merge_prefix=merge_prefix, pad_token_id=pad_token_id, traj_id_key=traj_id_key,
        step_index_key=step_index_key, drop_keys=drop_keys, step_anchors=step_anchors, branch_paths=branch_paths,
    )
    device = data.batch.device if hasattr(data.batch, "device") else None
    data.batch = TensorDict(dict(out.tensors), batch_size=[int(out.source_row.numel())], device=device)
    data.non_tensor_batch = out.non_tensors
    metrics = out.metrics()
    if TURN_REWARDS in out.tensors:  # what the agent loop gave as turn rewards this step
        metrics["traj_stepwise/turn_reward_sum"] = float(out.tensors[TURN_REWARDS].sum())
        metrics["traj_stepwise/turn_rewards_nonzero"] = float((out.tensors[TURN_REWARDS] != 0).sum())
    return metrics


def _estimator(name: str, norm_adv_by_std_in_grpo: bool, config: Any) -> tuple[Callable, dict]:
    """verl's registered estimator and the keyword arguments it accepts among ours."""
    check_stepwise_estimator(name, allow_custom=True)
    fn = core_algos.get_adv_estimator_fn(name)
    params = inspect.signature(fn).parameters
    var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    extra = {"norm_adv_by_std_in_grpo": norm_adv_by_std_in_grpo, "config": config}
    return fn, {k: v for k, v in extra.items() if k in params or (var_kw and k == "config")}


def _with_turn_rewards(data: Any, on_last_row: bool = False) -> Any:
    """``token_level_rewards`` ``[B, R]`` plus the step rows' turn rewards (:data:`~verl_traj.core.keys.TURN_REWARDS`,
    each on its call's last response token), or the rewards alone when the batch has none. ``on_last_row``: for an
    outcome estimator that reads each trajectory's last row, the trajectory's turn-reward total is added there
    instead (so the trajectory's score is its outcome plus every turn reward, each counted once)."""
    td = data.batch
    rewards = _column(td, "token_level_rewards", "the reward step (verl's compute_reward) writes it")
    if TURN_REWARDS not in td.keys():
        return rewards
    turn = td[TURN_REWARDS]
    if tuple(turn.shape) != tuple(rewards.shape):
        raise StepwiseAdvantageError.invalid(TURN_REWARDS, turn, f"has shape {tuple(turn.shape)}, token_level_rewards "
                                             f"{tuple(rewards.shape)}", "keep turn_rewards as the expansion wrote them")
    traj = checked_traj_index(td[TRAJ_INDEX], rewards.shape[0]).to(rewards.device)
    real = traj >= 0
    check_finite(TURN_REWARDS, turn[real], "make the agent loop's step_rewards (each LLM call's turn reward, carried "
                 "as the rows' turn_rewards) return finite numbers", error=StepwiseAdvantageError)
    turn = turn.to(rewards)
    if not on_last_row:
        return rewards + turn
    total = rewards.new_zeros(int(traj.max()) + 1 if real.any() else 1).index_add_(0, traj[real], turn.sum(-1)[real])
    last = checked_flags(IS_LAST_STEP, data.non_tensor_batch[IS_LAST_STEP], rewards.shape[0]).to(rewards.device) & real
    extra = torch.zeros_like(rewards)
    extra[last, 0] = total[traj[last]]
    return rewards + extra


def row_steps(data: Any, step_index_key: str) -> np.ndarray:
    """``[B]`` each row's step, from ``non_tensor_batch[step_index_key]`` (a missing or non-numeric column refused)."""
    nt = data.non_tensor_batch
    if step_index_key not in nt:
        raise StepwiseAdvantageError(
            f"non_tensor_batch[{step_index_key!r}] is missing: a trajectory's timeline of step rows needs each row's "
            "step (the step-wise expansion writes it under traj.step_index_key). Keep the field through the batch.",
            field=step_index_key)
    steps = np.asarray(nt[step_index_key])
    if steps.dtype == object:  # a column that went through object arrays: numbers are read, anything else refused
        try:
            steps = steps.astype(np.float64)
        except (TypeError, ValueError) as exc:
            raise StepwiseAdvantageError.invalid(step_index_key, steps, f"holds non-numbers ({exc})",
                                                 "keep each row's int step as the expansion wrote it") from exc
    return steps


def batch_timeline(data: Any, step_index_key: str) -> Any:
    """The :class:`~verl_traj.stepwise.timeline.Timeline` of a planned step-wise batch: ``traj_index`` from the
    plan, each row's step (:func:`row_steps`), the current ``response_mask``."""

    return Timeline.build(data.batch[TRAJ_INDEX], row_steps(data, step_index_key),
                          _column(data.batch, "response_mask", "verl's compute_response_mask writes it"))


def _column(td: Any, key: str, where: str) -> torch.Tensor:
    """``td[key]``, or a :class:`StepwiseAdvantageError` naming the missing field."""
    if key not in td.keys():
        raise StepwiseAdvantageError(f"batch[{key!r}] is missing on a step-row batch. Fix: {where}; keep it through "
                                     "the batch.", field=key)
    return td[key]


def _timeline_advantage(data: Any, fn: Callable, extra: dict, gamma: float, lam: float,
                        step_index_key: str) -> tuple[Any, Any]:
    """A temporal estimator on each trajectory's timeline (:mod:`verl_traj.stepwise.timeline`): its rows in step
    order, values and rewards per token as the rows hold them; ``index`` (group baselines) per trajectory."""

    td, nt = data.batch, data.non_tensor_batch
    timeline = batch_timeline(data, step_index_key)
    params = inspect.signature(fn).parameters
    kwargs = dict(extra, **{k: v for k, v in (("gamma", gamma), ("lam", lam)) if k in params})
    index = None
    if "index" in params:
        index = np.asarray(_uid(nt, td.batch_size[0]), dtype=object)[timeline.first_row.numpy()]
    values = _column(td, "values", "the critic's value pass writes it (GAE needs a critic)") if "values" in params \
        else None
    real = td[TRAJ_INDEX] >= 0
    rewards = _with_turn_rewards(data)
    for name, tensor in (("token_level_rewards", rewards), ("values", values)):
        if tensor is not None:  # one reduction each: a NaN would spread through every earlier turn of its trajectory
            check_finite(name, tensor[real], f"make the {'reward function' if name != 'values' else 'critic'} "
                         "return finite numbers for every row", error=StepwiseAdvantageError)
    return timeline_advantages(fn, timeline, rewards, td["response_mask"], values=values,
                               index=index, estimator_kwargs=kwargs)


def _uid(nt: Any, rows: int) -> np.ndarray:
    """``non_tensor_batch["uid"]``: one GRPO group id per row (a missing or misshapen column refused)."""
    if "uid" not in nt:
        raise StepwiseAdvantageError("non_tensor_batch['uid'] is missing. Fix: verl's fit() assigns one uid per "
                                     "prompt; keep it through the batch.", field="uid")
    uid = np.asarray(nt["uid"], dtype=object)
    if uid.shape != (rows,):
        raise StepwiseAdvantageError.invalid("uid", uid, f"has shape {uid.shape}, expected [{rows}]",
                                             "keep one uid per row")
    return uid


def stepwise_advantage(verl_compute_advantage: Callable, step_index_key: str = "step_index",
                       step_groups: Optional[StepGroupOptions] = None) -> Callable:
    """Wrap verl's ``compute_advantage(data, adv_estimator, gamma, lam, num_repeat,
    norm_adv_by_std_in_grpo, config)`` (same signature) for step-wise rows.

    Outcome estimators run once per trajectory and are broadcast onto its rows (``reward_reduction``: ``"sum"`` when
    ``config.use_kl_in_reward``, KL penalties sitting on every step row, else ``"last_step"``). Temporal estimators
    (``gae``, REINFORCE++) run on each trajectory's timeline: credit across its rows (``step_index_key``: the
    non-tensor field holding each row's step). A per-call credit rule (``gigpo`` or any
    registered one, :mod:`verl_traj.integration.rows.credit`) gives each call its own advantage (``step_groups``: the
    ``traj:`` knobs)."""

    @functools.wraps(verl_compute_advantage)
    def compute_advantage(data: Any, adv_estimator: Any, gamma: float = 1.0, lam: float = 1.0, num_repeat: int = 1,
                          norm_adv_by_std_in_grpo: bool = True, config: Optional[Any] = None) -> Any:
        if not is_stepwise_batch(data):
            return verl_compute_advantage(data, adv_estimator, gamma=gamma, lam=lam, num_repeat=num_repeat,
                                          norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo, config=config)
        name = str(getattr(adv_estimator, "value", adv_estimator))
        td = data.batch
        rule = credit_rule(name)
        if rule is not None:  # per LLM call (gigpo: from the rows' anchor keys)
            credit_advantage(data, rule, _with_turn_rewards(data), row_steps(data, step_index_key),
                             _uid(data.non_tensor_batch, td.batch_size[0]), gamma=gamma,
                             episode=_estimator("grpo", norm_adv_by_std_in_grpo, config), options=step_groups)
            return data
        fn, extra = _estimator(name, norm_adv_by_std_in_grpo, config)
        use_kl = bool(config.get("use_kl_in_reward", False)) if config is not None and hasattr(config, "get") else False
        if has_trees(td):  # sessions that branch: the estimator over each prompt's leaves (issue 56)
            if step_groups is None:
                raise RuntimeError("stepwise_advantage on a batch with branching sessions needs the traj: section's "
                                   "StepGroupOptions (traj.branch_weighting; the caller did not pass them)")
            refuse_trajectory_ratios(step_groups.ratio_scope)
            outcome_on_trees(data, name, fn, extra, _column(td, "token_level_rewards", "the reward step writes it"),
                             _uid(data.non_tensor_batch, td.batch_size[0]), use_kl_in_reward=use_kl,
                             weighting=step_groups.branch_weighting)
            return data
        if estimator_traits(name).temporal:
            td["advantages"], td["returns"] = _timeline_advantage(data, fn, extra, gamma, lam, step_index_key)
            return data
        adv, ret, _ = compute_trajectory_advantages(
            _with_turn_rewards(data, on_last_row=not use_kl), _column(td, "response_mask", "verl's "
                                                                      "compute_response_mask writes it"),
            td[TRAJ_INDEX], data.non_tensor_batch[IS_LAST_STEP],
            _uid(data.non_tensor_batch, td.batch_size[0]), estimator_fn=fn, estimator_name=name,
            reward_reduction="sum" if use_kl else "last_step",
            reward_baselines=td["reward_baselines"] if "reward_baselines" in td.keys() else None,
            estimator_kwargs=extra, allow_custom=True,
        )
        td["advantages"], td["returns"] = adv, ret
        return data

    return compute_advantage


def trajectory_scoped_correction(verl_add_to_batch: Callable, step_index_key: str = "step_index") -> Callable:
    """Wrap verl's ``compute_rollout_correction_and_add_to_batch(batch, rollout_corr_config) -> (batch, metrics)``
    (same signature): on a planned step-wise batch verl's IS weights, rejection and diagnostics are computed per
    trajectory (:func:`~verl_traj.stepwise.ratios.trajectory_rollout_correction`) and logged as ``traj_ratio/*``;
    padding rows keep their mask and get weight 0; any other batch goes to verl's function."""

    @functools.wraps(verl_add_to_batch)
    def compute(batch: Any, rollout_corr_config: Any) -> tuple[Any, dict]:
        if not is_stepwise_batch(batch):
            return verl_add_to_batch(batch, rollout_corr_config)
        def on_timelines(old_t: torch.Tensor, rollout_t: torch.Tensor, mask_t: torch.Tensor) -> tuple:
            """verl's own entry (its config reading and defaults) on the ``[T, L]`` timelines as a batch."""
            proto = type(batch).from_dict(tensors={"old_log_probs": old_t, "rollout_log_probs": rollout_t,
                                                   "response_mask": mask_t})
            proto, metrics = verl_add_to_batch(proto, rollout_corr_config)
            weights = proto if "rollout_is_weights" in proto.batch.keys() else None
            return weights, proto.batch["response_mask"], metrics

        td = batch.batch
        old = _column(td, "old_log_probs", "the actor's log-prob pass writes it")
        rollout = _column(td, "rollout_log_probs", "set actor_rollout_ref.rollout.calculate_log_probs=true for rollout "
                                                   "correction")
        mask = _column(td, "response_mask", "verl's compute_response_mask writes it")
        corr = trajectory_rollout_correction(on_timelines, batch_timeline(batch, step_index_key), old, rollout, mask)
        real = (td[TRAJ_INDEX] >= 0)[:, None]
        td["response_mask"] = torch.where(real, corr.response_mask, mask)
        if corr.weights is not None:
            td["rollout_is_weights"] = corr.weights
        row_sum = torch.where(mask != 0, old - rollout, 0.0).sum(-1)
        return batch, {**corr.metrics, **trajectory_ratio_metrics(corr, row_sum, td[TRAJ_INDEX])}

    return compute
