"""Everything the driver checks and settles before Ray starts, in one place: :func:`check_startup`.

``python -m verl_traj.main_ppo`` calls it once per job (``verl_traj.main_ppo.run``), before verl's own
``validate_config`` and before any worker exists; the trainer's
:func:`~verl_traj.integration.config.verl_config.prepare_config` then only adapts verl's settings. In order:

1. the job's device and this process's platform agree (:func:`check_platform`);
2. the ``traj:`` section (:class:`~verl_traj.config.TrajConfig`);
3. ``algorithm.adv_estimator`` (:func:`check_adv_estimator`, whatever ``traj.enable`` says): a name verl knows,
   ``remax``, ``gdpo`` and the optimal-token baselines only on v0 (v1's advantage step never fetches their inputs),
   ``gdpo`` with ``gdpo_reward_keys``, the optimal-token baselines with ``calculate_sum_pi_squared`` (else verl fails
   after the first rollout);
4. in v1's ``separate_async`` mode, verl's rule ``train_batch_size = parameter_sync_step x ppo_mini_batch_size``
   (:func:`~verl_traj.integration.async_modes.separate_async.settle_parameter_sync_step`: a null sync step derived from
   it); on v1's sync mode, exact refills of failed groups
   (:func:`~verl_traj.integration.async_modes.v1_failures.settle_failed_groups`: ``traj.failed_groups`` replaces them);
   ``traj.max_staleness`` only on v1, said where it cannot act
   (:func:`~verl_traj.integration.async_modes.v1_staleness.settle_staleness`);
5. the cross-checks of ``traj:`` against verl's sections
   (:func:`~verl_traj.integration.startup.verl_checks.validate_against_verl`), and ``traj.prefix_tree`` only where the
   tree is built and tested (:mod:`verl_traj.integration.startup.tree_checks`: on CPU it selects ``cpu_varlen`` for the
   actor's model);
6. with ``traj.enable=true``: the model directories, the critic's value head, equal actor / critic DP sizes
   (:func:`check_models`);
7. Ulysses only with remove-padding (:func:`check_sequence_parallel`; verl's engine refuses it when the workers
   start);
8. on the CPU platform (``trainer.device=cpu``): the attention implementation and, for ``separate_async``, the
   rollout pool and weight sync (:mod:`verl_traj.integration.startup.cpu_settings`); and LoRA on the CPU rollout;
9. a warning where ``traj.ratio_scope=trajectory`` puts a product of token ratios over trajectories long enough for
   its sequence IS weights to degenerate (:func:`ratio_scope_warning`).

Each refusal is a :class:`~verl_traj.config.TrajConfigError` naming the field, the value and the fix.
"""

from __future__ import annotations

import difflib
import logging
import os
from typing import Any, Optional

from transformers import AutoConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING

from verl.trainer.ppo.core_algos import ADV_ESTIMATOR_REGISTRY, AdvantageEstimator
from verl.utils.import_utils import is_trl_available

from verl_traj.config import TrajConfig, TrajConfigError
from verl_traj.core.plan.estimators import estimator_name
from verl_traj.integration.async_modes.separate_async import settle_parameter_sync_step
from verl_traj.integration.async_modes.v1_failures import settle_failed_groups
from verl_traj.integration.async_modes.v1_staleness import settle_staleness
from verl_traj.integration.config.access import flag_at, sequence_parallel_sizes, ulysses_size, uses_critic, value_at
from verl_traj.integration.config.attention_names import CPU_VARLEN
from verl_traj.integration.rows.credit import load_rules
from verl_traj.integration.startup.cpu_settings import (check_cpu_rollout_lora, select_cpu_attention,
                                                         settle_cpu_separate_async)
from verl_traj.integration.startup.tree_checks import settle_prefix_tree
from verl_traj.integration.startup.verl_checks import validate_against_verl
from verl_traj.stepwise.credit_rules import CREDIT_RULES, RULE_KNOBS, credit_rule
from verl_traj.stepwise.ratio_scope_advice import degenerates, expected_trajectory_ess

logger = logging.getLogger(__name__)

__all__ = ["check_adv_estimator", "check_models", "check_platform", "check_sequence_parallel", "check_startup",
           "known_adv_estimators", "ratio_scope_warning"]

ESTIMATOR = "algorithm.adv_estimator"
# verl 0.9.1's estimators whose inputs its compute_advantage asserts only after the first rollout
NEEDS_SUM_PI_SQUARED = ("optimal_token_baseline", "tir_optimal_token_baseline")
# verl 0.9.1's estimators whose inputs the v1 trainer never fetches for its advantage step (its field list:
# uid, response_mask, rm_scores, rollout/old/ref log-probs, values): they fail after the first rollout there
V0_ONLY_ESTIMATORS = {"remax": "reward_baselines (the reward of a greedy rollout per prompt), which only v0 generates",
                      "optimal_token_baseline": "sum_pi_squared, which v1's advantage step never fetches",
                      "tir_optimal_token_baseline": "sum_pi_squared, which v1's advantage step never fetches",
                      "gdpo": "the prompts, attention mask and per-component rewards, which v1's advantage step "
                              "never fetches"}


def check_startup(config: Any, platform_device: str) -> TrajConfig:
    """The start-up checks (module doc), once per job, on the driver; ``platform_device`` is the platform verl picked
    in this process (``verl.utils.device.get_device_name()``). Returns the parsed ``traj:`` section."""
    check_platform(config, platform_device)
    traj_config = TrajConfig.of(config)
    check_adv_estimator(config)
    derived = settle_parameter_sync_step(config)  # before the mini-batch checks, which divide by it
    if derived:
        logger.warning("verl_traj: separate_async's sync step from verl's rule: %s", derived)
    refill = settle_failed_groups(config, traj_config)  # traj.failed_groups drops and replaces failed groups
    if refill:
        logger.info("verl_traj: exact refills of failed groups on the sync trainer: %s", refill)
    idle_bound = settle_staleness(config, traj_config)  # traj.max_staleness: v1 only; where it cannot act, said
    if idle_bound:
        logger.warning("verl_traj: %s", idle_bound)
    validate_against_verl(traj_config, config)
    tree = settle_prefix_tree(traj_config, config, "cpu" if value_at(config, "trainer.device") == "cpu" else "cuda")
    if tree:
        logger.warning("verl_traj: %s", tree)
    traj_config = TrajConfig.of(config)  # prefix_tree settled (the settlement dropped the earlier parse)
    if traj_config.enable:
        check_models(config)
    check_sequence_parallel(config)
    if value_at(config, "trainer.device") == "cpu":
        for setting in select_cpu_attention(config):  # cpu_varlen (Ulysses) is worth seeing; sdpa is the usual one
            (logger.warning if setting.endswith(CPU_VARLEN) else logger.info)(
                "verl_traj: the CPU platform selected %s", setting)
        for setting in settle_cpu_separate_async(config):
            logger.warning("verl_traj: the CPU platform set %s for separate_async", setting)
    check_cpu_rollout_lora(config)
    warning = ratio_scope_warning(traj_config, config)
    if warning:
        logger.warning(warning)
    return traj_config


# per-token rollout/training log-ratio spread at which the warning judges a trajectory (bf16 rollout engines vs
# FSDP training commonly measure 0.005-0.05; scripts/bench_ratio_scope.py)
WARN_SPREAD = 0.02


def ratio_scope_warning(traj_config: TrajConfig, config: Any) -> str:
    """A warning (``""``: none) where ``traj.ratio_scope=trajectory`` meets a product of token ratios over a whole
    trajectory (``rollout_is=sequence``, ``seq_sum_*`` rejection) and trajectories of up to ``data.max_response_length``
    loss tokens, whose expected sequence-IS ESS falls below 0.5 at a per-token spread of :data:`WARN_SPREAD`
    (:func:`~verl_traj.stepwise.ratio_scope_advice.degenerates`). Geometric means (``seq_mean_*``, GSPO) do not
    compound with length and are not warned about. Without step rows the setting changes nothing, and says so."""
    if not (traj_config.enable and traj_config.ratio_scope == "trajectory"):
        return ""
    if not traj_config.step_wise:
        return ("verl_traj: traj.ratio_scope=trajectory has no effect without traj.step_wise=true: each trajectory is "
                "one row, so its row's ratios are its trajectory's. Fix: traj.step_wise=true with the step-wise agent "
                "loop (docs/stepwise.md), or leave traj.ratio_scope=row.")
    rollout_is = value_at(config, "algorithm.rollout_correction.rollout_is")
    rollout_rs = str(value_at(config, "algorithm.rollout_correction.rollout_rs") or "")
    products = [s for s in (f"rollout_is={rollout_is}" if rollout_is == "sequence" else "",
                            f"rollout_rs={rollout_rs}" if "seq_sum" in rollout_rs else "") if s]
    tokens = int(value_at(config, "data.max_response_length") or 0)
    if not products or not degenerates(tokens, WARN_SPREAD):
        return ""
    ess = ", ".join(f"{expected_trajectory_ess(tokens, s):.2f} at s={s}" for s in (0.01, 0.02, 0.05))
    return (f"verl_traj: traj.ratio_scope=trajectory with algorithm.rollout_correction.{' and '.join(products)} "
            f"multiplies the token ratios of trajectories of up to data.max_response_length={tokens} loss tokens: "
            f"the expected ESS of their sequence weights is {ess} (s: the per-token log-ratio spread between rollout "
            "and training; verl logs it as rollout_corr/chi2_token = exp(s^2) - 1), so a few trajectories would carry "
            "the update and most would be truncated or rejected. Fix: traj.ratio_scope=row (the default), or a "
            "geometric-mean rejection (rollout_rs=seq_mean_k1), which does not compound with length "
            "(docs/trainers.md, 'Choosing traj.ratio_scope').")


def known_adv_estimators() -> tuple[str, ...]:
    """Every name verl's ``compute_advantage`` (v0, and v1 through it) accepts: its registry
    (``core_algos.ADV_ESTIMATOR_REGISTRY``, with ``register_adv_est`` additions) and the ``AdvantageEstimator``
    values it dispatches by name (``gae``, ``grpo``)."""
    return tuple(sorted(set(ADV_ESTIMATOR_REGISTRY) | {e.value for e in AdvantageEstimator}))


def check_adv_estimator(config: Any) -> None:
    """``algorithm.adv_estimator``: a name verl knows, with what it needs on this trainer."""
    load_rules(TrajConfig.of(config).credit_rule_modules)  # per-call rules in verl's registry before the lookup
    given = value_at(config, ESTIMATOR)
    name, known = estimator_name(given), known_adv_estimators()
    if not isinstance(name, str) or name not in known:
        close = difflib.get_close_matches(str(name), known, n=1)
        raise TrajConfigError(
            f"{ESTIMATOR}={given!r} is not an advantage estimator verl knows: training would start and fail after the "
            f"first rollout (verl: 'Unknown advantage estimator simply: {name}'). Known: {list(known)}"
            + (f" (did you mean {close[0]!r}?)" if close else "") + f". Fix: set {ESTIMATOR} to one of them, or "
            "register your own (a per-call rule with register_credit_rule, or verl's register_adv_est) in a module "
            "named by traj.credit_rule_modules=[my_pkg.my_rules] (docs/stepwise.md).", field=ESTIMATOR)
    _check_estimator_inputs(config, name)


def _check_step_groups(config: Any, name: str) -> None:
    """A per-call credit rule (``gigpo``, any registered one) needs verl_traj's step rows; a rule's ``traj:`` knobs
    need a rule that reads them (else they would do nothing)."""
    traj, rule = TrajConfig.of(config), credit_rule(name)
    if rule is not None and not (traj.enable and traj.step_wise):
        raise TrajConfigError(
            f"{ESTIMATOR}={name!r} is a per-call credit rule (each LLM call its own advantage): it needs verl_traj's "
            f"step rows, but traj.enable={traj.enable} and traj.step_wise={traj.step_wise}. Fix: set traj.enable=true "
            "traj.step_wise=true (with a step-recording agent loop: docs/agent_loops.md), or "
            f"{ESTIMATOR}=grpo.", field=ESTIMATOR)
    if traj.branch_weighting != "once" and not (traj.enable and traj.step_wise):
        raise TrajConfigError(
            f"traj.branch_weighting={traj.branch_weighting!r} weighs the calls of sessions that branch, which train "
            f"only on step rows, but traj.enable={traj.enable} and traj.step_wise={traj.step_wise}: it would do "
            "nothing. Fix: set traj.step_wise=true (docs/branching.md), or remove traj.branch_weighting.",
            field="traj.branch_weighting")
    for knob in RULE_KNOBS:
        if knob not in (rule.knobs if rule else ()) and getattr(traj, knob) != getattr(TrajConfig, knob):
            readers = sorted(r.name for r in CREDIT_RULES.values() if knob in r.knobs)
            raise TrajConfigError(
                f"traj.{knob}={getattr(traj, knob)!r} is read only by the credit rules {readers}, but {ESTIMATOR}="
                f"{name!r}: it would do nothing. Fix: set {ESTIMATOR} to one of them, or remove traj.{knob}.",
                field=f"traj.{knob}")


def _check_estimator_inputs(config: Any, name: str) -> None:
    """What an estimator needs beyond its name, refused here instead of at the first advantage step."""
    _check_step_groups(config, name)
    if name in V0_ONLY_ESTIMATORS and flag_at(config, "trainer.use_v1", False):
        raise TrajConfigError(
            f"{ESTIMATOR}={name!r} needs {V0_ONLY_ESTIMATORS[name]}: on the v1 trainer the advantage step fails after "
            "the first rollout. Fix: set trainer.use_v1=false, or another estimator (e.g. grpo, rloo).",
            field=ESTIMATOR)
    if name == "gdpo" and not value_at(config, "algorithm.gdpo_reward_keys"):
        raise TrajConfigError(
            f"{ESTIMATOR}='gdpo' needs algorithm.gdpo_reward_keys (the reward components compute_score returns): "
            "verl asserts it at the first advantage step. Fix: add algorithm.gdpo_reward_keys=[key1,key2].",
            field="algorithm.gdpo_reward_keys")
    if name in NEEDS_SUM_PI_SQUARED and not flag_at(config, "actor_rollout_ref.actor.calculate_sum_pi_squared"):
        raise TrajConfigError(
            f"{ESTIMATOR}={name!r} needs sum_pi_squared from the actor's log-prob pass, which verl computes only with "
            "actor_rollout_ref.actor.calculate_sum_pi_squared=true: otherwise the advantage step fails after the "
            "first rollout. Fix: add actor_rollout_ref.actor.calculate_sum_pi_squared=true.",
            field="actor_rollout_ref.actor.calculate_sum_pi_squared")


def check_sequence_parallel(config: Any) -> None:
    """Ulysses (size > 1) runs only on the remove-padding path: verl's engine refuses it when the workers start
    (verl's ``validate_config`` checks only the actor's deprecated top-level key)."""
    for model_path, (where, sp) in sequence_parallel_sizes(config).items():
        field = f"{model_path}.use_remove_padding"
        if sp > 1 and not flag_at(config, field, False):
            raise TrajConfigError(
                f"{where} runs Ulysses sequence parallelism (ulysses_sequence_parallel_size={sp}) with {field}=false: "
                "verl's Ulysses code runs only on the remove-padding path, and its engine refuses this when the workers "
                f"start. Fix: add {field}=true, or set the Ulysses size to 1.", field=field)


def _check_model_dir(key: str, path: Any) -> Optional[str]:
    """A local model directory without ``config.json`` (or a local path that does not exist) is refused;
    hub ids and remote paths are left to verl. Returns the directory when it is local and valid."""
    if not isinstance(path, str) or not path:
        raise TrajConfigError(f"{key}={path!r} is not set. Fix: give the model directory (or hub id) to load.",
                              field=key)
    local = os.path.expanduser(path)
    if os.path.isdir(local):
        if not os.path.isfile(os.path.join(local, "config.json")):
            raise TrajConfigError(
                f"{key}={path!r} is a directory without config.json: point it at a Hugging Face model directory "
                "(the folder holding config.json and the weights).", field=key)
        return local
    if path.startswith(("/", "./", "../", "~")):
        raise TrajConfigError(f"{key}={path!r} does not exist. Fix: correct the path (or build the model first).",
                              field=key)
    return None


def _check_value_head(key: str, local: str) -> None:
    """verl builds value models as ``AutoModelForTokenClassification`` (trl's value head as a fallback)."""
    hf_config = AutoConfig.from_pretrained(local, trust_remote_code=True)
    if type(hf_config) not in MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING and not is_trl_available():
        raise TrajConfigError(
            f"{key}={local!r} is a {hf_config.model_type!r} model, which has no token-classification class in "
            "transformers: verl cannot build a value head on it (and trl is not installed). Use a critic model "
            "with one (Qwen2, Llama, Mistral, ...) or install trl.", field=key)


def check_models(config: Any) -> None:
    """Driver-side, before Ray starts: the actor's and (when on) the critic's model paths, the critic's value
    head, and equal actor / critic data-parallel sizes (one rank-major plan serves both)."""
    _check_model_dir("actor_rollout_ref.model.path", config.actor_rollout_ref.model.get("path"))
    if not uses_critic(config):
        return
    local = _check_model_dir("critic.model.path", config.critic.model.get("path"))
    if local is not None:
        _check_value_head("critic.model.path", local)
    actor_sp = ulysses_size(config.actor_rollout_ref.actor, "actor_rollout_ref.actor")
    critic_sp = ulysses_size(config.critic, "critic")
    if actor_sp != critic_sp:
        raise TrajConfigError(
            f"critic.fsdp.ulysses_sequence_parallel_size={critic_sp} differs from the actor's ({actor_sp}): the critic's "
            "data-parallel size would differ from the actor's, and verl_traj plans one rank-major layout for both. "
            f"Fix: set critic.fsdp.ulysses_sequence_parallel_size={actor_sp} (or the actor's to {critic_sp}).",
            field="critic.fsdp.ulysses_sequence_parallel_size")


def check_platform(config: Any, platform_device: str, environ: Optional[dict] = None) -> None:
    """The job's device (``trainer.device``) and the platform verl picked in this process (``platform_device``:
    ``verl.utils.device.get_device_name()``) must agree: the CPU plugin switches a process without an accelerator to
    the CPU platform, so on a CPU-only Ray head node (or one without ``nvidia-smi``) a GPU job would otherwise start
    as a CPU job and fail later at placement. ``VERL_TRAJ_CPU=0`` (set by the GPU launchers) keeps the plugin out."""
    environ = os.environ if environ is None else environ
    device = str(config.trainer.get("device", "cuda"))
    if platform_device == "cpu" and device != "cpu":
        raise TrajConfigError(
            f"trainer.device={device!r} asks for accelerators, but this process sees none and verl_traj's CPU platform "
            "is active here (a CPU-only head node?). Fix: run with VERL_TRAJ_CPU=0 so the driver keeps verl's GPU "
            "platform (examples/calc_agent/run_gpu.sh and run_multinode.sh set it), or choose a CPU preset "
            "(trainer.device=cpu).", field="trainer.device")
    if device == "cpu" and platform_device != "cpu":
        forced = environ.get("VERL_TRAJ_CPU", "")
        raise TrajConfigError(
            f"trainer.device='cpu' (a CPU preset), but verl picked the {platform_device!r} platform in this process "
            f"(an accelerator is visible{'; VERL_TRAJ_CPU=' + forced if forced else ''}). Fix: set VERL_TRAJ_CPU=1 to "
            "train on CPU anyway, or use a GPU preset (e.g. --config-name calc_agent_gpu).", field="trainer.device")
