"""verl_traj's trainer: verl's ``RayPPOTrainer`` (v0) with trajectory-aware batching.

With ``traj.enable=true``:

* ``_balance_batch`` (runs every step: ``trainer.balance_batch`` is forced on at start-up) builds a
  :class:`~verl_traj.core.BatchLayout`, plans exactly ``data.train_batch_size //
  actor.ppo_mini_batch_size`` mini-batches of whole units (trajectories or GRPO groups), balanced over
  DP ranks, padded to equal rows per rank, and applies the plan IN PLACE on the DataProto
  (``batch.batch`` / ``batch.non_tensor_batch`` replaced; rows carry ``mini_batch_id`` and
  ``is_padding``). The planner's statistics are logged as ``traj_plan/*``.
* ``_update_actor`` / ``_update_critic`` attach the per-row ``loss_weight``
  (:func:`~verl_traj.core.compute_loss_weights`, mode ``traj.loss_agg_mode`` /
  ``traj.critic_loss_agg_mode`` or the actor's / critic's ``loss_agg_mode``) for the duration of the
  call; the workers (``verl_traj.integration.workers``) step once per mini-batch and the losses
  (``verl_traj.integration.losses``) aggregate with these weights.
* During ``fit`` only, and only in this process, the module globals of ``ray_trainer`` that compute
  advantages and metrics from the whole batch (``compute_advantage``, ``apply_kl_penalty``,
  ``compute_data_metrics``, ``compute_timing_metrics``, ``compute_throughout_metrics``,
  ``compute_variance_proxy_metrics``) are wrapped to see real rows only; they are restored when
  ``fit`` returns or raises.
* ``traj.micro_batch_max_tokens`` switches verl's dynamic micro-batching on for actor, critic,
  reference and log-prob passes with that hard cap (``max_token_len_per_gpu``; verl's
  ``rearrange_micro_batches`` raises the micro-batch count until every micro-batch fits). Without a
  cap, passes configured with fixed micro-batch sizes are switched to dynamic micro-batching with the
  same memory bound (``micro_batch_size_per_gpu * (max_prompt_length + max_response_length)``):
  planned mini-batches have variable rows per rank, which fixed sizes cannot divide, and the
  gradient does not depend on the micro-batch cut.
* Start-up checks (``prepare_config``): ``traj:`` vs verl (``validate_against_verl``), a policy loss
  that takes per-row weights, no distillation / prefix grouper, ``train_batch_size`` a multiple of
  ``ppo_mini_batch_size``; ``trainer.balance_batch`` is forced on (warning) because the planner runs
  in ``_balance_batch``. Actor and critic must have the same DP size.
* Debug: ``VERL_TRAJ_DEBUG_DUMP=<dir>`` appends one JSON line per step to ``<dir>/plan.jsonl`` with
  every row's uid, traj_id, mini_batch_id, is_padding and lengths (used by the e2e tests).

With ``traj.enable=false`` every method is verl's (``super()``).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import warnings
from typing import Any, Iterator, Optional

import numpy as np
import torch
from omegaconf import open_dict
from tensordict import TensorDict

from verl import DataProto
from verl.trainer.ppo import ray_trainer as _rt
from verl.trainer.ppo.ray_trainer import RayPPOTrainer

from verl_traj.config import TrajConfig, TrajConfigError, validate_against_verl

logger = logging.getLogger(__name__)

DEBUG_DUMP_ENV = "VERL_TRAJ_DEBUG_DUMP"  # a directory: one JSON line per step with the plan per row
LOSS_WEIGHT_KEY = "loss_weight"


# --------------------------------------------------------------------------------------------------
# config preparation (driver side, before workers are built)
# --------------------------------------------------------------------------------------------------


def apply_token_cap(config: Any, cap: int) -> None:
    """Drive verl's dynamic micro-batching with ``cap`` tokens per micro-batch per GPU everywhere
    (actor update, actor/ref log-prob, critic update and values)."""
    arr = config.actor_rollout_ref
    with open_dict(config):
        arr.actor.use_dynamic_bsz = True
        arr.actor.ppo_max_token_len_per_gpu = cap
        if "ppo_infer_max_token_len_per_gpu" in arr.actor:
            arr.actor.ppo_infer_max_token_len_per_gpu = cap
        arr.rollout.log_prob_use_dynamic_bsz = True
        arr.rollout.log_prob_max_token_len_per_gpu = cap
        if "ref" in arr and arr.ref is not None:
            arr.ref.log_prob_use_dynamic_bsz = True
            arr.ref.log_prob_max_token_len_per_gpu = cap
        critic = config.get("critic", None)
        if critic is not None:
            critic.use_dynamic_bsz = True
            critic.ppo_max_token_len_per_gpu = cap
            for key in ("forward_max_token_len_per_gpu", "ppo_infer_max_token_len_per_gpu"):
                if key in critic:
                    critic[key] = cap


def _max_row_tokens(config: Any) -> int:
    data = config.data
    return int(data.get("max_prompt_length", 0) or 0) + int(data.get("max_response_length", 0) or 0)


def fixed_to_dynamic_micro_batches(config: Any) -> list[str]:
    """Planned mini-batches have variable row counts per rank, which verl's fixed micro-batch sizes
    (``*_micro_batch_size_per_gpu``: the rows per rank must divide by it) cannot take. Micro-batching
    does not change verl_traj's gradient (global loss weights), so each pass still on fixed sizes is
    switched to verl's dynamic micro-batching with the same worst-case memory bound:
    ``micro_batch_size_per_gpu * (max_prompt_length + max_response_length)`` tokens. Returns what changed."""
    max_len = _max_row_tokens(config)
    if max_len <= 0:
        return []
    arr = config.actor_rollout_ref
    changed = []

    def convert(section, prefix: str, flag: str, mbs_key: str, len_keys: tuple[str, ...]) -> Optional[int]:
        if section is None or bool(section.get(flag, False)):
            return None
        mbs = (
            section.get(mbs_key, None)
            or arr.rollout.get("log_prob_micro_batch_size_per_gpu", None)
            or arr.actor.get("ppo_micro_batch_size_per_gpu", None)
            or 1
        )
        cap = int(mbs) * max_len
        section[flag] = True
        for key in len_keys:
            section[key] = cap
        changed.append(f"{prefix}.{flag}=true, {prefix}.{len_keys[0]}={cap}")
        return cap

    with open_dict(config):
        if not bool(arr.actor.get("use_dynamic_bsz", False)) or not bool(arr.rollout.get("log_prob_use_dynamic_bsz", False)):
            # verl asserts actor.use_dynamic_bsz == rollout.log_prob_use_dynamic_bsz: convert both
            arr.actor.use_dynamic_bsz = False
            arr.rollout.log_prob_use_dynamic_bsz = False
            convert(arr.actor, "actor_rollout_ref.actor", "use_dynamic_bsz", "ppo_micro_batch_size_per_gpu",
                    ("ppo_max_token_len_per_gpu",))
            convert(arr.rollout, "actor_rollout_ref.rollout", "log_prob_use_dynamic_bsz",
                    "log_prob_micro_batch_size_per_gpu", ("log_prob_max_token_len_per_gpu",))
        if "ref" in arr and arr.ref is not None:
            convert(arr.ref, "actor_rollout_ref.ref", "log_prob_use_dynamic_bsz", "log_prob_micro_batch_size_per_gpu",
                    ("log_prob_max_token_len_per_gpu",))
        critic = config.get("critic", None)
        if critic is not None:
            keys = tuple(k for k in ("ppo_max_token_len_per_gpu", "forward_max_token_len_per_gpu",
                                     "ppo_infer_max_token_len_per_gpu") if k in critic)
            if keys:
                convert(critic, "critic", "use_dynamic_bsz", "ppo_micro_batch_size_per_gpu", keys)
    return changed


def prepare_config(config: Any, traj: TrajConfig) -> None:
    """Validate ``traj:`` against verl's sections and adapt verl's settings it depends on."""
    validate_against_verl(traj, config)
    if config.get("distillation") is not None:
        from verl.trainer.distillation.losses import is_distillation_enabled

        if is_distillation_enabled(config.get("distillation")):
            raise TrajConfigError(
                "distillation is enabled but verl_traj's loss aggregation does not cover verl's distillation loss. "
                "Set traj.enable=false or disable distillation."
            )
    from verl_traj.integration.losses import SUPPORTED_POLICY_LOSS_MODES

    loss_mode = config.actor_rollout_ref.actor.get("policy_loss", {}).get("loss_mode", "vanilla")
    if loss_mode not in SUPPORTED_POLICY_LOSS_MODES:
        raise TrajConfigError(
            f"actor_rollout_ref.actor.policy_loss.loss_mode={loss_mode!r} is not supported with traj.enable=true "
            f"(supported: {list(SUPPORTED_POLICY_LOSS_MODES)}): its aggregation cannot take per-row loss weights. "
            "Choose a supported loss mode or set traj.enable=false."
        )
    if config.actor_rollout_ref.actor.get("use_prefix_grouper", False):
        raise TrajConfigError(
            "actor_rollout_ref.actor.use_prefix_grouper=true is not supported with traj.enable=true (it needs "
            "verl's group-contiguous balancing). Set one of them to false."
        )
    train_bs = int(config.data.train_batch_size)
    mini_bs = int(config.actor_rollout_ref.actor.ppo_mini_batch_size)
    if mini_bs <= 0 or train_bs % mini_bs != 0:
        raise TrajConfigError(
            f"data.train_batch_size={train_bs} is not a multiple of actor_rollout_ref.actor.ppo_mini_batch_size="
            f"{mini_bs}: the number of mini-batches (optimizer steps per training step) must be whole. "
            "Make train_batch_size a multiple of ppo_mini_batch_size."
        )
    if not config.trainer.get("balance_batch", True):
        warnings.warn(
            "trainer.balance_batch=false is overridden to true: with traj.enable=true the mini-batch planner "
            "runs in _balance_batch on every step (it also assigns mini-batches and padding). "
            "To skip only DP workload balancing set traj.balance_dp=false.",
            stacklevel=2,
        )
    with open_dict(config):
        config.trainer.balance_batch = True
    if traj.micro_batch_max_tokens is not None:
        apply_token_cap(config, int(traj.micro_batch_max_tokens))
    else:
        changed = fixed_to_dynamic_micro_batches(config)
        if changed:
            logger.warning(
                "verl_traj: planned mini-batches have variable rows per rank, so fixed micro-batch sizes were "
                "replaced by dynamic micro-batching with the same per-micro-batch memory bound (the gradient does "
                "not depend on micro-batching): %s. Set traj.micro_batch_max_tokens to choose the cap.",
                "; ".join(changed),
            )


# --------------------------------------------------------------------------------------------------
# real-row views and fit-time wrappers
# --------------------------------------------------------------------------------------------------


def padding_mask(batch: DataProto) -> Optional[np.ndarray]:
    """Bool ``[B]`` of padding rows, or None when the batch has none."""
    pad = None
    if batch.batch is not None and "is_padding" in batch.batch.keys():
        pad = batch.batch["is_padding"].detach().cpu().numpy().astype(bool)
    elif "is_padding" in batch.non_tensor_batch:
        pad = np.asarray(batch.non_tensor_batch["is_padding"]).astype(bool)
    if pad is None or not pad.any():
        return None
    return pad


def real_rows(batch: DataProto) -> DataProto:
    """The batch without its padding rows (a copy; ``meta_info`` copied and ``global_token_num``
    filtered). Returns ``batch`` itself when there is no padding row."""
    pad = padding_mask(batch)
    if pad is None:
        return batch
    keep = ~pad
    sub = batch.select_idxs(keep)
    sub.meta_info = dict(batch.meta_info)
    gtn = sub.meta_info.get("global_token_num")
    if isinstance(gtn, (list, tuple)) and len(gtn) == len(pad):
        sub.meta_info["global_token_num"] = [t for t, k in zip(gtn, keep) if k]
    return sub


def _on_real_rows(fn):
    @functools.wraps(fn)
    def wrapper(batch: DataProto, *args, **kwargs):
        return fn(real_rows(batch), *args, **kwargs)

    return wrapper


_ZERO_ON_PADDING = ("advantages", "returns")


def _scatter_rows(full: DataProto, sub: DataProto, keep: np.ndarray) -> None:
    """Write the tensors ``sub`` (real rows) added or recomputed (advantages, returns) into ``full``;
    padding rows get zeros there."""
    idx = torch.from_numpy(np.flatnonzero(keep))
    for key, val in sub.batch.items():
        if key in full.batch.keys() and key not in _ZERO_ON_PADDING:
            continue
        base = torch.zeros((len(keep),) + tuple(val.shape[1:]), dtype=val.dtype, device=val.device)
        base[idx.to(base.device)] = val
        full.batch[key] = base


def _compute_advantage_real_rows(fn):
    """Advantages from real rows only (any estimator); padding rows get zero advantages/returns."""

    @functools.wraps(fn)
    def wrapper(data: DataProto, *args, **kwargs):
        pad = padding_mask(data)
        if pad is None:
            return fn(data, *args, **kwargs)
        keep = ~pad
        out = fn(real_rows(data), *args, **kwargs)
        _scatter_rows(data, out, keep)
        for key, val in out.non_tensor_batch.items():
            if key not in data.non_tensor_batch:
                arr = np.empty(len(keep), dtype=object)
                arr[np.flatnonzero(keep)] = val
                data.non_tensor_batch[key] = arr
        return data

    return wrapper


def _apply_kl_penalty_real_rows(fn):
    """KL-in-reward statistics (and the adaptive controller update) from real rows only."""

    @functools.wraps(fn)
    def wrapper(data: DataProto, *args, **kwargs):
        pad = padding_mask(data)
        if pad is None:
            return fn(data, *args, **kwargs)
        keep = ~pad
        out, metrics = fn(real_rows(data), *args, **kwargs)
        rewards = data.batch["token_level_scores"].clone()
        rewards[torch.from_numpy(np.flatnonzero(keep))] = out.batch["token_level_rewards"]
        data.batch["token_level_rewards"] = rewards
        return data, metrics

    return wrapper


FIT_WRAPPERS = {
    "compute_data_metrics": _on_real_rows,
    "compute_timing_metrics": _on_real_rows,
    "compute_throughout_metrics": _on_real_rows,
    "compute_variance_proxy_metrics": _on_real_rows,
    "compute_advantage": _compute_advantage_real_rows,
    "apply_kl_penalty": _apply_kl_penalty_real_rows,
}


@contextlib.contextmanager
def fit_globals_on_real_rows() -> Iterator[None]:
    """Swap the ray_trainer module globals in ``FIT_WRAPPERS`` for real-row versions; restore on exit."""
    saved = {}
    try:
        for name, wrap in FIT_WRAPPERS.items():
            if hasattr(_rt, name):
                saved[name] = getattr(_rt, name)
                setattr(_rt, name, wrap(saved[name]))
        yield
    finally:
        for name, fn in saved.items():
            setattr(_rt, name, fn)


def traj_index_of_rows(batch: DataProto, traj_key: str) -> torch.Tensor:
    """Dense trajectory index per row: from ``non_tensor_batch[traj_key]`` (step-wise rows) or one
    trajectory per row."""
    n = len(batch)
    if traj_key in batch.non_tensor_batch:
        from verl_traj.core import factorize

        tid = np.asarray(batch.non_tensor_batch[traj_key]).astype(str)
        if "uid" in batch.non_tensor_batch:  # a trajectory never spans two uids; guards per-group ids
            tid = np.char.add(np.char.add(np.asarray(batch.non_tensor_batch["uid"]).astype(str), "\x00"), tid)
        codes, _ = factorize(tid)
        return torch.as_tensor(np.asarray(codes), dtype=torch.long)
    return torch.arange(n, dtype=torch.long)


def plan_batch_in_place(batch: DataProto, traj: TrajConfig, num_mini_batches: int, dp_size: int, *,
                        pad_token_id: int = 0, seed: Optional[int] = None):
    """Plan a verl batch with the core planner and apply the plan IN PLACE on the DataProto (rows
    reordered rank-major, padding rows appended, ``mini_batch_id`` / ``is_padding`` tensors added).
    Returns the :class:`~verl_traj.core.MiniBatchPlan`."""
    from verl_traj.core import apply_plan, build_layout, plan_mini_batches

    nt = batch.non_tensor_batch
    step_wise = traj.traj_id_key in nt and traj.step_index_key in nt
    layout = build_layout(
        batch.batch["attention_mask"],
        batch.batch["response_mask"],
        nt["uid"],
        traj_id=nt[traj.traj_id_key] if step_wise else None,
        step_index=nt[traj.step_index_key] if step_wise else None,
        is_last_step=nt.get("is_last_step") if step_wise else None,
        is_padding=batch.batch["is_padding"] if "is_padding" in batch.batch.keys() else nt.get("is_padding"),
    )
    plan = plan_mini_batches(
        layout, num_mini_batches, dp_size, group_by=traj.group_by, balance_dp=traj.balance_dp,
        workload=traj.workload, micro_batch_max_tokens=traj.micro_batch_max_tokens,
        seed=traj.seed if seed is None else seed,
    )
    out_t, out_nt = apply_plan(
        dict(batch.batch.items()), dict(nt), plan, pad_token_id=pad_token_id,
        traj_key=traj.traj_id_key, step_key=traj.step_index_key,
    )
    # verl's DataProto.to_tensordict refuses a key that is both a tensor and a non-tensor field:
    # keep ``is_padding`` as the bool tensor only.
    out_nt.pop("is_padding", None)
    batch.batch = TensorDict(out_t, batch_size=[plan.num_rows], device=batch.batch.device)
    batch.non_tensor_batch = out_nt
    return plan


# --------------------------------------------------------------------------------------------------
# the trainer
# --------------------------------------------------------------------------------------------------


class TrajRayPPOTrainer(RayPPOTrainer):
    """verl's ``RayPPOTrainer`` with trajectory-aware mini-batches (see the module docstring)."""

    def __init__(self, config, *args, **kwargs):
        self.traj = TrajConfig.from_mapping(config.get("traj"))
        if self.traj.enable:
            prepare_config(config, self.traj)
        super().__init__(config, *args, **kwargs)
        self.last_plan = None

    # ---- workers ---------------------------------------------------------------------------------

    def init_workers(self):
        super().init_workers()
        if self.traj.enable and self.use_critic:
            from verl.utils.config import omega_conf_to_dataclass
            from verl.workers.config import CriticConfig

            from verl_traj.integration.losses import traj_value_loss

            critic_cfg: CriticConfig = omega_conf_to_dataclass(self.config.critic)
            self.critic_wg.set_loss_fn(functools.partial(traj_value_loss, config=critic_cfg))

    # ---- fit -------------------------------------------------------------------------------------

    def fit(self):
        if not self.traj.enable:
            return super().fit()
        with contextlib.ExitStack() as stack:
            if self.traj.step_wise:
                from verl_traj.integration.stepwise_agent_loop import stepwise_compute_advantage_installed

                # outermost, so the real-rows wrappers below wrap the step-aware compute_advantage
                stack.enter_context(stepwise_compute_advantage_installed())
            stack.enter_context(fit_globals_on_real_rows())
            return super().fit()

    # ---- planning --------------------------------------------------------------------------------

    def num_mini_batches(self) -> int:
        return int(self.config.data.train_batch_size) // int(self.config.actor_rollout_ref.actor.ppo_mini_batch_size)

    def _dp_size(self) -> int:
        dp = self._get_dp_size(self.actor_rollout_wg, "actor")
        if self.use_critic:
            critic_dp = self._get_dp_size(self.critic_wg, "train")
            if critic_dp != dp:
                raise TrajConfigError(
                    f"actor DP size {dp} != critic DP size {critic_dp}: verl_traj plans one rank-major layout for "
                    "both. Use the same data-parallel size for actor and critic (same parallelism settings)."
                )
        return dp

    def _balance_batch(self, batch: DataProto, metrics, logging_prefix="global_seqlen", keep_minibatch=False):
        if not self.traj.enable:
            return super()._balance_batch(batch, metrics, logging_prefix=logging_prefix, keep_minibatch=keep_minibatch)
        if self.traj.step_wise:
            from verl_traj.integration.stepwise_agent_loop import expand_dataproto_step_rows

            pad_id = getattr(self.tokenizer, "pad_token_id", None)
            step_metrics = expand_dataproto_step_rows(
                batch,
                merge_prefix=self.traj.merge_prefix,
                pad_token_id=int(pad_id) if pad_id is not None else 0,
                traj_id_key=self.traj.traj_id_key,
                step_index_key=self.traj.step_index_key,
            )
            if metrics is not None:
                metrics.update(step_metrics)
        plan = self.plan_and_apply(batch, self._dp_size(), metrics)
        self.last_plan = plan

    def plan_and_apply(self, batch: DataProto, dp_size: int, metrics: Optional[dict] = None):
        """Plan ``batch`` and apply the plan in place (rows reordered, padding rows appended)."""
        pad_id = getattr(self.tokenizer, "pad_token_id", None) if getattr(self, "tokenizer", None) is not None else None
        plan = plan_batch_in_place(
            batch, self.traj, self.num_mini_batches(), dp_size,
            pad_token_id=int(pad_id) if pad_id is not None else 0,
            seed=self.traj.seed + int(getattr(self, "global_steps", 0) or 0),
        )
        if metrics is not None:
            metrics.update(plan.metrics("traj_plan"))
            ppo_epochs = int(self.config.actor_rollout_ref.actor.get("ppo_epochs", 1))
            metrics["traj_plan/expected_optimizer_steps"] = float(plan.num_mini_batches * ppo_epochs)
        self._debug_dump(batch, plan)
        return plan

    def _debug_dump(self, batch: DataProto, plan) -> None:
        out_dir = os.environ.get(DEBUG_DUMP_ENV)
        if not out_dir:
            return
        os.makedirs(out_dir, exist_ok=True)
        nt = batch.non_tensor_batch
        traj_ids = nt.get(self.traj.traj_id_key)
        pad = batch.batch["is_padding"].tolist()
        rec = {
            "step": int(getattr(self, "global_steps", 0) or 0),
            "dp_size": plan.dp_size,
            "num_mini_batches": plan.num_mini_batches,
            "uid": [str(u) for u in nt["uid"]],
            "traj_id": [str(t) for t in traj_ids] if traj_ids is not None else None,
            "mini_batch_id": batch.batch["mini_batch_id"].tolist(),
            "is_padding": pad,
            "loss_tokens": batch.batch["response_mask"].sum(-1).tolist(),
            # verl's compute_data_metrics response_length: attended response positions
            "response_length": batch.batch["attention_mask"][:, -batch.batch["responses"].shape[-1]:].sum(-1).tolist(),
            "attention_length": batch.batch["attention_mask"].sum(-1).tolist(),
        }
        with open(os.path.join(out_dir, "plan.jsonl"), "a") as f:
            f.write(json.dumps(rec) + "\n")

    # ---- updates ---------------------------------------------------------------------------------

    def loss_weights(self, batch: DataProto, mode: str, loss_scale_factor=None) -> torch.Tensor:
        from verl_traj.core import compute_loss_weights

        return compute_loss_weights(
            mode,
            batch.batch["response_mask"],
            batch.batch["mini_batch_id"],
            traj_index_of_rows(batch, self.traj.traj_id_key),
            batch.batch["is_padding"].bool(),
            loss_scale_factor=loss_scale_factor,
        )

    @contextlib.contextmanager
    def _with_loss_weight(self, batch: DataProto, mode: str, loss_scale_factor) -> Iterator[None]:
        batch.batch[LOSS_WEIGHT_KEY] = self.loss_weights(batch, mode, loss_scale_factor)
        try:
            yield
        finally:
            batch.batch.pop(LOSS_WEIGHT_KEY, None)

    def _planned(self, batch: DataProto) -> bool:
        return self.traj.enable and "mini_batch_id" in batch.batch.keys() and "is_padding" in batch.batch.keys()

    def _update_actor(self, batch: DataProto) -> DataProto:
        if not self._planned(batch):
            return super()._update_actor(batch)
        actor = self.config.actor_rollout_ref.actor
        mode = self.traj.loss_agg_mode or actor.loss_agg_mode
        with self._with_loss_weight(batch, mode, actor.get("loss_scale_factor", None)):
            return super()._update_actor(batch)

    def _update_critic(self, batch: DataProto) -> DataProto:
        if not self._planned(batch):
            return super()._update_critic(batch)
        critic = self.config.critic
        mode = self.traj.critic_loss_agg_mode or critic.loss_agg_mode
        with self._with_loss_weight(batch, mode, critic.get("loss_scale_factor", None)):
            return super()._update_critic(batch)


__all__ = [
    "TrajRayPPOTrainer",
    "plan_batch_in_place",
    "apply_token_cap",
    "fit_globals_on_real_rows",
    "prepare_config",
    "real_rows",
    "padding_mask",
]
