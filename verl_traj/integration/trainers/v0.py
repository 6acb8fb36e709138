"""verl_traj's trainer: verl's ``RayPPOTrainer`` (v0) with trajectory-aware batching. A thin adapter:
the decisions are the core's (:mod:`verl_traj.core`); this class only moves them into verl's ``fit``.

With ``traj.enable=true``:

* ``_balance_batch`` (every step: ``trainer.balance_batch`` is forced on) expands step-wise rows
  (``traj.step_wise``), then :func:`plan_batch_in_place`: layout -> plan -> ``apply_plan``, in place on
  the DataProto. The batch then carries the plan's per-row facts (``mini_batch_id``, ``micro_batch_id``,
  ``traj_index``, ``is_padding``; :mod:`verl_traj.core.keys`) to every later step of ``fit``; the plan's
  statistics are logged as ``traj_plan/*``.
* ``_update_actor`` / ``_update_critic`` attach the per-row ``loss_weight`` (from those facts and the
  final ``response_mask``) for the duration of the call; the workers step once per ``mini_batch_id`` and
  run the planned micro-batches (:mod:`verl_traj.integration.workers.engine_workers`); the losses aggregate with the
  weights (:mod:`verl_traj.integration.workers.losses`). The critic may step on unions of the actor's mini-batches.
* During ``fit`` verl's advantage, KL-in-reward and metric functions see real rows only
  (:func:`verl_traj.integration.patches.scoped.fit_patches`; restored when ``fit`` returns or raises).
* With ``traj.prefix_tree``, :func:`plan_batch_in_place` also builds every planned micro-batch's tree here, where
  the token ids are on the host, and ships what the workers need with the plan
  (:mod:`verl_traj.integration.trainers.tree_plan_facts`): every later pass of the step rebuilds the trees on the device
  from those facts.
* Start-up: :func:`verl_traj.integration.config.verl_config.prepare_config`.
* Debug: ``VERL_TRAJ_DEBUG_DUMP=<dir>`` appends one JSON line per step to ``<dir>/plan.jsonl`` with every
  row's uid, traj_id, mini_batch_id, is_padding and lengths (used by the e2e tests).

With ``traj.enable=false`` every method is verl's (``super()``).
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import numpy as np
import torch
from tensordict import TensorDict

from verl import DataProto
from verl.trainer.ppo.ray_trainer import RayPPOTrainer

from verl_traj.core import MiniBatchPlan, apply_plan, build_layout
from verl_traj.core.errors import TrajInputError
from verl_traj.core.keys import IS_LAST_STEP, IS_PADDING, MINI_BATCH_ID, PATH_COPIES, PLAN_ATOMIC, PLAN_KEYS, TRAJ_INDEX
from verl_traj.core.plan.padding import resolve_pad_token_id
from verl_traj.core.trees.token_rows import TokenRows
from verl_traj.integration.config.access import value_at
from verl_traj.integration.config.update_spec import UpdateSpec
from verl_traj.integration.patches.scoped import fit_patches, patched
from verl_traj.integration.rows.credit import load_rules, records_anchors
from verl_traj.integration.rows.real_rows import is_padding, real_rows
from verl_traj.integration.rows.stepwise_rows import expand_dataproto_step_rows
from verl_traj.integration.startup.tree_checks import settled_traj_config
from verl_traj.integration.trainers.checkpoints import CompleteCheckpoints
from verl_traj.integration.trainers.step_plan import (check_same_dp_size, debug_dump, plan_layout, plan_step_metrics,
                                                      stock_plan_metrics_of)
from verl_traj.integration.trainers.tree_plan_facts import row_tree_facts
from verl_traj.integration.trainers.update_contract import ACTOR, CRITIC, loss_of, pass_markers, update_contract
from verl_traj.stepwise.step_groups import StepGroupOptions

__all__ = ["TrajRayPPOTrainer", "attended_rows", "plan_batch_in_place"]


def attended_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> TokenRows:
    """``[B, S]`` padded ids and mask -> each row's attended token ids (the tree planner's rows) as one flat array
    (:class:`~verl_traj.core.trees.token_rows.TokenRows`): no tensor per row."""
    return TokenRows.of_padded(input_ids, attention_mask)


def plan_batch_in_place(batch: DataProto, spec: UpdateSpec, dp_size: int, *, pad_token_id: int = 0,
                        seed: int = 0) -> tuple[MiniBatchPlan, dict[str, float]]:
    """Plan a verl batch with the core and apply the plan IN PLACE on the DataProto (rows reordered
    rank-major, padding rows appended, the plan's per-row facts added as tensors; with ``traj.prefix_tree`` the
    planned micro-batches' tree facts too, from the planned rows). Returns the plan and the trees' metrics
    (``actor/tree_share``: the micro-batches the cost model forwards as trees)."""
    traj_config, nt = spec.traj_config, batch.non_tensor_batch
    step_wise = traj_config.traj_id_key in nt and traj_config.step_index_key in nt
    layout = build_layout(
        batch.batch["attention_mask"], batch.batch["response_mask"], nt["uid"],
        traj_id=nt[traj_config.traj_id_key] if step_wise else None,
        step_index=nt[traj_config.step_index_key] if step_wise else None,
        is_last_step=nt.get(IS_LAST_STEP) if step_wise else None,
        is_padding=batch.batch[IS_PADDING] if IS_PADDING in batch.batch.keys() else None,
    )
    rows = attended_rows(batch.batch["input_ids"], batch.batch["attention_mask"]) if traj_config.trees else None
    plan = plan_layout(layout, traj_config, spec.num_mini_batches, dp_size, micro=spec.plan, seed=seed, rows=rows)
    out_t, out_nt = apply_plan(dict(batch.batch.items()), dict(nt), plan, pad_token_id=pad_token_id,
                               traj_key=traj_config.traj_id_key, step_key=traj_config.step_index_key)
    batch.batch = TensorDict(out_t, batch_size=[plan.num_rows], device=batch.batch.device)
    batch.non_tensor_batch = out_nt
    if traj_config.trees:  # the trees of the planner's rows by plan.order; only the padding rows are read
        pads = np.flatnonzero(plan.order.numpy() < 0)
        pad_rows = attended_rows(batch.batch["input_ids"][pads], batch.batch["attention_mask"][pads])
        fields, trees = row_tree_facts(rows, pad_rows, plan, spec.plan.tree_cost)
        for key, value in fields.items():
            batch.batch[key] = value.to(batch.batch.device) if batch.batch.device is not None else value
        return plan, trees
    return plan, {"actor/tree_share": 0.0}


class TrajRayPPOTrainer(CompleteCheckpoints, RayPPOTrainer):
    """verl's ``RayPPOTrainer`` with trajectory-aware mini-batches (see the module docstring)."""

    def __init__(self, config, *args, **kwargs):
        self.traj_config = settled_traj_config(config)
        load_rules(self.traj_config.credit_rule_modules)  # this process knows every per-call credit rule
        self.spec = UpdateSpec.prepare(config, self.traj_config) if self.traj_config.enable else None
        super().__init__(config, *args, **kwargs)

    def fit(self):
        if not self.traj_config.enable:
            return super().fit()
        self._real_row_mask = None
        with patched(fit_patches(self.traj_config.step_wise, lambda: self._real_row_mask,
                                 self.traj_config.step_index_key, self.spec.trajectory_ratios,
                                 StepGroupOptions.of(self.traj_config))):
            return super().fit()

    # ---- planning --------------------------------------------------------------------------------

    def _dp_size(self) -> int:
        return check_same_dp_size(self._get_dp_size(self.actor_rollout_wg, "actor"),
                                  self._get_dp_size(self.critic_wg, "train") if self.use_critic else None)

    def _pad_token_id(self) -> int:
        """The tokenizer's pad token (its EOS where it has none, as verl's ``hf_tokenizer`` sets it; neither: an
        error naming ``tokenizer.pad_token_id``)."""
        tokenizer = getattr(self, "tokenizer", None)
        return resolve_pad_token_id(getattr(tokenizer, "pad_token_id", None), getattr(tokenizer, "eos_token_id", None))

    def _balance_batch(self, batch: DataProto, metrics, logging_prefix="global_seqlen", keep_minibatch=False):
        if not self.traj_config.enable:
            super()._balance_batch(batch, metrics, logging_prefix=logging_prefix, keep_minibatch=keep_minibatch)
            if metrics is not None:  # observation only: what stock verl's mini-batches do to groups
                metrics.update(self._stock_plan_metrics(batch))
            return
        if self.traj_config.step_wise:
            step_metrics = expand_dataproto_step_rows(
                batch, merge_prefix=self.traj_config.merge_prefix, pad_token_id=self._pad_token_id(),
                traj_id_key=self.traj_config.traj_id_key, step_index_key=self.traj_config.step_index_key,
                step_anchors=records_anchors(value_at(self.config, "algorithm.adv_estimator", "grpo")),
                branch_paths=self.traj_config.branch_weighting == "paths",
            )
            if metrics is not None:
                metrics.update(step_metrics)
        self.plan_and_apply(batch, self._dp_size(), metrics)

    def _stock_plan_metrics(self, batch: DataProto) -> dict[str, float]:
        return stock_plan_metrics_of(self.config, batch.non_tensor_batch["uid"], None, None,
                                     self._get_dp_size(self.actor_rollout_wg, "actor"))

    def plan_and_apply(self, batch: DataProto, dp_size: int, metrics: Optional[dict] = None) -> MiniBatchPlan:
        """Plan ``batch`` and apply the plan in place (rows reordered, padding rows appended)."""
        plan, trees = plan_batch_in_place(batch, self.spec, dp_size, pad_token_id=self._pad_token_id(),
                                          seed=self.spec.plan_seed(int(getattr(self, "global_steps", 0) or 0)))
        self._real_row_mask = ~plan.is_padding.numpy()
        batch.meta_info[PLAN_ATOMIC] = plan.all_trajectories_atomic  # GSPO's trajectory ratio from the loss
        batch.meta_info.update(pass_markers(self.spec))  # every pass of this batch (log-probs, values, updates)
        if metrics is not None:
            metrics.update(plan_step_metrics(plan, self.spec.epochs), **trees)
        self._debug_dump(batch, plan)
        return plan

    def _debug_dump(self, batch: DataProto, plan: MiniBatchPlan) -> None:
        td, nt = batch.batch, batch.non_tensor_batch
        traj_ids = nt.get(self.traj_config.traj_id_key)
        debug_dump(int(getattr(self, "global_steps", 0) or 0), plan, {
            "uid": [str(u) for u in nt["uid"]],
            "traj_id": [str(t) for t in traj_ids] if traj_ids is not None else None,
            "loss_tokens": td["response_mask"].sum(-1).tolist(),
            # verl's compute_data_metrics response_length: attended response positions
            "response_length": td["attention_mask"][:, -td["responses"].shape[-1]:].sum(-1).tolist(),
            "attention_length": td["attention_mask"].sum(-1).tolist(),
        })

    # ---- rollout dumps ----------------------------------------------------------------------------

    def _log_rollout_data(self, batch: DataProto, reward_extra_infos_dict: dict, timing_raw: dict,
                          rollout_data_dir: str):
        """``trainer.rollout_data_dir`` dumps: the real rows only (padding rows are not rollouts)."""
        pad = is_padding(batch) if self.traj_config.enable else None
        if pad is None:
            return super()._log_rollout_data(batch, reward_extra_infos_dict, timing_raw, rollout_data_dir)
        keep = ~pad
        extra = {k: np.asarray(v)[keep] if len(v) == len(keep) else v for k, v in reward_extra_infos_dict.items()}
        return super()._log_rollout_data(real_rows(batch), extra, timing_raw, rollout_data_dir)

    # ---- updates ---------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _planned_update(self, batch: DataProto, role: str) -> Iterator[None]:
        """The update's contract (:func:`~verl_traj.integration.trainers.update_contract.update_contract`) in the
        batch for one ``role`` update: its fields as tensors, its markers in ``meta_info``; removed on exit."""
        td = batch.batch
        missing = [key for key in PLAN_KEYS if key not in td.keys()]
        if missing:
            raise TrajInputError(
                f"the update's batch lacks the plan's field {missing[0]!r}: _balance_batch did not plan it (it runs "
                "every step with traj.enable=true), or something replaced the batch after planning. verl_traj "
                "trains planned batches only.", field=missing[0])
        weights = loss_of(self.spec, role).weights(td["response_mask"], td[MINI_BATCH_ID], td[TRAJ_INDEX],
                                                   td[IS_PADDING], copies=td.get(PATH_COPIES, None))
        contract = update_contract(self.spec, role, weights, td[TRAJ_INDEX], td[IS_PADDING],
                                   all_atomic=bool(batch.meta_info.get(PLAN_ATOMIC, False)))
        td.update(contract.fields)
        batch.meta_info.update(contract.markers)
        try:
            yield
        finally:
            for key in contract.fields:
                td.pop(key, None)
            for key in contract.markers:
                batch.meta_info.pop(key, None)

    def _update_actor(self, batch: DataProto) -> DataProto:
        if not self.traj_config.enable:
            return super()._update_actor(batch)
        with self._planned_update(batch, ACTOR):
            return super()._update_actor(batch)

    def _update_critic(self, batch: DataProto) -> DataProto:
        if not self.traj_config.enable:
            return super()._update_critic(batch)
        with self._planned_update(batch, CRITIC):
            return super()._update_critic(batch)
