"""Step-wise multi-turn training in verl's v0 trainer: agent loop + batch expansion + advantages.

Three pieces, all thin adapters over the pure :mod:`verl_traj.stepwise` functions:

1. :class:`StepwiseToolAgentLoop` (registered as ``"traj_stepwise_tool_agent"``): verl's
   ``ToolAgentLoop`` that records every LLM call (the exact prompt token ids that call saw, the
   generated ids and their log-probs). verl's v0 trainer wants ONE output per input row, so the
   loop returns the usual concatenated multi-turn row and carries the calls, delta-encoded, in
   ``extra_fields["traj_steps"]`` (-> ``non_tensor_batch``), plus ``extra_fields["traj_id"]``.
2. :func:`expand_dataproto_step_rows`: called by the trainer's ``_balance_batch`` hook (before
   planning): replaces the batch, in place, by one row per LLM call (or prefix-merged rows),
   reward on the last step row only.
3. :func:`compute_stepwise_advantage`: drop-in for ``verl.trainer.ppo.ray_trainer.compute_advantage``
   (same signature). On step rows it runs the registered outcome estimator once per trajectory and
   broadcasts it to every step row on the row's own ``response_mask``; on ordinary batches it calls
   verl's function unchanged.

Wiring (``traj.step_wise=true``): ``TrajRayPPOTrainer._balance_batch`` calls
:func:`expand_dataproto_step_rows` before planning, and ``TrajRayPPOTrainer.fit`` installs
:func:`stepwise_compute_advantage_installed` outside its real-rows wrappers. The rollout side needs
``actor_rollout_ref.rollout.agent.default_agent_loop=traj_stepwise_tool_agent`` (or the dataset's
``agent_name`` column) and ``actor_rollout_ref.rollout.agent.agent_loop_config_path`` = a YAML file
containing :data:`AGENT_LOOP_CONFIG_YAML` (registers the class in the agent-loop worker processes).
The reward must be computed once per trajectory in the agent loop (verl's reward loop ->
``rm_scores``); :func:`expand_dataproto_step_rows` puts it on the last step row only.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from typing import Any, Iterator, Optional
from uuid import uuid4

import numpy as np
import torch

from verl_traj.stepwise.advantages import compute_trajectory_advantages
from verl_traj.stepwise.expand import DEFAULT_STEPS_KEY, encode_step_records, expand_step_rows

logger = logging.getLogger(__name__)

AGENT_LOOP_NAME = "traj_stepwise_tool_agent"
AGENT_LOOP_CONFIG_YAML = (
    f"- name: {AGENT_LOOP_NAME}\n"
    "  _target_: verl_traj.integration.stepwise_agent_loop.StepwiseToolAgentLoop\n"
)

__all__ = [
    "AGENT_LOOP_NAME",
    "AGENT_LOOP_CONFIG_YAML",
    "RecordingServerManager",
    "StepRecordingMixin",
    "StepwiseToolAgentLoop",
    "expand_dataproto_step_rows",
    "compute_stepwise_advantage",
    "is_stepwise_batch",
    "truncate_calls",
    ]


class RecordingServerManager:
    """Wraps verl's ``LLMServerClient``: forwards everything, records each ``generate`` call."""

    def __init__(self, inner: Any, sink: list[dict[str, Any]]):
        self._inner = inner
        self._sink = sink

    async def generate(self, *args: Any, **kwargs: Any) -> Any:
        out = await self._inner.generate(*args, **kwargs)
        prompt_ids = kwargs["prompt_ids"] if "prompt_ids" in kwargs else args[1]
        self._sink.append(
            {
                "prompt_ids": list(prompt_ids),
                "response_ids": list(out.token_ids),
                "response_logprobs": list(out.log_probs) if getattr(out, "log_probs", None) else None,
            }
        )
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


try:
    from verl.experimental.agent_loop.agent_loop import register as _register
    from verl.experimental.agent_loop.tool_agent_loop import ToolAgentLoop as _ToolAgentLoop
except ImportError as _exc:  # verl's agent loop needs optional deps (PIL, ...): keep the rest usable
    logger.warning("StepwiseToolAgentLoop unavailable: %s", _exc)
    _ToolAgentLoop = None

class StepRecordingMixin:
    """Records every LLM call of any verl agent loop: ``class MyStepwise(StepRecordingMixin, MyAgentLoop)``.

    Wraps ``self.server_manager`` during ``run`` and writes the calls (the exact prompt ids each call
    saw, the generated ids and log-probs), clipped to the row's budget and delta-encoded (O(T)), to
    ``extra_fields["traj_steps"]``, plus a fresh ``extra_fields["traj_id"]``.
    """

    steps_key = DEFAULT_STEPS_KEY
    traj_id_key = "traj_id"

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any):
        calls: list[dict[str, Any]] = []
        inner = self.server_manager
        self.server_manager = RecordingServerManager(inner, calls)
        try:
            output = await super().run(sampling_params, **kwargs)
        finally:
            self.server_manager = inner
        response_length = getattr(self, "response_length", None)
        if response_length is None:
            response_length = self.rollout_config.response_length
        budget = len(output.prompt_ids) + int(response_length)
        output.extra_fields[self.steps_key] = encode_step_records(truncate_calls(calls, budget))
        output.extra_fields[self.traj_id_key] = uuid4().hex
        return output


if _ToolAgentLoop is not None:

    @_register(AGENT_LOOP_NAME)
    class StepwiseToolAgentLoop(StepRecordingMixin, _ToolAgentLoop):
        """verl's tool agent loop, plus one record per LLM call (for one training row per turn)."""

else:  # pragma: no cover
    StepwiseToolAgentLoop = None  # type: ignore[assignment,misc]


def truncate_calls(calls: list[dict[str, Any]], max_context: int) -> list[dict[str, Any]]:
    """Clip recorded calls to the row's budget (``len(prompt) + rollout.response_length``), as verl
    truncates the concatenated row: a response is cut where prompt+response reaches ``max_context``;
    a call whose prompt alone reaches it is dropped (so no step row is longer than a verl row)."""
    out = []
    for call in calls:
        room = max_context - len(call["prompt_ids"])
        if room <= 0:
            break
        if len(call["response_ids"]) > room:
            call = dict(call)
            call["response_ids"] = call["response_ids"][:room]
            if call.get("response_logprobs") is not None:
                call["response_logprobs"] = call["response_logprobs"][:room]
        out.append(call)
    return out


def is_stepwise_batch(data: Any, traj_id_key: str = "traj_id", is_last_step_key: str = "is_last_step") -> bool:
    """The batch holds step rows (has per-row trajectory ids and last-step flags)."""
    nt = getattr(data, "non_tensor_batch", {}) or {}
    return traj_id_key in nt and is_last_step_key in nt


def expand_dataproto_step_rows(
    data: Any,
    *,
    merge_prefix: bool = False,
    pad_token_id: int = 0,
    steps_key: str = DEFAULT_STEPS_KEY,
    traj_id_key: str = "traj_id",
    step_index_key: str = "step_index",
    is_last_step_key: str = "is_last_step",
    pad_to_multiple_of: int = 1,
    drop_keys: tuple[str, ...] = (),
) -> dict[str, float]:
    """Replace ``data`` (a verl ``DataProto`` with one row per trajectory) IN PLACE by its step rows.

    Call it first in the trainer's ``_balance_batch`` (before ``build_layout`` / planning) when
    ``traj.step_wise``; pass ``merge_prefix=traj.merge_prefix`` and the tokenizer's pad id.
    Returns metrics (``traj_stepwise/rows_before``, ``rows_after``, ``tokens_before``, ...).
    A batch that is already expanded (has ``step_index_key``) is left unchanged.
    """
    from tensordict import TensorDict

    if step_index_key in data.non_tensor_batch and is_last_step_key in data.non_tensor_batch:
        return {}
    tensors = {k: data.batch[k] for k in data.batch.keys()}
    out = expand_step_rows(
        tensors,
        dict(data.non_tensor_batch),
        steps_key=steps_key,
        merge_prefix=merge_prefix,
        pad_token_id=pad_token_id,
        traj_id_key=traj_id_key,
        step_index_key=step_index_key,
        is_last_step_key=is_last_step_key,
        pad_to_multiple_of=pad_to_multiple_of,
        drop_keys=drop_keys,
    )
    n = int(out.source_row.numel())
    device = data.batch.device if hasattr(data.batch, "device") else None
    data.batch = TensorDict({k: v for k, v in out.tensors.items()}, batch_size=[n], device=device)
    data.non_tensor_batch = out.non_tensors
    return out.metrics()


def compute_stepwise_advantage(
    data: Any,
    adv_estimator: Any,
    gamma: float = 1.0,
    lam: float = 1.0,
    num_repeat: int = 1,
    norm_adv_by_std_in_grpo: bool = True,
    config: Optional[Any] = None,
    *,
    traj_id_key: str = "traj_id",
    is_last_step_key: str = "is_last_step",
    reward_reduction: Optional[str] = None,
) -> Any:
    """Drop-in for verl's module-level ``compute_advantage`` (RT ~187), step-row aware.

    Step rows (``traj_id`` and ``is_last_step`` in ``non_tensor_batch``): the estimator named by
    ``adv_estimator`` runs ONCE per trajectory (grouped by ``uid``) and each row gets its
    trajectory's scalar on its own ``response_mask``. Temporal estimators (``gae``,
    ``reinforce_plus_plus``, ...) raise. ``reward_reduction`` defaults to ``"sum"`` when
    ``config.use_kl_in_reward`` (KL penalties sit on every step row), else ``"last_step"``.
    Other batches: verl's ``compute_advantage`` unchanged.
    """
    from verl.trainer.ppo import core_algos

    if not is_stepwise_batch(data, traj_id_key, is_last_step_key):
        return _verl_compute_advantage()(data, adv_estimator, gamma=gamma, lam=lam, num_repeat=num_repeat,
                                         norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo, config=config)

    if "response_mask" not in data.batch.keys():
        from verl.trainer.ppo.ray_trainer import compute_response_mask

        data.batch["response_mask"] = compute_response_mask(data)
    name = str(getattr(adv_estimator, "value", adv_estimator))
    from verl_traj.stepwise.advantages import check_stepwise_estimator

    check_stepwise_estimator(name, allow_custom=True)
    estimator_fn = core_algos.get_adv_estimator_fn(name)
    params = inspect.signature(estimator_fn).parameters
    accepts_var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    extra = {"norm_adv_by_std_in_grpo": norm_adv_by_std_in_grpo, "config": config}
    extra = {k: v for k, v in extra.items() if k in params or (accepts_var_kw and k == "config")}
    if reward_reduction is None:
        use_kl = bool(config.get("use_kl_in_reward", False)) if config is not None and hasattr(config, "get") else False
        reward_reduction = "sum" if use_kl else "last_step"
    is_padding = _is_padding(data)
    adv, ret, _, _ = compute_trajectory_advantages(
        data.batch["token_level_rewards"],
        data.batch["response_mask"],
        data.non_tensor_batch["uid"],
        data.non_tensor_batch[traj_id_key],
        data.non_tensor_batch[is_last_step_key],
        is_padding,
        estimator_fn=estimator_fn,
        estimator_name=name,
        reward_reduction=reward_reduction,
        reward_baselines=data.batch["reward_baselines"] if "reward_baselines" in data.batch.keys() else None,
        estimator_kwargs=extra,
        allow_custom=True,
    )
    data.batch["advantages"] = adv
    data.batch["returns"] = ret
    return data


def _verl_compute_advantage():
    """verl's own ``compute_advantage`` (never one of our wrappers: no recursion whatever is installed)."""
    from verl.trainer.ppo import ray_trainer

    fn = getattr(ray_trainer, "_verl_traj_original_compute_advantage", None)
    if fn is None:
        fn = inspect.unwrap(ray_trainer.compute_advantage)
        if fn is compute_stepwise_advantage:  # patched without install_compute_advantage()
            raise RuntimeError("verl's compute_advantage was replaced without install_compute_advantage(); "
                               "cannot find the original to fall back to.")
    return fn


def _is_padding(data: Any) -> Optional[np.ndarray]:
    if "is_padding" in data.non_tensor_batch:
        return np.asarray(data.non_tensor_batch["is_padding"], dtype=bool)
    if "is_padding" in data.batch.keys():
        return data.batch["is_padding"].detach().cpu().numpy().astype(bool)
    return None


def install_compute_advantage() -> None:
    """Make verl's v0 ``fit`` use :func:`compute_stepwise_advantage` (it looks the name up as a
    module global of ``verl.trainer.ppo.ray_trainer``). Idempotent; non-step batches are unchanged."""
    from verl.trainer.ppo import ray_trainer

    if getattr(ray_trainer, "_verl_traj_original_compute_advantage", None) is None:
        ray_trainer._verl_traj_original_compute_advantage = ray_trainer.compute_advantage
    ray_trainer.compute_advantage = compute_stepwise_advantage


@contextlib.contextmanager
def stepwise_compute_advantage_installed() -> Iterator[None]:
    """Context manager form of :func:`install_compute_advantage` that restores verl's global on exit.

    Enter it OUTSIDE the trainer's ``fit_globals_on_real_rows()`` so the real-rows wrapper wraps it.
    """
    from verl.trainer.ppo import ray_trainer

    saved = ray_trainer.compute_advantage
    had_original = hasattr(ray_trainer, "_verl_traj_original_compute_advantage")
    install_compute_advantage()
    try:
        yield
    finally:
        ray_trainer.compute_advantage = saved
        if not had_original and hasattr(ray_trainer, "_verl_traj_original_compute_advantage"):
            del ray_trainer._verl_traj_original_compute_advantage


__all__ += ["install_compute_advantage", "stepwise_compute_advantage_installed"]
