"""The driver benchmark's phases: what runs on verl's driver between rollout and update, timed one phase at a time
with its peak memory (psutil RSS sampled every 2 ms by a thread: the phase's peak minus its starting RSS).

* ``stock`` (verl 0.9.1, v0 ``RayPPOTrainer``): ``_balance_batch`` (Karmarkar-Karp over DP ranks, ``batch.reorder``),
  ``compute_advantage`` (GRPO over rows), the end-of-step metrics (data, timing, throughput).
* ``traj`` (``TrajRayPPOTrainer._balance_batch`` split into its calls, then the ``fit`` patches): step-row expansion
  (prefix merging inside it with ``traj.merge_prefix``), layout, plan, ``apply_plan``, prefix-tree facts
  (``traj.prefix_tree``), advantages (GRPO per trajectory, or GiGPO's step groups), loss weights, metrics on real rows.

Each phase is called as production calls it (the same functions, in ``plan_batch_in_place``'s order).
"""

from __future__ import annotations

import contextlib
import gc
import io
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import psutil
from omegaconf import OmegaConf
from tensordict import TensorDict

__all__ = ["Meter", "Variant", "step_rows", "stock_run", "traj_run", "traj_trainer"]


@dataclass(frozen=True)
class Variant:
    """One row of the table: which driver (``stock`` / ``traj``), on which rows (``merged``: one row per trajectory;
    ``step``: one row per LLM call), with which estimator, and whether prefix trees are planned."""

    driver: str
    rows: str
    estimator: str = "grpo"
    tree: bool = False

    @property
    def name(self) -> str:
        rows = {"merged": "merged rows" if self.driver == "traj" else "trajectory rows", "step": "step rows"}[self.rows]
        return f"{self.driver} {rows} {self.estimator}" + (" +tree" if self.tree else "")


@dataclass
class Meter:
    """Seconds and peak RSS growth (bytes) per phase, plus facts (row counts, plan metrics)."""

    seconds: dict = field(default_factory=dict)
    peak_bytes: dict = field(default_factory=dict)
    facts: dict = field(default_factory=dict)

    @contextmanager
    def phase(self, name: str):
        gc.collect()
        proc, peak, stop = psutil.Process(), [0], threading.Event()
        start = proc.memory_info().rss

        def sample():
            while not stop.is_set():
                peak[0] = max(peak[0], proc.memory_info().rss)
                stop.wait(0.002)

        thread = threading.Thread(target=sample, daemon=True)
        thread.start()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = time.perf_counter() - t0
            stop.set()
            thread.join()
            self.peak_bytes[name] = max(peak[0], proc.memory_info().rss) - start


def _as_dataproto(tensors: dict, non_tensors: dict):
    from verl import DataProto

    return DataProto.from_dict(tensors=dict(tensors), non_tensors=dict(non_tensors))


def _rewarded(batch) -> None:
    """What ``fit`` holds before the advantage (reward extracted; tokens counted after ``_balance_batch``)."""
    td = batch.batch
    td["token_level_scores"] = td["rm_scores"].clone()
    td["token_level_rewards"] = td["rm_scores"].clone()
    batch.meta_info["global_token_num"] = td["attention_mask"].sum(-1).tolist()


def _metrics(rt, batch) -> None:
    rt.compute_data_metrics(batch=batch, use_critic=False)
    rt.compute_timing_metrics(batch=batch, timing_raw={"step": 1.0, "gen": 0.5})
    rt.compute_throughout_metrics(batch=batch, timing_raw={"step": 1.0}, n_gpus=8)


def _stock_trainer(dp: int):
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    tr = RayPPOTrainer.__new__(RayPPOTrainer)
    tr._get_dp_size = lambda wg, role: dp
    tr.actor_rollout_wg = None
    tr.config = OmegaConf.create({"actor_rollout_ref": {"actor": {"ppo_mini_batch_size": 1}}})
    return tr


def step_rows(tensors: dict, non_tensors: dict, merge: bool, anchors: bool) -> dict:
    """The expansion's output as a ``DataProto`` (stock's step rows: what verl's trainer would get one row per call)."""
    from verl_traj.integration.rows.stepwise_rows import expand_dataproto_step_rows

    batch = _as_dataproto(tensors, non_tensors)
    expand_dataproto_step_rows(batch, merge_prefix=merge, step_anchors=anchors)
    return batch


def stock_run(batch, args, meter: Meter) -> None:
    """verl's own driver work on ``batch`` (its row count trimmed to a multiple of dp: verl's dispatch needs it)."""
    from verl.trainer.ppo import ray_trainer as rt
    from verl.trainer.ppo.core_algos import AdvantageEstimator

    keep = batch.batch.batch_size[0] // args.dp * args.dp
    if keep < batch.batch.batch_size[0]:
        batch = batch[:keep]
    meter.facts["rows"] = keep
    with meter.phase("balance"):
        rt.RayPPOTrainer._balance_batch(_stock_trainer(args.dp), batch, {})
    _rewarded(batch)
    with meter.phase("advantage"):
        rt.compute_advantage(batch, adv_estimator=AdvantageEstimator.GRPO, num_repeat=args.n,
                             config=OmegaConf.create({}))
    with meter.phase("metrics"):
        _metrics(rt, batch)


def traj_trainer(args, v: Variant):
    """``TrajRayPPOTrainer`` as production builds it (verl's prints of its dataloaders kept off stdout: --json)."""
    from verl_traj.integration.config.verl_config import PlanSettings
    from verl_traj.testing.trainers import ray_less_trainer

    groups = args.prompts
    with contextlib.redirect_stdout(io.StringIO()):
        return ray_less_trainer({"data": {"train_batch_size": groups}, "algorithm": {"adv_estimator": v.estimator},
                                 "actor_rollout_ref": {"rollout": {"n": args.n},
                                                       "actor": {"ppo_mini_batch_size": groups // args.mini_batches,
                                                                 "ppo_epochs": 1}}},
                                {"step_wise": True, "merge_prefix": v.rows == "merged", "prefix_tree": v.tree},
                                plan=PlanSettings(args.cap, "tokens", True), dp=args.dp)


def _plan(tr, batch, args, meter: Meter):
    """``plan_batch_in_place``'s calls, one phase each."""
    from verl_traj.core import apply_plan, build_layout
    from verl_traj.core.keys import IS_LAST_STEP
    from verl_traj.integration.trainers.step_plan import plan_layout
    from verl_traj.integration.trainers.v0 import attended_rows
    from verl_traj.integration.trainers.tree_plan_facts import row_tree_facts

    cfg, nt = tr.spec.traj_config, batch.non_tensor_batch
    with meter.phase("layout"):
        layout = build_layout(batch.batch["attention_mask"], batch.batch["response_mask"], nt["uid"],
                              traj_id=nt[cfg.traj_id_key], step_index=nt[cfg.step_index_key],
                              is_last_step=nt.get(IS_LAST_STEP))
    with meter.phase("plan"):
        rows = attended_rows(batch.batch["input_ids"], batch.batch["attention_mask"]) if cfg.trees else None
        plan = plan_layout(layout, cfg, tr.spec.num_mini_batches, args.dp, micro=tr.spec.plan, seed=0, rows=rows)
    with meter.phase("apply"):
        out_t, out_nt = apply_plan(dict(batch.batch.items()), dict(nt), plan, pad_token_id=0,
                                   traj_key=cfg.traj_id_key, step_key=cfg.step_index_key)
        batch.batch = TensorDict(out_t, batch_size=[plan.num_rows])
        batch.non_tensor_batch = out_nt
        del out_t
    if cfg.trees:
        with meter.phase("tree_facts"):  # as plan_batch_in_place: the planner's rows by plan.order, padding read
            pads = np.flatnonzero(plan.order.numpy() < 0)
            pad_rows = attended_rows(batch.batch["input_ids"][pads], batch.batch["attention_mask"][pads])
            for key, value in row_tree_facts(rows, pad_rows, plan, tr.spec.plan.tree_cost)[0].items():
                batch.batch[key] = value
    del rows
    return plan


def traj_run(tensors: dict, non_tensors: dict, args, v: Variant, meter: Meter) -> None:
    """verl_traj's driver work from the rollout batch (one row per trajectory, its calls recorded)."""
    from verl.trainer.ppo import ray_trainer as rt

    from verl_traj.core import compute_loss_weights
    from verl_traj.integration.patches.scoped import fit_patches, patched
    from verl_traj.integration.rows.stepwise_rows import expand_dataproto_step_rows
    from verl_traj.stepwise.step_groups import StepGroupOptions

    tr = traj_trainer(args, v)
    batch = _as_dataproto(tensors, non_tensors)
    with meter.phase("expand"):
        expand_dataproto_step_rows(batch, merge_prefix=v.rows == "merged", step_anchors=v.estimator == "gigpo")
    meter.facts["rows"] = int(batch.batch.batch_size[0])
    meter.facts["width"] = int(batch.batch["input_ids"].shape[1])
    plan = _plan(tr, batch, args, meter)
    meter.facts["plan_internal_s"] = {k: round(x, 4) for k, x in plan.timing_s.items()}
    meter.facts["plan_metrics"] = plan.metrics("traj_plan")
    real = ~plan.is_padding.numpy()
    _rewarded(batch)
    with patched(fit_patches(True, lambda: real, "step_index", False, StepGroupOptions())):
        with meter.phase("advantage"):
            rt.compute_advantage(batch, adv_estimator=v.estimator, num_repeat=args.n, config=OmegaConf.create({}))
        td = batch.batch
        with meter.phase("loss_weights"):
            compute_loss_weights("token-mean", td["response_mask"], td["mini_batch_id"], td["traj_index"],
                                 td["is_padding"])
        with meter.phase("metrics"):
            _metrics(rt, batch)
