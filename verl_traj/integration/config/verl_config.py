"""Start-up: set the verl settings the plan depends on (read once), on a config the driver has checked.

:func:`prepare_config` runs in ``TrajRayPPOTrainer.__init__``, before any worker is built, and returns
:class:`PlanSettings`: the cap and cost model the planner packs the update's micro-batches with, and the
length of padding rows. It adapts and does not validate: the checks ran once, on the driver, before Ray started
(:func:`verl_traj.integration.startup.checks.check_startup`).

* Update (actor and critic): the plan's micro-batches are what runs. Cap per sequence-parallel group =
  ``traj.micro_batch_max_tokens`` (per GPU, verl's ``ppo_max_token_len_per_gpu`` meaning) or, when unset,
  verl's own ``ppo_max_token_len_per_gpu`` (the critic's too, the smaller wins), times the Ulysses size.
  The cost follows the attention path: ``use_remove_padding`` -> fewest micro-batches by token sums, else the
  least padded area (the cap bounds token sums as in verl, or the padded area with ``traj.padded_cap=area``).
* Inference passes (log-prob, reference, values) keep verl's own caps unless
  ``traj.infer_micro_batch_max_tokens`` is set. Planned batches have variable rows per rank, which fixed
  micro-batch sizes (``*_micro_batch_size_per_gpu``) cannot divide, so a pass on fixed sizes switches to
  verl's dynamic micro-batching with the same worst-case memory bound (``micro_batch_size_per_gpu x
  (max_prompt_length + max_response_length)`` tokens): logged, and the gradient does not depend on it.
* Padding rows are ``max(2, TP x CP)`` tokens long for Megatron engines with context parallelism (THD
  packing hands every CP rank a slice of each row; verl PR 7449 measured the shortest rows that survive
  as 2 / 3 / 8 / 16 tokens at TP1CP2 / TP2CP2 / TP2CP4 / TP4CP4, each at most TP x CP), else 2.
* v0: ``trainer.balance_batch`` is forced on (the planner runs in ``_balance_batch``), with a warning.
* v1: verl_traj's agent-loop manager is selected (:mod:`verl_traj.integration.agent_loops.v1_agent_loop`: step rows,
  deterministic request ids).
"""

from __future__ import annotations

import logging
import os
import warnings
from dataclasses import dataclass
from typing import Any, Optional

from omegaconf import OmegaConf, open_dict

from verl.utils.import_utils import load_class_from_fqn

from verl_traj.config import TrajConfig, TrajConfigError
from verl_traj.core import PAD_ROW_TOKENS
from verl_traj.core.trees.tree_cost import DEVICE_COSTS, TreeCostModel, tree_cost_model
from verl_traj.integration.config.access import ulysses_size, uses_critic
from verl_traj.integration.engines import planned_strategies

logger = logging.getLogger(__name__)

# verl_traj's v1 agent-loop manager, as verl loads it (by name: the driver does not import the agent-loop module)
MANAGER_FQN = "verl_traj.integration.agent_loops.v1_agent_loop.TrajAgentLoopManagerTQ"

__all__ = ["MICRO_BATCH_PASSES", "MicroBatchPass", "PlanSettings", "fixed_to_dynamic_micro_batches", "pad_row_tokens",
           "pin_micro_batch_settings", "prepare_config", "prepare_v1_agent_loop", "ray_init_address"]


@dataclass(frozen=True)
class PlanSettings:
    """What the planner takes from verl's config: the update's micro-batch cap (per SP group) and cost model
    (``derived``: the cap came from verl's settings, so a longer row gets a micro-batch of its own instead of
    an error) and the attended tokens of a padding row."""

    max_tokens: int
    cost: str
    derived: bool
    pad_row_tokens: int = PAD_ROW_TOKENS
    engine_runs_plan: bool = True  # False: an engine that cuts its own micro-batches (Megatron's pipeline schedule)
    # with trees: which micro-batches forward as trees (core/trees/tree_cost.py), the device's figures by default
    tree_cost: TreeCostModel = DEVICE_COSTS["cpu"]


def _max_row_tokens(config: Any) -> int:
    return int(config.data.get("max_prompt_length", 0) or 0) + int(config.data.get("max_response_length", 0) or 0)


@dataclass(frozen=True)
class MicroBatchPass:
    """One forward (/backward) pass of verl whose micro-batches are sized by a fixed row count or a token cap:
    ``section`` (config path), its ``flag`` (dynamic on/off), its ``(micro-batch size key, token cap key)`` pairs,
    and the section whose Ulysses size it runs with."""

    section: str
    flag: str
    caps: tuple[tuple[str, str], ...]
    sp_section: str


ACTOR, CRITIC = "actor_rollout_ref.actor", "critic"
MICRO_BATCH_PASSES = (
    MicroBatchPass(ACTOR, "use_dynamic_bsz", (("ppo_micro_batch_size_per_gpu", "ppo_max_token_len_per_gpu"),), ACTOR),
    MicroBatchPass("actor_rollout_ref.rollout", "log_prob_use_dynamic_bsz",
                   (("log_prob_micro_batch_size_per_gpu", "log_prob_max_token_len_per_gpu"),), ACTOR),
    MicroBatchPass("actor_rollout_ref.ref", "log_prob_use_dynamic_bsz",
                   (("log_prob_micro_batch_size_per_gpu", "log_prob_max_token_len_per_gpu"),), ACTOR),
    # verl 0.9.1's critic engines read the value pass's cap from ppo_infer_* (a CriticConfig field the yaml lacks,
    # default 32768; the yaml's forward_* keys are deprecated and unread), and v1 also uses it as the engine's cap
    MicroBatchPass(CRITIC, "use_dynamic_bsz", (("ppo_micro_batch_size_per_gpu", "ppo_max_token_len_per_gpu"),
                                               ("ppo_infer_micro_batch_size_per_gpu", "ppo_infer_max_token_len_per_gpu")),
                   CRITIC),
)


def _passes(config: Any) -> list[tuple[MicroBatchPass, Any]]:
    """The passes this config runs, with their sections (the critic's only when it is on)."""
    out = []
    for p in MICRO_BATCH_PASSES:
        section = OmegaConf.select(config, p.section, default=None)
        if section is not None and (p.section != CRITIC or uses_critic(config)):
            out.append((p, section))
    return out


def pin_micro_batch_settings(config: Any) -> None:
    """Write every pass's flag, micro-batch sizes and caps as the literal values they resolve to now. verl's config
    interpolates them from the actor's keys (the critic's ``use_dynamic_bsz``, the log-prob passes' flags and caps),
    so without this a change to the actor's (the fixed-to-dynamic switch, ``traj.micro_batch_max_tokens``) would
    silently change the other passes too."""
    with open_dict(config):
        for p, section in _passes(config):
            for key in (p.flag, *(k for pair in p.caps for k in pair)):
                if key in section:
                    section[key] = section.get(key)


def fixed_to_dynamic_micro_batches(config: Any) -> list[str]:
    """Every pass still on fixed micro-batch sizes -> verl's dynamic micro-batching with the same memory bound, read
    from its own settings; a pass already dynamic keeps its cap. Returns what changed. (verl requires the actor's
    and the rollout log-prob pass's ``use_dynamic_bsz`` to agree: afterwards both are true.)

    The bound: a fixed micro-batch of ``mbs`` rows runs on one sequence-parallel group, each GPU holding ``1/sp`` of
    every row (about ``mbs * len / sp`` tokens per GPU), while verl multiplies a dynamic per-GPU cap by ``sp`` for
    the group. So the per-GPU cap is ``ceil(mbs * (max_prompt_length + max_response_length) / sp)``."""
    pin_micro_batch_settings(config)  # before any write: the passes that interpolate the actor's keys keep theirs
    max_len = _max_row_tokens(config)
    if max_len <= 0:
        return []
    changed = []
    with open_dict(config):
        for p, section in _passes(config):
            if bool(section.get(p.flag, False)):
                continue
            sp = ulysses_size(OmegaConf.select(config, p.sp_section), p.sp_section)
            sizes = [section.get(mbs_key, None) for mbs_key, _ in p.caps]
            fallback = next((int(m) for m in sizes if m), 1)
            section[p.flag] = True
            for (mbs_key, cap_key), mbs in zip(p.caps, sizes):
                section[cap_key] = -(-int(mbs or fallback) * max_len // sp)
            changed.append(f"{p.section}.{p.flag}=true, {p.section}.{p.caps[0][1]}={section[p.caps[0][1]]}"
                           + (f" (per GPU: Ulysses size {sp})" if sp > 1 else ""))
    return changed


def _apply_infer_cap(config: Any, cap: int) -> None:
    """``traj.infer_micro_batch_max_tokens``: the log-prob, reference and value passes' token caps."""
    with open_dict(config):
        for p, section in _passes(config):
            if p.section == ACTOR:
                continue
            for _, cap_key in p.caps[-1:]:  # the inference cap of the pass (the critic's value pass)
                section[cap_key] = cap


def pad_row_tokens(config: Any) -> int:
    """``max(2, TP x CP)`` over the Megatron sections (actor, reference, critic) that use context parallelism."""
    need = PAD_ROW_TOKENS
    for path in ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic"):
        section = OmegaConf.select(config, path, default=None)
        if section is None or section.get("strategy", None) != "megatron":
            continue
        megatron = section.get("megatron", None) or {}
        tp = int(megatron.get("tensor_model_parallel_size", 1) or 1)
        cp = int(megatron.get("context_parallel_size", 1) or 1)
        if cp > 1:
            need = max(need, tp * cp)
    return need


def _plan_settings(config: Any, traj_config: TrajConfig) -> PlanSettings:
    """The update's cap per SP group and cost model; an explicit ``traj`` cap is written into verl's keys."""
    arr, critic = config.actor_rollout_ref, config.get("critic", None)
    use_critic = critic is not None and uses_critic(config)
    sections = [arr.actor] + ([critic] if use_critic else [])
    with open_dict(config):
        if traj_config.micro_batch_max_tokens is not None:
            for section in sections:
                section.ppo_max_token_len_per_gpu = int(traj_config.micro_batch_max_tokens)
    cap = min(int(s.ppo_max_token_len_per_gpu) * ulysses_size(s) for s in sections)
    rmpad = bool((arr.get("model", None) or {}).get("use_remove_padding", False)) and (
        not use_critic or bool((critic.get("model", None) or {}).get("use_remove_padding", False)))
    cost = "tokens" if rmpad else "padded" if traj_config.padded_cap == "tokens" else "padded_area"
    # engines whose micro-batches are the plan's (each engine's seam, integration/engines: verl's FSDP engine)
    runs = all(str(s.get("strategy", "fsdp")) in planned_strategies() for s in sections)
    tree_cost = tree_cost_model(str(config.trainer.get("device", "cuda")), traj_config.tree_token_cost,
                                traj_config.tree_margin)
    return PlanSettings(cap, cost, traj_config.micro_batch_max_tokens is None, pad_row_tokens(config), runs, tree_cost)


def _force_balance_batch(config: Any) -> None:
    """v0 calls ``_balance_batch`` only with ``trainer.balance_batch=true`` (v1 always calls it)."""
    if not config.trainer.get("balance_batch", True):
        warnings.warn(
            "trainer.balance_batch=false is overridden to true: with traj.enable=true the mini-batch planner "
            "runs in _balance_batch on every step (it also assigns mini-batches and padding). "
            "To skip only DP workload balancing set traj.balance_dp=false.",
            stacklevel=3,
        )
    with open_dict(config):
        config.trainer.balance_batch = True


def prepare_v1_agent_loop(config: Any, traj_config: TrajConfig) -> None:
    """v1: verl_traj's agent-loop manager (:mod:`verl_traj.integration.agent_loops.v1_agent_loop`: step rows for
    ``traj.step_wise``, one request priority per session for ``rollout.full_determinism``), unless the user chose a
    manager of their own (then ``traj.step_wise`` needs it to subclass verl_traj's)."""
    agent = config.actor_rollout_ref.rollout.agent
    given = agent.get("agent_loop_manager_class", None)
    if given not in (None, "", MANAGER_FQN):
        if traj_config.step_wise and not _is_traj_manager(given):
            raise TrajConfigError(
                f"actor_rollout_ref.rollout.agent.agent_loop_manager_class={given!r} cannot be combined with "
                "traj.step_wise=true on the v1 trainer: verl_traj's manager stores each trajectory as its step rows. "
                f"Leave it unset (verl_traj then uses {MANAGER_FQN}) or point it at a subclass of that class."
            )
        return
    with open_dict(config):
        agent.agent_loop_manager_class = MANAGER_FQN


def _is_traj_manager(fqn: str) -> bool:
    """Whether the class at ``fqn`` subclasses verl_traj's manager. Both are loaded by name, as verl's trainer loads
    the one it runs in this same driver process (only for a user's own manager class): the driver's modules keep no
    import of the agent-loop module, and the class verl would build is the one checked."""
    cls = load_class_from_fqn(fqn, "AgentLoopManager")
    return isinstance(cls, type) and issubclass(cls, load_class_from_fqn(MANAGER_FQN, "AgentLoopManager"))


def prepare_config(config: Any, traj_config: TrajConfig) -> PlanSettings:
    """Adapt the verl settings ``traj:`` depends on (see module doc); ``config`` passed the start-up checks."""
    if bool(config.trainer.get("use_v1", False)):
        prepare_v1_agent_loop(config, traj_config)
    else:
        _force_balance_batch(config)
    changed = fixed_to_dynamic_micro_batches(config)  # pins verl's interpolated settings first
    if changed:
        logger.warning("verl_traj: planned batches have variable rows per rank, so fixed micro-batch sizes were "
                       "replaced by dynamic micro-batching with the same memory bound: %s", "; ".join(changed))
    if traj_config.infer_micro_batch_max_tokens is not None:
        _apply_infer_cap(config, int(traj_config.infer_micro_batch_max_tokens))
    return _plan_settings(config, traj_config)


def ray_init_address(config: Any, environ: Optional[dict] = None) -> Optional[str]:
    """Pin where ``ray.init`` goes when the config sizes its own cluster (``ray_kwargs.ray_init.num_cpus`` or
    ``num_gpus`` set, as the CPU presets do): to a new local instance (``address="local"``), returned and written
    into the config. Without it, Ray connects to whatever cluster ``/tmp/ray/ray_current_cluster`` names (one left
    by an earlier ``ray start`` or a killed job on the same machine) and then refuses the sizes deep inside
    ``ray.init``. With no sizes set (verl's default) nothing changes: an existing cluster is joined as before.

    A cluster address given explicitly (``ray_kwargs.ray_init.address`` or ``RAY_ADDRESS``) together with sizes is
    refused here, naming the fix: a running cluster brings its own resources.
    """
    environ = os.environ if environ is None else environ
    ray_init = config.ray_kwargs.get("ray_init") or {}
    sizes = {k: ray_init.get(k) for k in ("num_cpus", "num_gpus") if ray_init.get(k) is not None}
    if not sizes:
        return None
    address = ray_init.get("address") or environ.get("RAY_ADDRESS") or None
    if address not in (None, "local"):
        given = ", ".join(f"ray_kwargs.ray_init.{k}={v}" for k, v in sizes.items())
        source = "ray_kwargs.ray_init.address" if ray_init.get("address") else "the RAY_ADDRESS environment variable"
        raise TrajConfigError(
            f"{given} sizes a new local Ray cluster, but {source} points at a running one ({address!r}), whose "
            f"resources are its own. To join it, add " + " ".join(f"ray_kwargs.ray_init.{k}=null" for k in sizes)
            + "; to start a local cluster instead, unset RAY_ADDRESS or ray_kwargs.ray_init.address.")
    with open_dict(config):
        config.ray_kwargs.ray_init.address = "local"
    return "local"
