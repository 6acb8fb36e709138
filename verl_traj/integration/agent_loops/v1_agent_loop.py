"""Step-wise rows on verl's v1 trainer: one stored row per (prefix-merged) LLM call, cut where the session ends.

v1's ``AgentLoopWorkerTQ`` stores every ``AgentLoopOutput`` of a session as its own TransferQueue row
(``{uid}_{session}_{index}``). verl_traj's step-wise loops
(:class:`~verl_traj.integration.agent_loops.stepwise_agent_loop.StepRecordingMixin`) return the usual concatenated
multi-turn output plus the calls they recorded.
:class:`TrajAgentLoopWorkerTQ` scores that output ONCE -- the whole trajectory, exactly what verl's reward
functions see on v0 -- and then hands verl its step rows instead (prefix-merged with ``traj.merge_prefix``), so:

* trajectory = session, step = output index, last step = the session's last output (the trainer reads all three
  from the keys: :mod:`verl_traj.integration.trainers.v1_planning`);
* the trajectory's reward sits on every step row (v1 copies it there); verl_traj's advantage reads it from the
  last step row only, so it is counted once per trajectory (also in KL-in-reward's sum);
* turn rewards (a reward per LLM call, :meth:`~verl_traj.integration.agent_loops.stepwise_agent_loop.StepRecordingMixin.
  step_rewards`) travel as a sparse tag of each row that has any (``traj_turn_rewards``: ``[[position, reward],
  ...]`` on the row's response tokens), since v1's row fields are fixed; the trainer puts them back on their tokens
  (:func:`turn_reward_entries`) for the step-wise advantage, as v0's expansion does;
* with ``traj.enable=false`` (stock verl on step rows, for a side-by-side run) every LLM call is its own row, as an
  agent loop that returns one output per call gives verl: no prefix merging, no turn rewards;
* with ``traj.step_wise=false`` (the records of a step-wise loop are then dropped) and for validation (as verl's
  validation metrics expect) rows stay whole: one row per trajectory;
* the merge statistics travel as a tag of each session's first row (``traj_merge``), for ``traj_stepwise/*``.

This runs in the agent-loop workers, as each session finishes: no extra pass over the batch on the trainer.
The same worker numbers each session's requests for ``rollout.full_determinism`` (:func:`session_priority`).
``prepare_config`` selects :class:`TrajAgentLoopManagerTQ` (``actor_rollout_ref.rollout.agent.
agent_loop_manager_class``) on v1; with ``traj.enable=false`` it only numbers the requests (stock rows otherwise).
"""

from __future__ import annotations

import dataclasses
import zlib
from typing import Any

import ray
import transfer_queue as tq

from verl.experimental.agent_loop.agent_loop import AgentLoopOutput
from verl.trainer.ppo.v1.agent_loop_tq import AgentLoopManagerTQ, AgentLoopWorkerTQ

from verl_traj.config import TrajConfig
from verl_traj.core.rollout.row_key import row_key
from verl_traj.core.rollout.row_tags import (MERGE_TAG, TREE_CALLS_TAG, TREE_OUTCOMES_TAG, TURN_REWARD_TAG, anchor_tag,
                                             row_fact_tags, sparse_tag, turn_reward_tag)
from verl_traj.core.rollout.session_ledger import current_ledger, session_ledger
from verl_traj.integration.async_modes.v1_failures import run_session
from verl_traj.integration.async_modes.v1_staleness import check_recording
from verl_traj.integration.config.access import value_at
from verl_traj.integration.rows.credit import load_rules, records_anchors
from verl_traj.stepwise.flat_rows import TREE_CALL, TREE_OUTCOME
from verl_traj.stepwise.expand import (DEFAULT_STEPS_KEY, STEP_ANCHOR, TURN_REWARD, StepExpansionError,
                                       trajectory_step_rows)

__all__ = ["UNSUPPORTED_STEP_FIELDS", "TrajAgentLoopManagerTQ",
           "TrajAgentLoopWorkerTQ", "check_recorded", "check_step_output", "check_version_fields", "session_priority",
           "step_outputs"]



# AgentLoopOutput fields that hold per-token or per-image data of the whole trajectory, which the step rows would
# need re-cut per LLM call (v0 refuses the same fields in its expansion: stepwise/expand.py)
UNSUPPORTED_STEP_FIELDS = ("routed_experts", "multi_modal_data", "mm_processor_output")


def tree_tags(per_token: dict) -> dict:
    """A branching session's row: its calls' packed leaf spans and leaves' own outcomes as sparse tags (v0's
    expansion writes the same as ``[B, R]`` fields); ``{}`` for a chain's row."""
    if TREE_CALL not in per_token:
        return {}
    return {**sparse_tag(TREE_CALLS_TAG, per_token[TREE_CALL]), **sparse_tag(TREE_OUTCOMES_TAG, per_token[TREE_OUTCOME])}


def check_step_output(output: AgentLoopOutput) -> None:
    """Refuse a trajectory whose output carries :data:`UNSUPPORTED_STEP_FIELDS`: step rows without them would train
    silently without MoE router replay or without the images."""
    for name in UNSUPPORTED_STEP_FIELDS:
        value = getattr(output, name, None)
        if value is not None and not (hasattr(value, "__len__") and len(value) == 0):
            raise StepExpansionError(
                f"the agent loop's output carries {name} (MoE router replay or multi-modal data), which step rows "
                f"cannot carry yet: each LLM call would have to get its own slice. Fix: set traj.step_wise=false (one "
                f"row per trajectory keeps {name}), or turn router replay / multi-modal inputs off.", field=name)


def step_outputs(output: AgentLoopOutput, merge_prefix: bool, steps_key: str = DEFAULT_STEPS_KEY,
                 turn_rewards: bool = True, anchors: bool = False,
                 branch_paths: bool = False) -> tuple[list[AgentLoopOutput], list[dict], dict[str, int]]:
    """The step rows of one scored trajectory output, as agent-loop outputs (the last carries the reward; extra
    fields but the step records are kept on every row), each row's tag (its turn rewards, see
    :data:`TURN_REWARD_TAG`; empty without) and the merge statistics. ``turn_rewards=False`` (stock verl on step
    rows) refuses records that carry them. ``anchors``: each row's tag also carries its calls' anchor keys
    (:data:`~verl_traj.core.rollout.row_tags.STEP_ANCHOR_TAG`, for ``gigpo``)."""
    check_step_output(output)
    extra = {k: v for k, v in output.extra_fields.items() if k != steps_key}
    rows, stats = trajectory_step_rows(output.prompt_ids, output.response_ids, output.response_mask,
                                       output.response_logprobs, output.extra_fields.get(steps_key),
                                       merge_prefix=merge_prefix, branch_paths=branch_paths)
    tags = [{**turn_reward_tag(row.per_token[TURN_REWARD]), **(anchor_tag(row.per_token[STEP_ANCHOR]) if anchors else {}),
             **tree_tags(row.per_token)} for row in rows]
    if not turn_rewards and any(TURN_REWARD_TAG in t for t in tags):
        raise StepExpansionError(
            "the step records carry turn rewards (a 'reward' per LLM call) but traj.enable=false: stock verl has no "
            "channel for them (it copies the trajectory's reward onto every step row). Fix: set traj.enable=true, or "
            "drop the rewards from the records.", field="reward")
    outputs = [
        AgentLoopOutput(
            prompt_ids=row.prompt_ids.tolist(), response_ids=row.response_ids.tolist(),
            response_mask=row.response_mask.tolist(),
            response_logprobs=row.per_token["lp"].tolist() if "lp" in row.per_token else None,
            reward_score=output.reward_score if row.is_last_step else None,
            num_turns=output.num_turns, metrics=output.metrics, extra_fields=dict(extra),
        )
        for row in rows
    ]
    return outputs, tags, dataclasses.asdict(stats)


def check_recorded(output: Any, agent_name: Any, anchors: bool = False) -> None:
    """With ``traj.step_wise``: a multi-turn trajectory (more than one prompt and one answer) must carry its step
    records; without them it would silently train as one row. With ``anchors`` (``gigpo``) a loop's list of outputs
    is refused too (its rows carry no calls to key); a one-call output without records is cut as v0 cuts it."""
    if isinstance(output, list):
        if anchors:
            raise StepExpansionError(
                f"algorithm.adv_estimator=gigpo, but agent loop {agent_name!r} returned a list of outputs (one row "
                "each) instead of one trajectory with step records: GiGPO cannot tell which calls its rows hold. Fix: "
                "return one AgentLoopOutput and record the calls with StepRecordingMixin (docs/agent_loops.md), or "
                "algorithm.adv_estimator=grpo.", field="algorithm.adv_estimator", every_rollout=True)
        return
    if DEFAULT_STEPS_KEY not in output.extra_fields and (output.num_turns or 0) > 2:
        raise StepExpansionError(
            f"traj.step_wise=true, but agent loop {agent_name!r} returned a trajectory of {output.num_turns} turns "
            f"without step records (extra_fields[{DEFAULT_STEPS_KEY!r}]): it would train as one row, not one row per "
            "LLM call. Fix: put verl_traj.integration.agent_loops.stepwise_agent_loop.StepRecordingMixin first in the loop's "
            "bases (docs/agent_loops.md), or set traj.step_wise=false.", field="traj.step_wise", every_rollout=True)


def check_version_fields(output: AgentLoopOutput, agent_name: Any) -> None:
    """verl's v1 trainer reads ``min_global_steps`` / ``max_global_steps`` from every row's ``extra_fields`` (a loop
    that builds its output without them crashes inside verl's metrics): refuse it here, naming the fix."""
    missing = [k for k in ("min_global_steps", "max_global_steps") if output.extra_fields.get(k) is None]
    if missing:
        raise StepExpansionError(
            f"agent loop {agent_name!r} returned extra_fields without {missing}, the policy versions verl's v1 trainer "
            "reads from every row, and the rollout server reported none verl_traj could fill them from. Fix: copy the "
            "server output's extra_fields into the AgentLoopOutput (extra_fields=dict(output.extra_fields), as verl's "
            "loops do), or use a rollout server that reports global_steps.", field="extra_fields", every_rollout=True)


def _actor_base(actor_class: Any) -> type:
    """The class to subclass for a ``@ray.remote`` class: Ray's modified class (a subclass of the original that an
    actor process resolves consistently; subclassing ``__ray_actor_class__`` breaks verl's zero-argument
    ``super()`` calls in the actor process)."""
    meta = getattr(actor_class, "__ray_metadata__", None)
    return getattr(meta, "modified_class", None) or actor_class.__ray_actor_class__


def session_priority(sample_index: Any, session_id: int, n: int) -> int:
    """A request priority unique per (prompt, session) and the same in every run: ``sample_index * n + session``
    (``sample_index``: the dataset's ``index`` column; a non-integer index is hashed)."""
    try:
        base = int(sample_index)
    except (TypeError, ValueError):
        base = zlib.crc32(str(sample_index).encode())
    return base * max(int(n), 1) + int(session_id)


def written_row_tags(outputs: list[AgentLoopOutput], hashes: bool = True) -> list[dict]:
    """Each training row's facts for the trainer's plan, from what verl's ``AgentLoopWorkerTQ`` stores of it
    (``input_ids`` = prompt ids then response ids): its loss tokens and, where the run may plan prefix trees
    (``hashes``: ``traj.prefix_tree`` not false), its prefix block hashes
    (:func:`~verl_traj.core.rollout.row_tags.row_fact_tags`), so planning fetches no per-token field."""
    return row_fact_tags([[*o.prompt_ids, *o.response_ids] for o in outputs], [o.response_mask for o in outputs],
                         hashes)


class TrajAgentLoopWorkerTQ(_actor_base(AgentLoopWorkerTQ)):
    """verl's v1 agent-loop worker that stores a step-wise session as its step rows (module docstring), and
    gives each session its own request priority under ``rollout.full_determinism`` (v0 numbers its samples;
    v1 leaves every request at priority 0, and verl's agent loops name deterministic requests ``det-{priority}``,
    so all sessions would share one id and their sampling seeds would follow arrival order). With ``traj.enable`` each
    training session runs under ``traj.trajectory_timeout_s`` and a failed one tags its group with the reason and
    leaves no rows (:func:`~verl_traj.integration.async_modes.v1_failures.run_session`)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        # read once per worker: every session below uses these (no per-session work that grows with the config)
        self.traj_config = traj_config = TrajConfig.of(self.config)
        load_rules(traj_config.credit_rule_modules)  # this worker's process knows every rule (traj.credit_rule_modules)
        self.records_anchors = traj_config.enable and records_anchors(
            value_at(self.config, "algorithm.adv_estimator", "grpo"))
        rollout = self.config.actor_rollout_ref.rollout
        # full_determinism: each session's request priority from its sample and session (train / validation n)
        self.session_counts = ((int(rollout.n), int(rollout.val_kwargs.n)) if rollout.get("full_determinism", False)
                               else None)
        if traj_config.enable:  # the policy version of every token (traj_version/token_*, traj.max_staleness)
            check_recording(self.llm_client, traj_config.max_staleness)

    async def _run_agent_loop(self, sampling_params: dict, trajectory: dict, **kwargs: Any) -> Any:
        if self.session_counts is not None and "priority" not in kwargs:
            n = self.session_counts[1] if trajectory.get("validate") else self.session_counts[0]
            kwargs["priority"] = session_priority(trajectory["sample_index"], kwargs.get("session_id", 0), n)
        session = super()._run_agent_loop(sampling_params, trajectory, **kwargs)
        traj_config = self.traj_config
        if trajectory.get("validate") or not traj_config.enable:
            return await session
        with session_ledger(kwargs.get("agent_name")):
            return await run_session(session, traj_config.trajectory_timeout_s, str(kwargs["uid"]),
                                     int(kwargs.get("session_id", 0)))

    async def _agent_loop_postprocess(self, output: Any, validate: bool, **kwargs: Any) -> None:
        traj_config = self.traj_config
        ledger = None if validate else current_ledger()
        ledger_tags = ledger.tags() if ledger is not None else {}  # the session's versions and tool calls
        name = ledger.agent_name if ledger is not None else kwargs.get("agent_name")
        anchors = self.records_anchors
        if traj_config.step_wise and not validate:
            check_recorded(output, name, anchors)
        for out in [] if validate else output if isinstance(output, list) else [output]:  # training rows
            if ledger is not None:
                ledger.fill_version_fields(out.extra_fields)
            check_version_fields(out, name)
        recorded = not isinstance(output, list) and (DEFAULT_STEPS_KEY in output.extra_fields or anchors)
        if validate or not traj_config.step_wise or not recorded:  # verl's rows: validation, a list, no records
            if not isinstance(output, list):
                output.extra_fields.pop(DEFAULT_STEPS_KEY, None)
            rows = output if isinstance(output, list) else [output]
            keys = [row_key(kwargs["uid"], kwargs["session_id"], i) for i in range(len(rows))]
            if ledger is not None:  # recorded before the put: a failure cutting it clears them (run_session)
                ledger.stored_keys.extend(keys)
            await super()._agent_loop_postprocess(output, validate, **kwargs)
            if not validate and traj_config.enable and rows:  # the rows' facts for the plan (and the ledger's)
                tags = written_row_tags(rows, self.traj_config.prefix_tree is not False)
                tags[-1].update(ledger_tags)
                await tq.async_kv_batch_put(keys=keys, partition_id="train", tags=tags)
            return
        await self._compute_score([output], kwargs=kwargs)
        stock = not traj_config.enable  # stock verl on step rows: one row per call, as verl's list outputs give it
        outputs, tags, stats = step_outputs(output, traj_config.merge_prefix and not stock, turn_rewards=not stock,
                                            anchors=anchors, branch_paths=traj_config.branch_weighting == "paths")
        outputs[-1].extra_fields["reward_extra_info"] = output.extra_fields.get("reward_extra_info", {})
        keys = [row_key(kwargs["uid"], kwargs["session_id"], i) for i in range(len(outputs))]
        if ledger is not None:  # recorded before the put: a failure cutting it clears them (run_session)
            ledger.stored_keys.extend(keys)
        await super()._agent_loop_postprocess(outputs, validate, **kwargs)
        hashes = traj_config.prefix_tree is not False
        tags = [{**t, **facts} for t, facts in zip(tags, written_row_tags(outputs, hashes))]
        tags[0] = {**tags[0], MERGE_TAG: stats}
        tags[-1] = {**tags[-1], **ledger_tags}
        await tq.async_kv_batch_put(keys=keys, partition_id="train", tags=tags)


class TrajAgentLoopManagerTQ(AgentLoopManagerTQ):
    """verl's v1 agent-loop manager with :class:`TrajAgentLoopWorkerTQ` workers."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.agent_loop_workers_class = ray.remote(TrajAgentLoopWorkerTQ)
