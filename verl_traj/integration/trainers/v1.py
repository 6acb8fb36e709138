"""verl_traj on verl's v1 trainer (``trainer.use_v1=true``, verl 0.9's default): the same core planner, workers
and losses as on v0, behind one mixin, :class:`TrajV1Mixin`.

v1 keeps a batch in TransferQueue (TQ): the trainer holds a ``KVBatchMeta`` (row keys and per-row tags), the
workers pull the stored fields the meta names; the plan's own per-row fields travel with each call. A row key is ``{uid}_{session}_{index}``: ``uid`` is the prompt (the
GRPO group), ``{uid}_{session}`` one trajectory (``rollout.n`` sessions per prompt), ``index`` the row's step among
the session's agent-loop outputs (several outputs per session come from verl_traj's step-wise rows,
:mod:`~verl_traj.integration.agent_loops.v1_agent_loop`, or from any v1 agent loop that returns
``list[AgentLoopOutput]``).

With ``traj.enable=true`` every mode's trainer (``sync``, ``colocate_async``, ``separate_async`` and any mode
registered later) runs as ``Traj<Class>(TrajV1Mixin, Class)`` (:func:`traj_trainer_class`, installed by the task
runner for its lifetime). The mixin overrides only what differs from verl; each override names the module of this
folder (``verl_traj.integration.trainers``) or another that does the work:

==========================  ==================================================================================
method                      what changes (module)
==========================  ==================================================================================
``_balance_batch``          verl's LCM upsampling + Karmarkar-Karp replaced by the core's plan: layout from keys,
                            tags, padding rows written, meta in dispatch order (``v1_planning``, ``v1_padding``);
                            the plan's facts and worker fields kept here (``v1_plan_facts``)
``_compute_advantage``      verl's own, with its advantage call being ``v1_advantage.planned_advantage`` (real
                            rows; one outcome per trajectory, or a temporal estimator on its timeline of rows)
``_update_critic`` /        verl's own, the update's contract (``update_contract``) and the plan's fields shipped to
``_update_actor``           each rank (``v1_updates``: ``loss_weight`` from loss-token counts)
``_compute_old_log_prob``,  verl's own; with ``traj.prefix_tree`` the call is marked and ships the plan's fields,
``_compute_ref_log_prob``,  so the workers forward its micro-batches as prefix trees
``_compute_values``         (``integration.tree.tree_forward``; the updates likewise)
``_compute_metrics``        per-trajectory metrics (``v1_metrics``); verl's own handed the step's real rows
``_build_replay_buffer``,   verl's own, building the buffer and the agent loops' client as verl_traj's subclasses
``get_llm_client``          (``integration.async_modes``: failed and stale groups, each token's policy version)
set-up                      the worker class of each role from the entry (``workers.engine_workers.traj_role_worker``),
                            seeded prompt uids
==========================  ==================================================================================

With ``traj.enable=false`` the mixin stays in the MRO but inactive (every override calls verl's, verl's own workers
run); ``stock_plan/*`` metrics then observe what verl's fixed-size mini-batches do to groups.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import uuid
from typing import Any, Callable, Optional

import numpy as np
import ray

from verl.trainer.ppo.utils import Role
from verl.trainer.ppo.v1.trainer_base import PPOTrainer
from verl.utils import tensordict_utils as tu

from verl_traj.core import BatchLayout, MiniBatchPlan
from verl_traj.core.rollout.offpolicy import HealthGate
from verl_traj.core.rollout.row_key import parse_row_keys
from verl_traj.core.trees.token_rows import TokenRows
from verl_traj.integration.async_modes.v1_failures import FailedGroupPolicy, group_policy_class, with_group_policies
from verl_traj.integration.async_modes.correction import correction_threshold
from verl_traj.integration.async_modes.v1_staleness import StaleGroupPolicy, recording_client_class
from verl_traj.integration.config.update_spec import UpdateSpec
from verl_traj.integration.config.verl_config import prepare_v1_agent_loop
from verl_traj.integration.patches.scoped import (llm_client_patches, patched, replay_buffer_patches,
                                                  v1_advantage_patches)
from verl_traj.integration.rows.credit import load_rules
from verl_traj.integration.startup.tree_checks import settled_traj_config
from verl_traj.integration.trainers.checkpoints import CompleteCheckpoints
from verl_traj.integration.trainers.step_plan import (check_same_dp_size, debug_dump, plan_layout, plan_step_metrics,
                                                      stock_plan_metrics_of)
from verl_traj.integration.trainers.update_contract import ACTOR, CRITIC, pass_markers
from verl_traj.integration.trainers.v1_advantage import (PutWithTreeParts, corrected_per_trajectory,
                                                         kl_penalty_on_planned_rows, planned_advantage)
from verl_traj.integration.trainers.v1_metrics import (RolloutBusy, StepPadding, length_bias_metrics, length_budget,
                                                       offpolicy_metrics, stepwise_metrics, trajectory_metrics)
from verl_traj.integration.trainers.v1_padding import padding_ids, write_padding_rows
from verl_traj.integration.trainers.v1_plan_facts import StepFacts, plan_facts
from verl_traj.integration.trainers.v1_planning import (debug_rows, dispatch_dp_size, in_key_order, ordered_batch,
                                                        plan_row_fields, read_layout, read_tree_rows, row_length)
from verl_traj.integration.trainers.v1_updates import extra_info, planned_pass, planned_update
from verl_traj.stepwise.step_groups import StepGroupOptions

__all__ = ["TrajV1Mixin", "reuses_old_log_probs", "traj_trainer_class"]

ROLLOUT_POOLS = (("hybrid", "llm_server_manager"), ("standalone", "standalone_server_manager"))
_UID_NAMESPACE = uuid.UUID("5f3c1d52-6a1e-4c8e-9a57-1c0a3e5b7d11")


RoleWorker = Callable[[Role, type], Optional[type]]  # (role, verl's worker class) -> verl_traj's, or None: verl's


@functools.lru_cache(maxsize=None)
def traj_trainer_class(verl_cls: type, role_worker: Optional[RoleWorker] = None) -> type:
    """``Traj<Name>(TrajV1Mixin, verl_cls)`` for a registered v1 trainer class (one class per input).
    ``role_worker``: the worker class each role runs (the entry passes
    :func:`~verl_traj.integration.workers.engine_workers.traj_role_worker`: driver code imports no worker module);
    required to start workers with ``traj.enable=true``."""
    return type(f"Traj{verl_cls.__name__}", (TrajV1Mixin, verl_cls),
                {"__module__": __name__, "_traj_role_worker": staticmethod(role_worker) if role_worker else None})


class TrajV1Mixin(CompleteCheckpoints):
    """verl_traj's part of a v1 trainer (first base; see the module docstring). Inactive with ``traj.enable=false``
    but for the ``stock_plan/*`` observer metrics and what pairs a stock run with a verl_traj run of the same seed:
    seeded prompt uids and one request priority per session (neither changes what is trained)."""

    _traj_role_worker: Optional[RoleWorker] = None  # set by traj_trainer_class

    def __init__(self, config: Any):
        self.traj_config = settled_traj_config(config)
        load_rules(self.traj_config.credit_rule_modules)  # this process knows every per-call credit rule
        self.spec = (dataclasses.replace(UpdateSpec.prepare(config, self.traj_config),
                                         reuses_old_log_probs=reuses_old_log_probs(type(self)))
                     if self.traj_config.enable else None)
        if not self.traj_config.enable:  # the agent-loop manager that gives each session its request priority
            prepare_v1_agent_loop(config, self.traj_config)
        self._step_facts = StepFacts()  # the facts of the local update planned last
        self._step_padding = StepPadding()  # every row planned since the last step's metrics
        self._uid_draws = (-1, 0)  # (global step, prompts drawn in it): deterministic uids
        self._rollout_busy = RolloutBusy()  # rollout_pool/*_busy_share
        self._length_budget = length_budget(config) if self.traj_config.enable else None  # traj_bias/*'s lower end
        super().__init__(config)

    def _init_resource_pool_mgr(self):
        if self.traj_config.enable and self._traj_role_worker is None:
            raise RuntimeError(f"{type(self).__name__} was built without verl_traj's worker classes, so its updates "
                               "would run on verl's workers, which ignore the plan: build it with "
                               "traj_trainer_class(verl_cls, traj_role_worker), as verl_traj.main_ppo does.")
        super()._init_resource_pool_mgr()
        if not self.traj_config.enable:
            return
        for role, cls in list(self.role_worker_mapping.items()):
            traj_cls = self._traj_role_worker(role, cls.__ray_actor_class__)
            if traj_cls is not None:
                self.role_worker_mapping[role] = ray.remote(traj_cls)

    def _build_replay_buffer(self):
        """verl's, built as verl_traj's subclass of the class verl picks: ``traj.failed_groups`` decides which failed
        groups leave the batch (:mod:`~verl_traj.integration.async_modes.v1_failures`) and ``traj.max_staleness``
        which stale ones (:mod:`~verl_traj.integration.async_modes.v1_staleness`)."""
        if not self.traj_config.enable:
            return super()._build_replay_buffer()
        with patched(replay_buffer_patches(group_policy_class)):
            buffer = super()._build_replay_buffer()
        return with_group_policies(buffer, self.traj_config, int(self.config.actor_rollout_ref.rollout.n))

    def get_llm_client(self):
        """verl's, built as verl_traj's subclass of the class the mode asks for: each generate attempt's policy
        version recorded (``traj_version/*``, ``traj.max_staleness``)."""
        if not self.traj_config.enable:
            return super().get_llm_client()
        managers = [m for _, name in ROLLOUT_POOLS if (m := getattr(self, name, None)) is not None]
        with patched(llm_client_patches(managers, recording_client_class)):
            return super().get_llm_client()

    def _fetch_one_gen_batch(self):
        """verl's, with prompt uids from (``data.seed``, step, position) instead of ``uuid4``: a seeded run plans
        the same batches again (rows are planned in key order)."""
        batch = super()._fetch_one_gen_batch()
        step, drawn = self._uid_draws if self._uid_draws[0] == self.global_steps else (self.global_steps, 0)
        seed = self.config.data.get("seed", None)
        uids = [str(uuid.uuid5(_UID_NAMESPACE, f"{seed}/{step}/{drawn + i}")) for i in range(len(batch))]
        tu.assign_non_tensor_stack(batch, "uid", uids)
        self._uid_draws = (step, drawn + len(uids))
        return batch

    def _traj_dp_size(self) -> int:
        return check_same_dp_size(dispatch_dp_size(self.actor_rollout_wg, "actor"),
                                  dispatch_dp_size(self.critic_wg, "train") if self.use_critic else None)

    def _balance_batch(self, batch: Any, metrics: dict, logging_prefix: str = "global_seqlen",
                       keep_minibatch: bool = False) -> Any:
        """The core's plan instead of verl's balancing; returns the planned meta (rank-major, padding included)."""
        if not self.traj_config.enable:
            batch = super()._balance_batch(batch, metrics, logging_prefix=logging_prefix,
                                           keep_minibatch=keep_minibatch)
            metrics.update(self._stock_plan_metrics(batch))
            return batch
        batch = in_key_order(batch)
        metrics.update(stepwise_metrics(batch.tags))
        layout = read_layout(batch)
        rows = read_tree_rows(batch) if self.traj_config.trees else None
        plan = self._plan(layout, rows)
        pad_keys, pad_tags = write_padding_rows(batch, int(plan.is_padding.sum()), self.tokenizer.eos_token_id,
                                                self.spec.plan.pad_row_tokens)
        out = ordered_batch(batch, plan, pad_keys, pad_tags)
        fields, trees = plan_row_fields(plan, rows, self.spec.plan.tree_cost,
                                        padding_ids(self.tokenizer.eos_token_id, self.spec.plan.pad_row_tokens).numpy())
        self._step_facts.planned(plan_facts(out, plan, layout, fields, row_length(out)))
        self._step_padding.record(out.keys, plan.is_padding.tolist())
        metrics.update(plan_step_metrics(plan, self.spec.epochs), **trees)
        debug_dump(int(self.global_steps), plan, debug_rows(out, plan, layout))
        return out

    def _plan(self, layout: BatchLayout, rows: Optional[TokenRows] = None) -> MiniBatchPlan:
        return plan_layout(layout, self.traj_config, self.spec.num_mini_batches, self._traj_dp_size(),
                           micro=self.spec.plan, seed=self.spec.plan_seed(self.global_steps, self.local_trigger_step),
                           rows=rows)

    def _stock_plan_metrics(self, batch: Any) -> dict[str, float]:
        keys = parse_row_keys(batch.keys)
        pad = np.array([bool(t.get("is_padding", False)) for t in batch.tags])
        return stock_plan_metrics_of(self.config, keys.uid, keys.traj_id, pad,
                                     dispatch_dp_size(self.actor_rollout_wg, "actor"))

    def _compute_advantage(self, batch: Any, metrics: dict) -> Any:
        """verl's ``_compute_advantage`` (fetch, KL-in-reward, rollout correction, advantage, write back) with its
        advantage being :func:`~verl_traj.integration.trainers.v1_advantage.planned_advantage` of this batch's plan
        facts, and for step rows at ``traj.ratio_scope=trajectory`` its rollout correction per trajectory."""
        if not self.traj_config.enable:
            return super()._compute_advantage(batch, metrics)
        facts = self._step_facts.of(batch)
        correction = functools.partial(corrected_per_trajectory, facts) if self.spec.trajectory_ratios else None
        advantage = functools.partial(planned_advantage, facts, step_groups=StepGroupOptions.of(self.traj_config),
                                      hand_on=self._step_facts.hand_on)
        kl_penalty = functools.partial(kl_penalty_on_planned_rows, facts)  # KL-in-reward on real rows
        put = functools.partial(PutWithTreeParts, facts=lambda: self._step_facts.current)  # a tree's parts too
        with patched(v1_advantage_patches(advantage, correction, kl_penalty=kl_penalty, put=put)):
            out = super()._compute_advantage(batch, metrics)
        if self._step_facts.current is facts:
            raise RuntimeError("verl's _compute_advantage did not run verl_traj's planned advantage (the patch of "
                               "compute_advantage_for_multi_trajectories): the loss weights would count the planned "
                               "loss tokens, not the corrected ones")
        metrics.update(self._step_facts.current.advantage_metrics)
        return out

    def _update_critic(self, batch: Any, metrics: dict) -> Any:
        if not self.traj_config.enable:
            return super()._update_critic(batch, metrics)
        with planned_update(batch, self._step_facts, self.spec, CRITIC, self._traj_dp_size()), \
                self._trees(batch, rows=False):
            return super()._update_critic(batch, metrics)

    def _compute_values(self, batch: Any, metrics: dict) -> Any:
        with self._trees(batch):
            return super()._compute_values(batch, metrics)

    def _update_actor(self, batch: Any, metrics: dict) -> Any:
        if not self.traj_config.enable:
            return super()._update_actor(batch, metrics)
        local_step = int(getattr(self, "local_trigger_step", 0))
        with planned_update(batch, self._step_facts, self.spec, ACTOR, self._traj_dp_size(), local_step), \
                self._trees(batch, rows=False):
            return super()._update_actor(batch, metrics)

    def _compute_old_log_prob(self, batch: Any, metrics: dict) -> Any:
        with self._trees(batch):
            batch = super()._compute_old_log_prob(batch, metrics)
        if self.trainer_mode != "sync" and self.config.actor_rollout_ref.rollout.calculate_log_probs:
            correcting = self.traj_config.enable and self.traj_config.stale_groups == "correct"
            # did the last weight sync arrive? and under correct: the weights' health, which moves the gate
            found = offpolicy_metrics(batch, int(self.global_steps),
                                      correction_threshold(self.config) if correcting else None)
            metrics.update({**found, **(self.replay_buffer.observe_health(found) if correcting else {})})
        return batch

    def _compute_ref_log_prob(self, batch: Any, metrics: dict) -> Any:
        with self._trees(batch):
            return super()._compute_ref_log_prob(batch, metrics)

    def _trees(self, batch: Any, rows: bool = True) -> Any:
        """The pass's markers (:func:`~verl_traj.integration.trainers.update_contract.pass_markers`: with trees every
        pass runs the plan's micro-batches) in the meta's ``extra_info`` for one call, each pass marked (verl rebuilds
        the meta between passes); ``rows``: an inference pass, which ships the plan's fields too (updates do)."""
        markers = pass_markers(self.spec) if self.spec is not None else {}
        if not markers or not rows:
            return extra_info(batch, markers) if markers else contextlib.nullcontext()
        return planned_pass(batch, self._step_facts, markers, self._traj_dp_size())

    def _traj_checkpoint_state(self) -> dict:  # correct's gate resumes where it was
        gated = isinstance(getattr(self, "replay_buffer", None), StaleGroupPolicy)
        return {"health_gate": self.replay_buffer.health_gate.state_dict()} if gated else {}

    def _restore_traj_checkpoint_state(self, state: dict) -> None:
        if isinstance(getattr(self, "replay_buffer", None), StaleGroupPolicy) and "health_gate" in state:
            self.replay_buffer.restore_health(HealthGate.from_state(state["health_gate"]))

    def _compute_metrics(self, batch: Any, metrics: dict, timing_raw: dict, global_steps: int, epoch: int) -> None:
        metrics.update(trajectory_metrics(batch, global_steps))
        metrics.update(self._rollout_busy.metrics({name: getattr(getattr(self, manager, None), "server_handles", [])
                                                   for name, manager in ROLLOUT_POOLS}))
        if not self.traj_config.enable:
            return super()._compute_metrics(batch, metrics, timing_raw, global_steps, epoch)
        cut = self.replay_buffer.cut_lengths.take() if isinstance(self.replay_buffer, FailedGroupPolicy) else {}
        metrics.update(length_bias_metrics(batch, cut, self._length_budget))  # traj_bias/*: trained vs let go
        # verl's metrics of the step's real rows: verl drops rows tagged is_padding from most of them, but its timing
        # and throughput count every row it is handed, so it is handed the real ones
        real = self._step_padding.real_rows(batch.keys)
        real_batch = batch.select_keys([key for key, keep in zip(batch.keys, real) if keep])
        return super()._compute_metrics(real_batch, metrics, timing_raw, global_steps, epoch)


def reuses_old_log_probs(trainer_cls: type) -> bool:
    """Whether ``trainer_cls``'s later local updates of a weight-sync cycle reuse the first's old log-probs: verl's
    base ``_compute_old_log_prob`` recomputes them right before every local update; a mode that overrides it
    (``separate_async`` keeps the first local step's weights for the later ones) reuses them. The mixin's own
    override only marks the pass for prefix trees."""
    verl_defining = next(c for c in trainer_cls.__mro__
                         if "_compute_old_log_prob" in vars(c) and not issubclass(TrajV1Mixin, c))
    return verl_defining is not PPOTrainer
