"""The step-wise agent loop: verl's tool agent loop that records every LLM call.

:class:`StepwiseToolAgentLoop` (registered as ``"traj_stepwise_tool_agent"``) is verl's
``ToolAgentLoop`` plus :class:`StepRecordingMixin`: it records every LLM call (the exact prompt token
ids that call saw, the generated ids and their log-probs). verl's v0 trainer wants ONE output per input
row, so the loop returns the usual concatenated multi-turn row and carries the calls, delta-encoded, in
``extra_fields["traj_steps"]`` (-> ``non_tensor_batch``), plus a fresh trajectory id under
``traj.traj_id_key``. ``TrajRayPPOTrainer._balance_batch`` expands them into step rows before planning
(:mod:`verl_traj.integration.rows.stepwise_rows`).

Wiring (``traj.step_wise=true``): ``actor_rollout_ref.rollout.agent.default_agent_loop=traj_stepwise_tool_agent``
(or the dataset's ``agent_name`` column) and ``actor_rollout_ref.rollout.agent.agent_loop_config_path`` =
``configs/agent_loops/stepwise.yaml`` (:data:`AGENT_LOOP_CONFIG_YAML`: registers the class in the agent-loop
worker processes). The reward is computed once per trajectory in the agent loop (verl's reward loop ->
``rm_scores``); the expansion puts it on the last step row only.
"""

from __future__ import annotations

import logging
import re
from typing import Any, Optional
from uuid import uuid4

from verl_traj.config import TrajConfig
from verl_traj.core.errors import TrajInputError
from verl_traj.core.rollout.session_ledger import current_ledger
from verl_traj.integration.agent_loops.call_branches import (begin_session, end_session, record_call, truncate_calls,
                                                              with_leaf_outcomes)
from verl_traj.integration.agent_loops.tool_call_checks import check_tool_call
from verl_traj.integration.patches.process import install, tool_parser_log_patches
from verl_traj.stepwise.anchors import anchor_key
from verl_traj.stepwise.expand import DEFAULT_STEPS_KEY, StepExpansionError, encode_step_records

logger = logging.getLogger(__name__)

AGENT_LOOP_NAME = "traj_stepwise_tool_agent"
AGENT_LOOP_CONFIG_YAML = (
    f"- name: {AGENT_LOOP_NAME}\n"
    "  _target_: verl_traj.integration.agent_loops.stepwise_agent_loop.StepwiseToolAgentLoop\n"
)

__all__ = [
    "AGENT_LOOP_NAME",
    "CountingToolParser",
    "counting_tool_parser",
    "MalformedToolCallCounter",
    "AGENT_LOOP_CONFIG_YAML",
    "RecordingServerManager",
    "StepRecordingMixin",
    "StepwiseToolAgentLoop",
    "truncate_calls",
    "with_anchor_keys",
]


class RecordingServerManager:
    """Wraps verl's ``LLMServerClient``: forwards everything, records each ``generate`` call."""

    def __init__(self, inner: Any, sink: list[dict[str, Any]]):
        self._inner = inner
        self._sink = sink

    async def generate(self, *args: Any, **kwargs: Any) -> Any:
        out = await self._inner.generate(*args, **kwargs)
        prompt_ids = kwargs["prompt_ids"] if "prompt_ids" in kwargs else args[1]
        record_call(self._sink, {  # with its parent: the last call on this branch (call_branches)
            "prompt_ids": list(prompt_ids),
            "response_ids": list(out.token_ids),
            "response_logprobs": list(out.log_probs) if getattr(out, "log_probs", None) else None,
        })
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


# what verl 0.9.1's tool parsers log, at ERROR, for each call they cannot decode ("Failed to decode tool call: ...",
# "Failed to decode GLM tool call: ...", ...); a call they drop without a log line is not counted
MALFORMED_TOOL_CALL_LOG = re.compile(r"Failed to decode (\S+ )?tool call")


class MalformedToolCallCounter(logging.Filter):
    """On verl's tool-parser logger: inside a training session (:func:`~verl_traj.core.rollout.session_ledger.current_ledger`),
    a tool call the model wrote malformed is counted for ``traj_agent/malformed_tool_call_share`` instead of logged as
    an ERROR (the policy learning its format is expected behaviour, worth a metric, not an alarm); outside one it is
    logged."""

    def filter(self, record: logging.LogRecord) -> bool:
        ledger = current_ledger()
        if ledger is None or not MALFORMED_TOOL_CALL_LOG.match(str(record.msg)):
            return True
        ledger.malformed_tool_calls += 1
        return False


class CountingToolParser:
    """Wraps a verl tool parser: counts the tool calls it parses into the session's ledger."""

    def __init__(self, inner: Any):
        self._inner = inner

    async def extract_tool_calls(self, *args: Any, **kwargs: Any) -> Any:
        content, calls = await self._inner.extract_tool_calls(*args, **kwargs)
        ledger = current_ledger()
        if ledger is not None:
            ledger.tool_calls += len(calls)
        return content, calls

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def add_malformed_counter(logger: logging.Logger) -> None:
    """Put :class:`MalformedToolCallCounter` on ``logger`` unless it has one."""
    if not any(isinstance(f, MalformedToolCallCounter) for f in logger.filters):
        logger.addFilter(MalformedToolCallCounter())


def counting_tool_parser(parser: Any) -> CountingToolParser:
    """verl's tool ``parser`` with its tool calls counted into the running session's ledger, parsed
    (:class:`CountingToolParser`) and malformed (:class:`MalformedToolCallCounter` on verl's tool-parser logger,
    installed once per process: inside a session the decode failures are counted, not logged). The one way the
    training loop and the offline evaluation (``recipes/calc_agent/evaluate.py``) count tool calls."""
    install(tool_parser_log_patches(add_malformed_counter), on_import=None)  # idempotent
    return parser if isinstance(parser, CountingToolParser) else CountingToolParser(parser)


try:
    from verl.experimental.agent_loop.agent_loop import register as _register
    from verl.experimental.agent_loop.tool_agent_loop import ToolAgentLoop as _ToolAgentLoop
    from verl.tools.schemas import ToolResponse as _ToolResponse
except ImportError as _exc:  # verl's agent loop needs optional deps (PIL, ...): keep the rest usable
    logger.warning("StepwiseToolAgentLoop unavailable: %s", _exc)
    _ToolAgentLoop = None


class StepRecordingMixin:
    """Records every LLM call of any verl agent loop: ``class MyStepwise(StepRecordingMixin, MyAgentLoop)``.

    Wraps ``self.server_manager`` during ``run`` and writes the calls (the exact prompt ids each call
    saw, the generated ids and log-probs), clipped to the row's budget and delta-encoded (O(T)), to
    ``extra_fields["traj_steps"]`` (``DEFAULT_STEPS_KEY``: the one name every reader uses), plus a fresh
    trajectory id under ``traj.traj_id_key`` (read from the loop's ``self.config``, verl's whole training config).

    Turn rewards: override :meth:`step_rewards` to give each LLM call a reward of its own (a tool result, a checker,
    a shaped signal); it lands on that call's last response token, the trajectory's outcome stays on its last call.
    Temporal estimators (GAE, REINFORCE++) discount it through the trajectory's timeline; an outcome estimator
    scores a trajectory by its outcome plus its turn rewards. Both trainers (v1 carries them as row tags:
    :data:`~verl_traj.core.rollout.row_tags.TURN_REWARD_TAG`).
    """

    recorder_cls = RecordingServerManager  # a subclass may rewrite what each call is sent (it records what is sent)

    def step_rewards(self, calls: list[dict[str, Any]], output: Any) -> Optional[list[float]]:
        """One reward per recorded LLM call (``calls``: its ``prompt_ids``, ``response_ids``, ...), or ``None`` (the
        default: outcome only). Called once the trajectory finished."""
        return None

    def anchor_keys(self, calls: list[dict[str, Any]], output: Any) -> Optional[list[Any]]:
        """One anchor state per recorded LLM call, for GiGPO's step groups (``algorithm.adv_estimator=gigpo``): a
        ``str``, ``bytes``, ``int`` or tuple of them describing the state the call acted from (calls of one GRPO group
        with equal keys form a step group), or ``None`` (the default: the tokens each call saw since the previous
        one, :func:`~verl_traj.stepwise.anchors.observation_anchor`). For environments whose state is not the text,
        or to match similar observations (normalise them into one key). Called once the trajectory finished."""
        return None

    def leaf_rewards(self, calls: list[dict[str, Any]], output: Any) -> Optional[list[Optional[float]]]:
        """A session whose calls branch (forks, sub-agents): one entry per recorded call, each leaf's own outcome
        (a number at every call no other call continues, ``call_branches.leaves``; ``None`` elsewhere), or ``None``
        (the default: the session's outcome on every leaf). Called once the session finished."""
        return None

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any):
        calls: list[dict[str, Any]] = []
        inner = self.server_manager
        self.server_manager = self.recorder_cls(inner, calls)
        session = begin_session()  # this session's calls chain from a fresh context (call_branches: forks, sub-agents)
        try:
            output = await super().run(sampling_params, **kwargs)
        finally:
            self.server_manager = inner
            end_session(session)
        response_length = getattr(self, "response_length", None)
        if response_length is None:
            response_length = self.rollout_config.response_length
        budget = len(output.prompt_ids) + int(response_length)
        rewards = self.step_rewards(calls, output)
        if rewards is not None:
            if len(rewards) != len(calls):
                raise StepExpansionError(
                    f"step_rewards returned {len(rewards)} rewards for {len(calls)} LLM calls. Fix: give one reward "
                    "per recorded call (0.0 for none).", field="step_rewards", every_rollout=True)
            calls = [dict(call, reward=float(r)) for call, r in zip(calls, rewards)]
        calls = with_leaf_outcomes(calls, self.leaf_rewards(calls, output))
        calls = with_anchor_keys(calls, self.anchor_keys(calls, output))
        output.extra_fields[DEFAULT_STEPS_KEY] = encode_step_records(truncate_calls(calls, budget))
        traj_cfg = TrajConfig.of(getattr(self, "config", None))
        output.extra_fields[traj_cfg.traj_id_key] = uuid4().hex
        return output


if _ToolAgentLoop is not None:

    @_register(AGENT_LOOP_NAME)
    class StepwiseToolAgentLoop(StepRecordingMixin, _ToolAgentLoop):
        """verl's tool agent loop, plus one record per LLM call (for one training row per turn) and its tool calls
        counted, parsed and malformed (``traj_agent/*``, v1); a call no tool can run (unknown name, arguments the
        tool's schema refuses) is answered with what is wrong and counted malformed instead of run and logged
        (:func:`~verl_traj.integration.agent_loops.tool_call_checks.check_tool_call`)."""

        def __init__(self, *args: Any, **kwargs: Any):
            super().__init__(*args, **kwargs)
            self.tool_parser = counting_tool_parser(self.tool_parser)

        async def _call_tool(self, tool_call: Any, tools_kwargs: dict[str, Any], agent_data: Any) -> Any:
            problem = check_tool_call(tool_call, getattr(agent_data, "_active_tools", self.tools))
            if problem is not None:
                return _ToolResponse(text=problem), 0.0, {}
            return await super()._call_tool(tool_call, tools_kwargs, agent_data)

else:  # pragma: no cover
    StepwiseToolAgentLoop = None  # type: ignore[assignment,misc]


def with_anchor_keys(calls: list[dict[str, Any]], keys: Optional[list[Any]]) -> list[dict[str, Any]]:
    """``calls`` with each one's ``anchor`` (:func:`~verl_traj.stepwise.anchors.anchor_key` of the loop's own key);
    unchanged for ``None``. A wrong count or an unhashable key stops training (the loop's contract, every rollout)."""
    if keys is None:
        return calls
    if isinstance(keys, (str, bytes)) or not hasattr(keys, "__len__") or len(keys) != len(calls):
        raise StepExpansionError(
            f"anchor_keys returned {keys!r:.80} for {len(calls)} LLM calls. Fix: return one key per recorded call (a "
            "list), or None for the default (the tokens each call saw since the previous one).", field="anchor_keys",
            every_rollout=True)
    try:
        return [dict(call, anchor=anchor_key(key, f"anchor_keys()[{k}]")) for k, (call, key) in enumerate(zip(calls, keys))]
    except TrajInputError as exc:
        raise StepExpansionError(str(exc), field="anchor_keys", every_rollout=True) from None
