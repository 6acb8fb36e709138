"""Everything verl_traj replaces inside verl's modules, in one place, with the order written out.

verl looks some functions up as module globals at call time (``ray_trainer.compute_advantage``, the
metric functions, ``main_ppo_v0.RayPPOTrainer``, ``tensordict_utils.make_iterator``, the engines'
``prepare_micro_batches``). Where a subclass cannot reach a decision, verl_traj swaps such a global for
the duration of one call and restores it on exit (also on error), with :func:`patched`. Nothing stays
behind on a verl module: no attribute is added, every replaced name gets its original back.

The patch sets, each in the order it is installed (a later patch of the same name wraps the earlier):

* :func:`fit_patches` -- driver, during ``TrajRayPPOTrainer.fit``:
  1. ``ray_trainer.compute_advantage`` <- step-wise advantages (``traj.step_wise`` only): an outcome
     estimator once per trajectory, broadcast to each step row, or a temporal one on each trajectory's timeline of
     rows (innermost: it needs the real rows); with ``traj.ratio_scope=trajectory`` also
     ``rollout_corr_helper.compute_rollout_correction_and_add_to_batch`` <- verl's rollout correction per trajectory;
  2. ``ray_trainer.compute_advantage`` <- real rows only (wraps 1, or verl's own);
  3. ``ray_trainer.apply_kl_penalty`` <- real rows only;
  4. ``ray_trainer.extract_reward`` <- padding rows' rewards 0;
  5. ``ray_trainer.compute_data_metrics``, ``compute_timing_metrics``, ``compute_throughout_metrics``,
     ``compute_variance_proxy_metrics`` <- real rows only, one shared copy per step;
  6. ``ray_trainer.compute_spec_decode_metrics`` <- the current batch's real-row mask.
* :func:`task_runner_patches` -- task runner, during ``TrajTaskRunner.run``:
  ``main_ppo_v0.RayPPOTrainer`` <- ``TrajRayPPOTrainer`` (verl's runner wiring runs unchanged).
* :func:`v1_task_runner_patches` -- task runner, during ``TrajTaskRunnerV1.run`` (``trainer.use_v1=true``):
  ``verl.trainer.ppo.v1.get_trainer_cls`` <- the registered class with
  :class:`~verl_traj.integration.trainers.v1.TrajV1Mixin` first (every mode, under its own name: v1 reads meaning from
  the mode name).
* :func:`v1_advantage_patches` -- driver, during one ``TrajV1Mixin._compute_advantage``:
  1. ``trainer_base.compute_advantage_for_multi_trajectories`` <- the planned batch's advantage (real rows, one
     outcome per trajectory);
  2. ``trainer_base.apply_kl_penalty`` <- real rows only (v0's wrapper, after the plan's facts are attached: v1
     imports verl's function by name, so patch 3 of :func:`fit_patches` never reaches it);
  3. with step rows and ``traj.ratio_scope=trajectory`` also
     ``trainer_base.compute_rollout_correction_and_add_to_batch`` <- verl's rollout correction per trajectory;
  4. ``trainer_base.tq`` <- the same module, whose put of the advantages also puts a branching session's parts
     (``traj_advantages_negative``, ``traj_path_copies``) where the step has them.
* :func:`replay_buffer_patches` -- driver, during ``TrajV1Mixin._build_replay_buffer`` (once, at set-up):
  ``trainer_base.ReplayBuffer``, ``trainer_base.ReplayBufferAsync`` and ``trainer_base.load_extern_type`` (a custom
  sampler's class) <- verl_traj's subclass of the class verl picks (failed and stale groups), so verl builds the
  buffer as that class with its own arguments.
* :func:`llm_client_patches` -- driver, during ``TrajV1Mixin.get_llm_client`` (once, at set-up): the rollout
  server managers' ``get_client`` (instance attributes, restored to the class's) <- the same with verl_traj's
  subclass of the client class the trainer asks for (each generate attempt's policy version recorded).
* :func:`update_patches` -- actor / critic worker, during one planned ``train_mini_batch``:
  1. ``tensordict_utils.make_iterator`` <- the plan's mini-batches (same order on every rank);
  2. ``prepare_micro_batches`` of every loaded engine module (each engine's seam, :mod:`..engines`: verl's FSDP
     engine) <- the plan's micro-batches
     (:func:`micro_batch_patches`; alone, for the duration of one ``infer_batch``, on a batch marked for the prefix
     tree: its log-prob and reference passes run the plan's micro-batches too).
* :func:`gspo_prepass_patches` -- actor worker, during one planned ``train_mini_batch`` with ``ratio_group`` (GSPO at
  ``traj.ratio_scope=trajectory``), after :func:`update_patches`: the engine *instance*'s ``forward_backward_batch``
  <- a no-grad pre-pass (training mode, RNG replayed) that gives each row its trajectory's sequence ratio, then
  verl's call. An instance attribute: restored to the instance's own attribute if it had one, else removed, so the
  class's method shows through again.
* :func:`tree_forward_patches` -- actor / reference / critic worker, for one pass on prefix trees
  (:func:`~verl_traj.integration.tree.tree_forward.tree_pass`): the engine *instance*'s (its seam's ``tree_engine``)
  ``prepare_model_inputs`` and ``prepare_model_outputs`` <- the same over a micro-batch marked ``prefix_tree``
  forwarded as its one tree (inputs: the tree's tokens as a one-row micro-batch; outputs: gathered back into the
  rows); any other micro-batch runs verl's methods. Instance attributes, removed on exit as above.

Not here, on purpose: the CPU platform plugin's changes for the whole life of a process (a platform, engines,
a rollout backend, a gloo-only process-group init and a value-model loader; all but the rollout backend only
in processes without an accelerator) are listed in :mod:`verl_traj.integration.patches.process`.

This module lists patches and depends on nothing that installs them: the adapters (``trainers/v0.py``,
``trainers/v1.py``, ``workers/engine_workers.py``, ``tree/tree_forward.py``, ``main_ppo.py``) import it and pass their own classes and functions
in (v0's fit patches name their replacements in ``rows/``, imported where the patch list is built).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence

from verl_traj.integration.engines import ENGINES, micro_batch_modules, tree_engines

__all__ = ["Patch", "UPSTREAM", "patched", "fit_patches", "gspo_prepass_patches", "llm_client_patches", "micro_batch_patches",
           "replay_buffer_patches", "task_runner_patches", "tree_forward_patches", "update_patches", "v1_advantage_patches",
           "v1_task_runner_patches", "ENGINE_MODULES"]

RAY_TRAINER = "verl.trainer.ppo.ray_trainer"
ROLLOUT_CORR = "verl.trainer.ppo.rollout_corr_helper"  # v0's fit imports from it at call time
V1_TRAINER = "verl.trainer.ppo.v1.trainer_base"
METRIC_FUNCTIONS = ("compute_data_metrics", "compute_timing_metrics", "compute_throughout_metrics",
                    "compute_variance_proxy_metrics")
# Engines whose forward_backward_batch cuts micro-batches with a module-level prepare_micro_batches and runs them as
# a plain loop, and the engine classes a prefix-tree pass wraps: each engine's seam (integration/engines)
ENGINE_MODULES = micro_batch_modules()
TREE_ENGINES = tree_engines()



NO_ROW_MASK = ("verl's batch functions honouring a row mask (v1 drops rows tagged is_padding from most of its "
               "metrics; v0's fit has no such flag)")
# For every patch here: the verl extension point that would make it unnecessary (none of these exists in verl 0.9.1).
UPSTREAM = {
    (RAY_TRAINER, "compute_advantage"): "an advantage method on RayPPOTrainer (v0's fit calls the module function by "
                                        "name) and " + NO_ROW_MASK,
    (ROLLOUT_CORR, "compute_rollout_correction_and_add_to_batch"): "a rollout-correction scope in "
                                                                    "algorithm.rollout_correction (verl computes per row)",
    (RAY_TRAINER, "apply_kl_penalty"): NO_ROW_MASK,
    (RAY_TRAINER, "extract_reward"): NO_ROW_MASK,
    **{(RAY_TRAINER, name): NO_ROW_MASK for name in METRIC_FUNCTIONS},
    (RAY_TRAINER, "compute_spec_decode_metrics"): NO_ROW_MASK,
    ("verl.trainer.main_ppo_v0", "RayPPOTrainer"): "a trainer-class argument of v0's TaskRunner (it builds "
                                                   "RayPPOTrainer by name)",
    ("verl.trainer.ppo.v1", "get_trainer_cls"): "a trainer-class hook of v1's task runner (TRAINER_REGISTRY refuses a "
                                                "second class for a mode, and v1 reads meaning from the mode's name)",
    (V1_TRAINER, "compute_advantage_for_multi_trajectories"): "an advantage method on PPOTrainer (its "
                                                              "_compute_advantage calls the module function by name)",
    (V1_TRAINER, "apply_kl_penalty"): NO_ROW_MASK + " in v1's KL-in-reward",
    (V1_TRAINER, "compute_rollout_correction_and_add_to_batch"): "a rollout-correction scope in "
                                                                  "algorithm.rollout_correction (verl computes per row)",
    (V1_TRAINER, "tq"): "an extra-fields hook on _compute_advantage's write-back (its put takes a fixed field list)",
    (V1_TRAINER, "ReplayBuffer"): "a replay-buffer class setting that keeps verl's own constructor arguments "
                                  "(trainer.v1.sampler.custom_sampler gets fewer)",
    (V1_TRAINER, "ReplayBufferAsync"): "the same setting as for ReplayBuffer",
    (V1_TRAINER, "load_extern_type"): "the same setting as for ReplayBuffer",
    ("verl.workers.rollout.llm_server.LLMServerManager", "get_client"): "a client-class setting of the v1 trainer "
                                                                         "(get_llm_client names verl's class)",
    ("verl.utils.tensordict_utils", "make_iterator"): "a mini-batch iterator hook of TrainingWorker.train_mini_batch "
                                                      "(it slices fixed-size mini-batches)",
    **{(name, "prepare_micro_batches"): "a micro-batch hook of the engine (it re-cuts by its own rule)"
       for name in ENGINE_MODULES},
    ("verl.workers.engine.base.BaseEngine", "forward_backward_batch"): "a hook before each optimizer step's forward "
                                                                       "in TrainingWorker.train_mini_batch",
    **{(name, "prepare_model_inputs"): "an input-transform hook of the engine's forward_step (a micro-batch's tokens "
                                       "forwarded in another layout, its outputs mapped back)" for name in TREE_ENGINES},
    **{(name, "prepare_model_outputs"): "the same input-transform hook (its inverse on the outputs)"
       for name in TREE_ENGINES},
}


@dataclass(frozen=True)
class Patch:
    """Replace ``module.name`` by ``wrap(original)``; ``why`` is for the reader and error messages. With ``target``
    the attribute of that object is replaced instead (``module`` then only names it)."""

    module: str
    name: str
    wrap: Callable[[Any], Any]
    why: str = ""
    target: Any = None


@contextlib.contextmanager
def patched(patches: Sequence[Patch]) -> Iterator[None]:
    """Install ``patches`` in order; on exit restore every name, in reverse order, to what it was."""
    undo: list[tuple[Any, str, Any, bool]] = []
    try:
        for p in patches:
            owner = p.target if p.target is not None else importlib.import_module(p.module)
            if not hasattr(owner, p.name):
                raise AttributeError(f"{p.module}.{p.name} does not exist in this verl version; cannot {p.why}")
            original = getattr(owner, p.name)
            undo.append((owner, p.name, original, p.target is None or p.name in vars(owner)))
            setattr(owner, p.name, p.wrap(original))
        yield
    finally:
        for owner, name, original, own in reversed(undo):
            if own:
                setattr(owner, name, original)
            else:  # an instance that used its class's attribute uses it again
                delattr(owner, name)


def fit_patches(step_wise: bool, real_row_mask: Callable[[], Any] = lambda: None,
                step_index_key: str = "step_index", trajectory_ratios: bool = False,
                step_groups: Any = None) -> list[Patch]:
    """Driver patches for one ``fit`` (order: module docstring). ``real_row_mask()``: the real-row mask of the
    batch the trainer planned last (for functions that get arrays, not the batch); ``step_index_key``: the field of
    each step row's step (``traj.step_index_key``); ``trajectory_ratios``: ``traj.ratio_scope=trajectory``;
    ``step_groups``: GiGPO's ``traj:`` knobs (:class:`~verl_traj.stepwise.step_groups.StepGroupOptions`)."""
    # local: workers import this catalogue too; rows/ (driver code, ~0.3 s) loads only where v0's fit builds its list
    from verl_traj.integration.rows import real_rows, stepwise_rows

    out = []
    if step_wise:
        out.append(Patch(RAY_TRAINER, "compute_advantage",
                         functools.partial(stepwise_rows.stepwise_advantage, step_index_key=step_index_key,
                                           step_groups=step_groups),
                         "advantages per trajectory on step-wise rows (outcome once, temporal on its timeline)"))
        if trajectory_ratios:
            out.append(Patch(ROLLOUT_CORR, "compute_rollout_correction_and_add_to_batch",
                             functools.partial(stepwise_rows.trajectory_scoped_correction, step_index_key=step_index_key),
                             "verl's sequence-level rollout correction per trajectory (traj.ratio_scope)"))
    out += [
        Patch(RAY_TRAINER, "compute_advantage", real_rows.advantage_on_real_rows, "compute advantages on real rows only"),
        Patch(RAY_TRAINER, "apply_kl_penalty", real_rows.kl_penalty_on_real_rows, "apply the KL penalty on real rows only"),
        Patch(RAY_TRAINER, "extract_reward", real_rows.reward_on_real_rows, "zero the rewards of padding rows"),
    ]
    view = real_rows.shared_view()
    out += [Patch(RAY_TRAINER, name, functools.partial(real_rows.metrics_on_real_rows, view=view,
                                                      with_meta_metrics=name == "compute_data_metrics"),
                  "log metrics of real rows (the data metrics with the advantage step's, e.g. traj_gigpo/*)")
            for name in METRIC_FUNCTIONS]
    out.append(Patch(RAY_TRAINER, "compute_spec_decode_metrics",
                     functools.partial(real_rows.spec_decode_on_real_rows, real_row_mask=real_row_mask),
                     "drop padding rows from the speculative-decoding metrics"))
    return out


def task_runner_patches(trainer_cls: type) -> list[Patch]:
    """``trainer_cls``: ``TrajRayPPOTrainer`` (passed in: this module imports none of the adapters that use it)."""
    return [Patch("verl.trainer.main_ppo_v0", "RayPPOTrainer", lambda _original: trainer_cls,
                  "run verl's task runner with TrajRayPPOTrainer")]


def v1_task_runner_patches(traj_trainer_class: Callable[[type], type]) -> list[Patch]:
    """``traj_trainer_class``: :func:`verl_traj.integration.trainers.v1.traj_trainer_class` (verl's class -> with the
    mixin)."""

    def wrap(get_trainer_cls: Callable[[str], type]) -> Callable[[str], type]:
        return lambda name: traj_trainer_class(get_trainer_cls(name))

    return [Patch("verl.trainer.ppo.v1", "get_trainer_cls", wrap, "run verl's v1 trainers with TrajV1Mixin")]


def v1_advantage_patches(advantage: Callable, correction: Optional[Callable] = None, *,
                         kl_penalty: Callable, put: Optional[Callable] = None) -> list[Patch]:
    """``advantage``: replaces ``compute_advantage_for_multi_trajectories`` (same signature; the mixin passes
    :func:`~verl_traj.integration.trainers.v1_advantage.planned_advantage` with the batch's plan facts bound);
    ``kl_penalty(verl_apply_kl_penalty, data, kl_ctrl, kl_penalty)``: wraps verl's KL-in-reward (the mixin passes
    :func:`~verl_traj.integration.trainers.v1_advantage.kl_penalty_on_planned_rows` with the facts bound; only called
    with ``algorithm.use_kl_in_reward=true``); ``correction(verl_correction, data, rollout_corr_config)``: wraps verl's
    rollout correction (step rows at ``traj.ratio_scope=trajectory``:
    :func:`~verl_traj.integration.trainers.v1_advantage.corrected_per_trajectory`), or ``None``; ``put(tq)``: the
    ``transfer_queue`` module as the write-back sees it (:class:`~..trainers.v1_advantage.PutWithTreeParts`)."""
    out = [Patch(V1_TRAINER, "compute_advantage_for_multi_trajectories", lambda _original: advantage,
                 "compute the planned batch's advantages"),
           Patch(V1_TRAINER, "apply_kl_penalty", lambda original: functools.partial(kl_penalty, original),
                 "apply the KL penalty on real rows only (v1 imports verl's by name: v0's patch misses it)")]
    if correction is not None:
        out.append(Patch(V1_TRAINER, "compute_rollout_correction_and_add_to_batch",
                         lambda original: functools.partial(correction, original),
                         "verl's sequence-level rollout correction per trajectory (traj.ratio_scope)"))
    if put is not None:
        out.append(Patch(V1_TRAINER, "tq", put, "put a branching session's parts with the advantages (the loss's)"))
    return out


def replay_buffer_patches(buffer_class: Callable[[type], type]) -> list[Patch]:
    """``buffer_class(verl_cls)``: verl_traj's replay-buffer class for the one verl's ``_build_replay_buffer`` picks
    (the mixin passes :func:`~verl_traj.integration.async_modes.v1_failures.group_policy_class`). verl compares the
    picked class with ``ReplayBuffer`` by identity; both names are replaced, so it still reads true for the sync
    buffer."""
    why = "build the replay buffer as verl_traj's subclass (traj.failed_groups, traj.max_staleness)"
    return [Patch(V1_TRAINER, "ReplayBuffer", buffer_class, why),
            Patch(V1_TRAINER, "ReplayBufferAsync", buffer_class, why),
            Patch(V1_TRAINER, "load_extern_type",
                  lambda original: lambda *args, **kwargs: buffer_class(original(*args, **kwargs)), why)]


def llm_client_patches(managers: Sequence[Any], client_class: Callable[[Optional[type]], type]) -> list[Patch]:
    """``managers``: the trainer's rollout server managers (``LLMServerManager`` instances); their ``get_client``
    <- the same with ``client_class(the class asked for, None: verl's default)`` (the mixin passes
    :func:`~verl_traj.integration.async_modes.v1_staleness.recording_client_class`)."""
    def wrap(get_client: Callable[..., Any]) -> Callable[..., Any]:
        def get_recording_client(client_cls: Optional[type] = None, **kwargs: Any) -> Any:
            return get_client(client_cls=client_class(client_cls), **kwargs)
        return get_recording_client

    return [Patch("verl.workers.rollout.llm_server.LLMServerManager", "get_client", wrap,
                  "record each generate attempt's policy version (traj_version/*, traj.max_staleness)", target=manager)
            for manager in managers]


def update_patches(make_iterator: Callable[[Any], Any], prepare_micro_batches: Callable[[Any], Any]) -> list[Patch]:
    """Worker patches for one planned update; engine modules not loaded in this process are skipped."""
    return [Patch("verl.utils.tensordict_utils", "make_iterator", make_iterator, "step the plan's mini-batches"),
            *micro_batch_patches(prepare_micro_batches)]


def micro_batch_patches(prepare_micro_batches: Callable[[Any], Any]) -> list[Patch]:
    """``prepare_micro_batches`` of every loaded engine module with a seam <- the plan's micro-batches (an update's, or a
    prefix-tree log-prob / reference pass's: :mod:`~verl_traj.integration.tree.tree_forward`)."""
    return [Patch(name, "prepare_micro_batches", prepare_micro_batches, "run the plan's micro-batches")
            for seam in ENGINES.values() for name in seam.micro_batch_modules if name in sys.modules]


def gspo_prepass_patches(engine: Any, wrap: Callable[[Callable], Callable]) -> list[Patch]:
    """Actor worker, one planned update with ``ratio_group``: ``engine.forward_backward_batch`` <- ``wrap(verl's)``
    (the GSPO pre-pass of :class:`~verl_traj.integration.workers.engine_workers.TrajActorTrainingWorker`)."""
    return [Patch("verl.workers.engine.base.BaseEngine", "forward_backward_batch", wrap,
                  "give GSPO each row's trajectory-wide sequence ratio (traj.ratio_scope=trajectory)", target=engine)]


def tree_forward_patches(engine: Any, engine_class: str, prepare_inputs: Callable[[Callable], Callable],
                         prepare_outputs: Callable[[Callable], Callable]) -> list[Patch]:
    """Worker, one pass on prefix trees: ``engine``'s ``prepare_model_inputs`` <- ``prepare_inputs(verl's)`` and
    ``prepare_model_outputs`` <- ``prepare_outputs(verl's)`` (:mod:`~verl_traj.integration.tree.tree_forward` passes
    its hooks in; ``engine_class``: the engine class its seam names, :mod:`~verl_traj.integration.engines`)."""
    return [Patch(engine_class, "prepare_model_inputs", prepare_inputs,
                  "forward micro-batches marked prefix_tree as one prefix tree", target=engine),
            Patch(engine_class, "prepare_model_outputs", prepare_outputs,
                  "gather a tree micro-batch's per-token outputs back into its rows", target=engine)]
