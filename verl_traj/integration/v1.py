"""verl_traj on verl's v1 trainer (``trainer.use_v1=true``, verl 0.9's default): the same core planner, workers
and losses as on v0, behind one mixin.

v1 keeps a batch in TransferQueue (TQ): the trainer holds a ``KVBatchMeta`` (row keys and per-row tags), the
workers pull the stored fields common to every row dispatched to them. A row key is ``{uid}_{session}_{index}``:
``uid`` is the prompt (the GRPO group), ``{uid}_{session}`` one trajectory (``rollout.n`` sessions per prompt),
``index`` the position of the row among the session's agent-loop outputs -- its step (several outputs per session
come from verl_traj's step-wise rows, :mod:`verl_traj.integration.v1_agent_loop`, or from any v1 agent loop that
returns ``list[AgentLoopOutput]``). The adapter works from those keys and the tags v1 already keeps.

With ``traj.enable=true`` every mode's trainer (``sync``, ``colocate_async``, ``separate_async`` and any mode
registered later) runs as ``Traj<Class>(TrajV1Mixin, Class)`` (:func:`traj_trainer_class`, installed by the task
runner for its lifetime):

* ``_balance_batch`` (replaces verl's LCM upsampling + Karmarkar-Karp): layout from the keys and the ``seq_len``
  tags plus one fetch of ``response_mask`` (loss tokens); the core plans (whole units per mini-batch, DP balance,
  at most dp-1 padding rows per mini-batch, micro-batches under the token cap); padding rows are written to TQ
  (``pad_row_tokens`` long, each its own group, tagged ``is_padding`` as verl's own); the keys come back in the
  plan's rank-major order (dispatch hands rank r the r-th contiguous block), with ``mini_batch_id`` and
  ``micro_batch_id`` stored as fields of every row. The plan's other per-row facts (trajectory index, last step,
  padding) stay on the trainer (:class:`PlanFacts`) for the advantage and the loss weights.
* ``_compute_advantage``: verl's, with ``compute_advantage_for_multi_trajectories`` replaced for the call by
  :func:`planned_advantage` (real rows only; a trajectory of several rows gets its outcome estimator once, or a
  temporal estimator on its timeline of rows).
* ``_update_critic`` / ``_update_actor``: a ``loss_weight`` field (from the final ``response_mask`` and the plan)
  is written before verl's dispatch; the workers step once per ``mini_batch_id`` and run the planned
  micro-batches (:mod:`verl_traj.integration.workers`), the losses aggregate globally (:mod:`.losses`).
* ``_compute_metrics``: timing and throughput on real rows too (verl already drops ``is_padding`` rows elsewhere).
* Workers and losses: the actor role(s) run :func:`~verl_traj.integration.workers.traj_actor_worker` of verl's
  class (``DetachActorWorker`` in ``separate_async`` included), the critic ``TrajCriticWorker`` with
  ``traj_value_loss``. Prompt uids are deterministic (seed, step, position) and rows are planned in key order,
  so a seeded run plans the same batches again.

With ``traj.enable=false`` the trainer is verl's own class (the mixin is not applied); ``stock_plan/*`` metrics
then observe what verl's fixed-size mini-batches do to groups.
"""

from __future__ import annotations

import copy
import functools
import logging
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np
import torch
from tensordict import TensorDict

from verl_traj.config import TrajConfig, TrajConfigError
from verl_traj.core import MiniBatchPlan, build_layout_from_counts
from verl_traj.core.keys import (IS_LAST_STEP, IS_PADDING, LOSS_WEIGHT, MICRO_BATCH_ID, MINI_BATCH_ID, RATIO_GROUP,
                                 TRAJ_INDEX, TURN_REWARDS)
from verl_traj.core.row_key import parse_row_keys, row_key, row_key_order

STEP_INDEX = "step_index"  # the field the step-wise advantage reads each row's step from (v1: traj.step_index_key is fixed)
from verl_traj.integration.checkpoints import CompleteCheckpoints
from verl_traj.integration.patches import patched
from verl_traj.integration.step_plan import (check_same_dp_size, debug_dump, plan_layout, plan_step_metrics,
                                       stock_plan_metrics_of)
from verl_traj.integration.update_spec import LossSpec, UpdateSpec
from verl_traj.integration.verl_config import prepare_v1_agent_loop
from verl_traj.integration.workers import CRITIC_UNION_KEY

__all__ = ["PlanFacts", "TrajV1Mixin", "last_rows_of_trajectories", "padding_row", "plan_facts", "planned_advantage",
           "row_loss_tokens", "traj_trainer_class", "trajectory_correction", "trajectory_metrics"]

logger = logging.getLogger(__name__)

_UID_NAMESPACE = uuid.UUID("5f3c1d52-6a1e-4c8e-9a57-1c0a3e5b7d11")


def row_loss_tokens(mask: torch.Tensor) -> torch.Tensor:
    """``[B]`` int64 non-zero entries per row of a ``[B, R]`` mask, dense or jagged (TQ's nested layout)."""
    if mask.is_nested:
        lengths = mask.offsets().diff()
        rows = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
        return torch.zeros(lengths.numel(), dtype=torch.int64).index_add_(0, rows, (mask.values() != 0).long())
    return (mask != 0).sum(-1).long()


@dataclass(frozen=True)
class PlanFacts:
    """The plan's per-row facts of the batch planned last, in dispatch order (``[B]`` each)."""

    keys: tuple[str, ...]
    traj_index: torch.Tensor  # int64, -1 on padding
    is_last_step: torch.Tensor  # bool
    is_padding: torch.Tensor  # bool
    mini_batch_id: torch.Tensor  # int64
    multi_row: bool  # some trajectory has several rows (steps)
    turn_rewards: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None  # (row, position, reward) [K]

    @property
    def stepwise(self) -> bool:
        """The step-wise advantage path: a trajectory with several rows, or turn rewards to put on tokens."""
        return self.multi_row or self.turn_rewards is not None

    def check(self, keys: list[str]) -> None:
        if tuple(keys) != self.keys:
            first = next((i for i, (a, b) in enumerate(zip(keys, self.keys)) if a != b), min(len(keys), len(self.keys)))
            raise RuntimeError(
                f"the batch's keys are not the ones _balance_batch planned ({len(keys)} rows vs {len(self.keys)} "
                f"planned; first difference at row {first}): something between balancing and this step reordered or "
                "replaced rows. verl_traj needs the planned order."
            )

    def attach(self, data: Any, keys: list[str]) -> None:
        """Carry the plan's facts into a verl ``DataProto`` that verl built from TransferQueue for one driver step
        (its field lists are fixed, so the facts travel from here, as on v0 they travel in the batch):
        ``is_padding`` and ``traj_index`` tensors, ``is_last_step`` and ``step_index`` (the step of each row, read
        from its key; after checking ``keys`` are the planned ones)
        :func:`verl_traj.integration.real_rows.is_padding` then reads the padding flag, on both trainers."""
        self.check(keys)
        td = data.batch
        td[IS_PADDING] = self.is_padding.to(td.device)
        td[TRAJ_INDEX] = self.traj_index.to(td.device)
        data.non_tensor_batch[IS_LAST_STEP] = self.is_last_step.numpy()
        data.non_tensor_batch[STEP_INDEX] = parse_row_keys(keys).step
        if self.turn_rewards is not None:  # the sparse tags back on their tokens (v0's expansion writes the same)
            row, pos, reward = self.turn_rewards
            dense = torch.zeros(td["response_mask"].shape, dtype=torch.float32)
            td[TURN_REWARDS] = dense.index_put_((row, pos), reward, accumulate=True).to(td.device)


def padding_row(source: dict, tag: dict, eos_token_id: int, length: int) -> tuple[dict, dict]:
    """One padding row of ``length`` attended tokens (``length - 1`` prompt EOS + one response EOS, masks and
    rewards 0) with ``source``'s schema: verl's ``construct_minimal_padding_template`` (128 tokens), shortened."""
    from verl.trainer.ppo.padding_utils import (build_padding_position_ids, build_padding_routed_experts,
                                                construct_minimal_padding_template)

    sample, pad_tag = construct_minimal_padding_template(source, tag, eos_token_id)
    prompts = torch.full((length - 1,), eos_token_id, dtype=torch.int64)
    responses = torch.full((1,), eos_token_id, dtype=torch.int64)
    input_ids = torch.cat([prompts, responses])
    attention_mask = torch.ones_like(input_ids)
    sample.update(prompts=prompts, responses=responses, input_ids=input_ids, attention_mask=attention_mask,
                  position_ids=build_padding_position_ids(source.get("position_ids"), attention_mask))
    if "routed_experts" in sample:
        sample["routed_experts"] = build_padding_routed_experts(source.get("routed_experts"), length)
    pad_tag.update(is_padding=True, prompt_len=length - 1, response_len=1, seq_len=length)
    return sample, pad_tag


def _write_padding_rows(batch: Any, count: int, eos_token_id: int, length: int) -> tuple[list[str], list[dict]]:
    """``count`` padding rows in TQ, each its own uid (a group of one: no group statistic sees it)."""
    import transfer_queue as tq
    from verl.utils.tensordict_utils import list_of_dict_to_tensordict

    if count == 0:
        return [], []
    source = tq.kv_batch_get(keys=[batch.keys[0]], partition_id=batch.partition_id)[0]
    template, tag = padding_row(source, batch.tags[0], eos_token_id, length)
    keys, fields = [], []
    for _ in range(count):
        uid = f"pad{uuid.uuid4().hex}"
        row = copy.deepcopy(template)
        row["uid"] = uid
        if "session_id" in row:
            row["session_id"] = 0
        keys.append(row_key(uid, 0, 0))
        fields.append(row)
    tags = [copy.deepcopy(tag) for _ in range(count)]
    tq.kv_batch_put(keys=keys, partition_id=batch.partition_id, fields=list_of_dict_to_tensordict(fields), tags=tags)
    return keys, tags


def _dispatch_dp_size(worker_group: Any, mesh: str) -> int:
    """Data-parallel size of a worker group's mesh, as verl's v1 ``_balance_batch`` reads it."""
    if mesh not in worker_group._dispatch_info:
        worker_group._dispatch_info[mesh] = worker_group._query_dispatch_info(mesh)
    return max(worker_group._dispatch_info[mesh]) + 1


def stepwise_metrics(tags: list[dict]) -> dict[str, float]:
    """``traj_stepwise/*`` (as on v0) from the merge statistics the step-wise agent-loop worker tags each session
    with; nothing for a batch without step-wise sessions."""
    from verl_traj.integration.v1_agent_loop import MERGE_TAG, turn_reward_entries
    from verl_traj.stepwise.prefix_merge import MergeStats

    stats = [t[MERGE_TAG] for t in tags if MERGE_TAG in t]
    if not stats:
        return {}
    out = sum((MergeStats(**s) for s in stats), MergeStats()).metrics("traj_stepwise")
    out["traj_stepwise/trajectories"] = float(len(stats))
    turn = turn_reward_entries(tags)
    if turn is not None:  # what the agent loop gave as turn rewards this step (as on v0)
        out["traj_stepwise/turn_reward_sum"] = float(turn[2].sum())
        out["traj_stepwise/turn_rewards_nonzero"] = float((turn[2] != 0).sum())
    return out


def last_rows_of_trajectories(keys: list[str], is_padding: np.ndarray) -> np.ndarray:
    """Indices of each real trajectory's last row (its highest step) among ``keys`` (``{uid}_{session}_{index}``)."""
    parsed = parse_row_keys(keys)
    code = np.unique(parsed.traj_id.astype(str), return_inverse=True)[1]
    last_step = np.full(code.max() + 1 if code.size else 0, -1, dtype=np.int64)
    np.maximum.at(last_step, code[~is_padding], parsed.step[~is_padding])
    return np.flatnonzero(~is_padding & (parsed.step == last_step[code]))


def trajectory_metrics(batch: Any, global_steps: int) -> dict[str, float]:
    """Per trajectory, whatever its row count (verl's ``critic/score/*`` averages rows: with step rows a long
    trajectory counts once per LLM call), read from each trajectory's last row (stock runs too):

    * ``traj_reward/*``: the outcome score (the last row's ``rm_scores``), mean / min / max over trajectories;
    * ``traj_version/*``: the policy versions it was generated under (the rows' ``min_global_steps`` /
      ``max_global_steps`` tags, which verl's staleness control reads), per trajectory (verl's
      ``training/off_policy/*`` are per row): ``staleness_max`` / ``_mean`` = versions behind the trained policy at
      its first token (verl's worst-case staleness, ``global_steps - 1 - min_global_steps``), ``span_max`` = versions
      it spans, ``multi_version_share`` = share generated across more than one (partial rollouts)."""
    import transfer_queue as tq

    pad = np.array([bool(t.get("is_padding", False)) for t in batch.tags], dtype=bool)
    last = last_rows_of_trajectories(batch.keys, pad)
    if last.size == 0:
        return {}
    scores = tq.kv_batch_get(keys=[batch.keys[i] for i in last], partition_id=batch.partition_id,
                             select_fields=["rm_scores"])["rm_scores"]
    score = (scores.to_padded_tensor(0.0) if scores.is_nested else scores).sum(-1).float()
    out = {"traj_reward/mean": float(score.mean()), "traj_reward/min": float(score.min()),
           "traj_reward/max": float(score.max()), "traj_reward/trajectories": float(last.size)}
    tags = [batch.tags[i] for i in last]
    if all(t.get("min_global_steps") is not None and t.get("max_global_steps") is not None for t in tags):
        lo = np.array([int(t["min_global_steps"]) for t in tags])
        hi = np.array([int(t["max_global_steps"]) for t in tags])
        stale = global_steps - 1 - lo
        out.update({"traj_version/staleness_max": float(stale.max()), "traj_version/staleness_mean": float(stale.mean()),
                    "traj_version/span_max": float((hi - lo + 1).max()),
                    "traj_version/multi_version_share": float((hi > lo).mean())})
    return out


def _ordered_batch(batch: Any, plan: MiniBatchPlan, pad_keys: list[str], pad_tags: list[dict]) -> Any:
    """The batch's keys and tags (padding rows appended) in the plan's rank-major order."""
    from transfer_queue import KVBatchMeta

    keys, tags = batch.keys + pad_keys, batch.tags + pad_tags
    order = plan.order.numpy().copy()
    pads = np.flatnonzero(order < 0)
    order[pads] = len(batch) + np.arange(pads.size)
    return KVBatchMeta(keys=[keys[i] for i in order], tags=[tags[i] for i in order], partition_id=batch.partition_id,
                       fields=batch.fields, extra_info=batch.extra_info)


def plan_facts(batch: Any, plan: MiniBatchPlan, layout: Any) -> PlanFacts:
    """The plan's per-row facts in dispatch order (``batch``: the planned batch's keys and tags, padding
    included)."""
    from verl_traj.integration.v1_agent_loop import turn_reward_entries

    src = plan.order.clamp(min=0)
    return PlanFacts(
        keys=tuple(batch.keys), traj_index=plan.traj_index.clone(),
        is_last_step=layout.is_last_step[src] & ~plan.is_padding, is_padding=plan.is_padding.clone(),
        mini_batch_id=plan.mini_batch_id.clone(), multi_row=bool((layout.traj_num_steps > 1).any()),
        turn_rewards=turn_reward_entries(batch.tags),
    )


@functools.lru_cache(maxsize=None)
def traj_trainer_class(verl_cls: type) -> type:
    """``Traj<Name>(TrajV1Mixin, verl_cls)`` for a registered v1 trainer class (one class per input)."""
    return type(f"Traj{verl_cls.__name__}", (TrajV1Mixin, verl_cls), {"__module__": __name__})


def planned_advantage(rows: PlanFacts) -> Any:
    """Replacement for v1's ``compute_advantage_for_multi_trajectories(data, batch_keys, adv_estimator, ...)`` on a
    planned batch: padding rows get zeros and move nothing; a batch whose trajectories have several rows (steps) counts
    the reward once, on its last step (v1 copies it onto every step row; also in KL-in-reward's sum) plus the turn
    rewards the rows' tags carry (:attr:`PlanFacts.turn_rewards`), then runs an
    outcome estimator once per trajectory, each row getting the trajectory's scalar on its own tokens, or a temporal
    one (GAE, REINFORCE++) on each trajectory's timeline of rows (:func:`~verl_traj.integration.stepwise_rows.
    stepwise_advantage`); otherwise verl's ``compute_advantage`` runs on the real rows, as on v0."""
    from verl_traj.integration.real_rows import advantage_on_real_rows
    from verl_traj.integration.stepwise_rows import stepwise_advantage

    def compute(data: Any, batch_keys: list[str], adv_estimator: Any, gamma: float = 1.0, lam: float = 1.0,
                num_repeat: int = 1, norm_adv_by_std_in_grpo: bool = True, config: Optional[Any] = None) -> Any:
        from verl.trainer.ppo import ray_trainer

        rows.attach(data, batch_keys)
        td = data.batch
        kwargs = dict(gamma=gamma, lam=lam, num_repeat=num_repeat, norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo,
                      config=config)
        if not rows.stepwise:
            return advantage_on_real_rows(ray_trainer.compute_advantage)(data, adv_estimator, **kwargs)
        not_last = (~rows.is_last_step).to(device=td.device, dtype=td["token_level_scores"].dtype)
        td["token_level_rewards"] = td["token_level_rewards"] - td["token_level_scores"] * not_last[:, None]
        # as on v0: the step-wise advantage inside the real-row wrapper (finite rewards, padding rows zero)
        return advantage_on_real_rows(stepwise_advantage(ray_trainer.compute_advantage))(data, adv_estimator, **kwargs)

    return compute


def trajectory_correction(rows: PlanFacts) -> Callable[[Callable], Callable]:
    """Wrapper of v1's ``compute_rollout_correction_and_add_to_batch(data, config)`` on a planned batch: the plan's
    facts attached first (v1 corrects before it computes advantages), then verl's correction per trajectory
    (:func:`~verl_traj.integration.stepwise_rows.trajectory_scoped_correction`)."""
    from verl_traj.integration.stepwise_rows import trajectory_scoped_correction

    def wrap(verl_add_to_batch: Callable) -> Callable:
        scoped = trajectory_scoped_correction(verl_add_to_batch, step_index_key=STEP_INDEX)

        def compute(data: Any, rollout_corr_config: Any) -> tuple[Any, dict]:
            rows.attach(data, list(rows.keys))
            return scoped(data, rollout_corr_config)

        return compute

    return wrap


class TrajV1Mixin(CompleteCheckpoints):
    """verl_traj's part of a v1 trainer (first base; see the module docstring). Inactive with ``traj.enable=false``
    but for the ``stock_plan/*`` observer metrics and what pairs a stock run with a verl_traj run of the same seed:
    seeded prompt uids and one request priority per session (neither changes what is trained)."""

    def __init__(self, config: Any):
        self.traj_config = TrajConfig.from_mapping(config.get("traj"))
        self.spec = UpdateSpec.prepare(config, self.traj_config) if self.traj_config.enable else None
        if not self.traj_config.enable:
            prepare_v1_agent_loop(config, self.traj_config)  # the agent-loop manager that gives each session its request priority
        self._planned: Optional[PlanFacts] = None  # the last local update's plan
        self._padding_by_key: dict[str, bool] = {}  # every row planned since the last metrics, by key
        self._uid_draws = (-1, 0)  # (global step, prompts drawn in it): deterministic uids
        super().__init__(config)

    # ---- set-up ------------------------------------------------------------------------------------

    def _init_resource_pool_mgr(self):
        super()._init_resource_pool_mgr()
        if not self.traj_config.enable:
            return
        import ray

        from verl.trainer.ppo.utils import Role

        from verl_traj.integration.workers import TrajCriticWorker, traj_actor_worker

        for role, cls in list(self.role_worker_mapping.items()):
            if role == Role.Critic:
                self.role_worker_mapping[role] = ray.remote(TrajCriticWorker)
            elif role in (Role.Actor, Role.ActorRollout, Role.ActorRolloutRef):
                self.role_worker_mapping[role] = ray.remote(traj_actor_worker(cls.__ray_actor_class__))

    def _setup(self):
        super()._setup()
        if self.traj_config.enable and self.use_critic:
            from verl_traj.integration.losses import install_value_loss

            install_value_loss(self.critic_wg, self.config.critic)

    def _fetch_one_gen_batch(self):
        """verl's, with prompt uids from (``data.seed``, step, position) instead of ``uuid4``: a seeded run plans
        the same batches again (rows are planned in key order)."""
        batch = super()._fetch_one_gen_batch()
        from verl.utils import tensordict_utils as tu

        step, drawn = self._uid_draws if self._uid_draws[0] == self.global_steps else (self.global_steps, 0)
        seed = self.config.data.get("seed", None)
        uids = [str(uuid.uuid5(_UID_NAMESPACE, f"{seed}/{step}/{drawn + i}")) for i in range(len(batch))]
        tu.assign_non_tensor_stack(batch, "uid", uids)
        self._uid_draws = (step, drawn + len(uids))
        return batch

    # ---- planning ----------------------------------------------------------------------------------

    def _traj_dp_size(self) -> int:
        return check_same_dp_size(_dispatch_dp_size(self.actor_rollout_wg, "actor"),
                                  _dispatch_dp_size(self.critic_wg, "train") if self.use_critic else None)

    def _balance_batch(self, batch: Any, metrics: dict, logging_prefix: str = "global_seqlen",
                       keep_minibatch: bool = False) -> Any:
        if not self.traj_config.enable:
            batch = super()._balance_batch(batch, metrics, logging_prefix=logging_prefix,
                                           keep_minibatch=keep_minibatch)
            metrics.update(self._stock_plan_metrics(batch))
            return batch
        import transfer_queue as tq

        batch.reorder(sorted(range(len(batch)), key=lambda i: row_key_order(batch.keys[i])))
        metrics.update(stepwise_metrics(batch.tags))
        plan, layout = self._plan(batch)
        pad_keys, pad_tags = _write_padding_rows(batch, int(plan.is_padding.sum()), self.tokenizer.eos_token_id,
                                                 self.spec.plan.pad_row_tokens)
        out = _ordered_batch(batch, plan, pad_keys, pad_tags)
        tq.kv_batch_put(keys=out.keys, partition_id=out.partition_id, fields=TensorDict(
            {MINI_BATCH_ID: plan.mini_batch_id, MICRO_BATCH_ID: plan.micro_batch_id}, batch_size=[plan.num_rows]))
        self._planned = plan_facts(out, plan, layout)
        self._padding_by_key.update(zip(out.keys, plan.is_padding.tolist()))
        metrics.update(plan_step_metrics(plan, self.spec.epochs))
        self._debug_dump(out, plan, layout)
        return out

    def _plan(self, batch: Any) -> tuple[MiniBatchPlan, Any]:
        import transfer_queue as tq

        keys = parse_row_keys(batch.keys)
        seq_len = torch.tensor([int(t["seq_len"]) for t in batch.tags], dtype=torch.int64)
        mask = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=["response_mask"])
        layout = build_layout_from_counts(seq_len, row_loss_tokens(mask["response_mask"]), keys.uid,
                                          traj_id=keys.traj_id, step_index=keys.step)
        plan = plan_layout(layout, self.traj_config, self.spec.num_mini_batches, self._traj_dp_size(), micro=self.spec.plan,
                           seed=self.spec.plan_seed(self.global_steps, self.local_trigger_step))
        return plan, layout

    def _stock_plan_metrics(self, batch: Any) -> dict[str, float]:
        keys = parse_row_keys(batch.keys)
        pad = np.array([bool(t.get("is_padding", False)) for t in batch.tags])
        return stock_plan_metrics_of(self.config, keys.uid, keys.traj_id, pad, _dispatch_dp_size(self.actor_rollout_wg, "actor"))

    def _debug_dump(self, batch: Any, plan: MiniBatchPlan, layout: Any) -> None:
        src = plan.order.clamp(min=0)
        loss_tokens = torch.where(plan.is_padding, 0, layout.num_loss_tokens[src])
        keys = parse_row_keys(batch.keys)
        debug_dump(int(self.global_steps), plan, {
            "uid": keys.uid.tolist(), "traj_id": keys.traj_id.tolist(), "loss_tokens": loss_tokens.tolist(),
            "response_length": [int(t["response_len"]) for t in batch.tags],
            "attention_length": [int(t["seq_len"]) for t in batch.tags],
        })

    # ---- after planning ----------------------------------------------------------------------------

    def _compute_advantage(self, batch: Any, metrics: dict) -> Any:
        if not self.traj_config.enable:
            return super()._compute_advantage(batch, metrics)
        from verl_traj.integration.patches import v1_advantage_patches

        rows = self._planned
        rows.check(batch.keys)
        scoped = self.traj_config.step_wise and self.traj_config.ratio_scope == "trajectory"
        with patched(v1_advantage_patches(planned_advantage(rows), trajectory_correction(rows) if scoped else None)):
            return super()._compute_advantage(batch, metrics)

    def _put_loss_weights(self, batch: Any, loss: LossSpec, ratio_groups: bool = False) -> None:
        """``loss_weight`` of every row for one update, from the final ``response_mask`` (rollout correction may
        have changed it) and the plan; with ``ratio_groups`` also each row's trajectory as ``ratio_group``."""
        import transfer_queue as tq

        rows = self._planned
        rows.check(batch.keys)
        mask = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id,
                               select_fields=["response_mask"])["response_mask"]
        dense = mask.to_padded_tensor(0) if mask.is_nested else mask
        fields = {LOSS_WEIGHT: loss.weights(dense, rows.mini_batch_id, rows.traj_index, rows.is_padding)}
        if ratio_groups:
            fields[RATIO_GROUP] = rows.traj_index.clone()
        tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id,
                        fields=TensorDict(fields, batch_size=[len(batch)]))
        if batch.fields is not None:  # the workers read the meta's field list: name the new fields in it
            batch.fields = list(dict.fromkeys([*batch.fields, *fields]))

    def _update_critic(self, batch: Any, metrics: dict) -> Any:
        if not self.traj_config.enable:
            return super()._update_critic(batch, metrics)
        self._put_loss_weights(batch, self.spec.critic_loss)
        if self.spec.critic_union > 1:
            batch.extra_info[CRITIC_UNION_KEY] = self.spec.critic_union
        try:
            return super()._update_critic(batch, metrics)
        finally:
            batch.extra_info.pop(CRITIC_UNION_KEY, None)

    def _update_actor(self, batch: Any, metrics: dict) -> Any:
        if not self.traj_config.enable:
            return super()._update_actor(batch, metrics)
        self._put_loss_weights(batch, self.spec.actor_loss, ratio_groups=self.spec.ratio_groups)
        return super()._update_actor(batch, metrics)

    def _real_rows_of_step(self, keys: list[str]) -> np.ndarray:
        """``[B]`` bool: the real rows of a step's batch. One global step may run several local updates
        (``parameter_sync_step > 1``), each planned; the step's batch holds all their rows, so the padding flag is
        read from every plan since the last step's metrics, by key (then forgotten)."""
        missing = [k for k in keys if k not in self._padding_by_key]
        if missing:
            raise RuntimeError(f"{len(missing)} rows of the step's batch (first: {missing[0]!r}) were not planned by "
                               "_balance_batch: something replaced rows after planning. verl_traj needs the planned rows.")
        real = ~np.array([self._padding_by_key[k] for k in keys], dtype=bool)
        self._padding_by_key = {}
        return real

    def _compute_metrics(self, batch: Any, metrics: dict, timing_raw: dict, global_steps: int, epoch: int) -> None:
        metrics.update(trajectory_metrics(batch, global_steps))
        if not self.traj_config.enable:
            return super()._compute_metrics(batch, metrics, timing_raw, global_steps, epoch)
        from verl_traj.integration.patches import v1_metric_patches

        real = self._real_rows_of_step(batch.keys)
        with patched(v1_metric_patches(lambda: real)):
            return super()._compute_metrics(batch, metrics, timing_raw, global_steps, epoch)
