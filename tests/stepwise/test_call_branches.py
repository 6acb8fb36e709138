"""Recording a session whose calls branch (issue 56, item 1): every call's parent is the last call on its branch,
whatever order concurrent branches finish in; chains record as before; a branching session is refused by the
expansion (not yet trained), never trained as a chain."""

from __future__ import annotations

import asyncio

import numpy as np
import torch
import pytest

from verl_traj.integration.agent_loops import stepwise_agent_loop as sal
from verl_traj.integration.agent_loops.call_branches import (begin_session, condense, end_session, fresh_context, leaves,
                                                              truncate_calls, with_leaf_outcomes)
from verl_traj.stepwise.expand import StepExpansionError, decode_step_records, encode_step_records


class _Out:
    def __init__(self, ids):
        self.token_ids, self.log_probs = ids, None


class _Server:
    """Answers ``[100 + len(prompt)]``; a prompt ending in a token listed in ``delay`` waits that long first (so
    concurrent branches finish in a chosen order)."""

    def __init__(self, delay=None):
        self.delay = delay or {}

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kw):
        await asyncio.sleep(self.delay.get(prompt_ids[-1], 0.0))
        return _Out([100 + len(prompt_ids)])


def _session(body, delay=None) -> list[dict]:
    """Run ``body(call)`` as one recorded session; ``call(prompt)`` is one LLM call, returning its full context."""
    sink: list[dict] = []
    rec = sal.RecordingServerManager(_Server(delay), sink)

    async def call(prompt):
        out = await rec.generate("r", prompt_ids=list(prompt), sampling_params={})
        return list(prompt) + list(out.token_ids)

    async def run():
        token = begin_session()
        try:
            await body(call)
        finally:
            end_session(token)

    asyncio.run(run())
    return sink


def _parents(sink):
    return [c["parent"] for c in sink]


def test_a_chain_records_as_before():
    async def body(call):
        ctx = await call([1, 2])
        ctx = await call(ctx + [3])
        await call(ctx + [4])

    sink = _session(body)
    assert _parents(sink) == [-1, 0, 1]
    assert not any("parent" in r for r in encode_step_records(sink)["steps"])  # a chain names no parent


@pytest.mark.parametrize("slow", [7, 8])
def test_forked_branches_continue_from_the_fork_whatever_order_they_finish(slow):
    """Best-of-2 from a mid-state: both branches' first calls are children of the fork point, each branch's next
    call a child of its own previous one, in either completion order; the session continues from the fork point."""
    async def body(call):
        root = await call([1, 2])

        async def branch(obs):
            ctx = await call(root + [obs])
            return await call(ctx + [obs + 10])

        await asyncio.gather(branch(7), branch(8))
        await call(root + [9])

    sink = _session(body, delay={slow: 0.05})
    by_prompt = {tuple(c["prompt_ids"]): k for k, c in enumerate(sink)}
    assert sink[0]["parent"] == -1 and len(sink) == 6
    for obs in (7, 8):
        first = next(k for k, c in enumerate(sink) if c["prompt_ids"][-1] == obs)
        second = next(k for k, c in enumerate(sink) if c["prompt_ids"][-1] == obs + 10)
        assert sink[first]["parent"] == 0 and sink[second]["parent"] == first < second
    assert sink[by_prompt[(1, 2, 102, 9)]]["parent"] == 0  # after the fork: the session's own branch
    decoded = decode_step_records(encode_step_records(sink))  # delta-encoded against the parent, decoded back
    assert [d["prompt_ids"].tolist() for d in decoded] == [c["prompt_ids"] for c in sink]


def test_a_sub_agent_starts_a_fresh_context_and_the_outer_branch_resumes():
    async def body(call):
        ctx = await call([1, 2])
        with fresh_context():
            sub = await call([50, 51])
            await call(sub + [52])
        await call(ctx + [3])
        condense()
        await call([60])

    assert _parents(_session(body)) == [-1, -1, 1, 0, -1]


def test_truncation_drops_a_call_with_everything_below_it_and_renumbers_parents():
    calls = [{"prompt_ids": [1] * 3, "response_ids": [2] * 2, "parent": -1},
             {"prompt_ids": [1] * 12, "response_ids": [3], "parent": 0},  # over the budget: dropped
             {"prompt_ids": [1] * 6, "response_ids": [4] * 9, "parent": 0},  # cut to the budget
             {"prompt_ids": [1] * 13, "response_ids": [5], "parent": 1},  # below the dropped call
             {"prompt_ids": [1] * 7, "response_ids": [6], "parent": 2}]
    out = truncate_calls(calls, 10)
    assert [c["parent"] for c in out] == [-1, 0, 1] and [len(c["response_ids"]) for c in out] == [2, 4, 1]
    assert len(calls[2]["response_ids"]) == 9  # the input is not changed


def test_a_recorded_fork_expands_into_its_tree_rows():
    """Best-of-2 from a root call, recorded by the loop's branches: the first branch continues the root's row, the
    second is a row of its own with the root's context as its masked prompt; each call's leaf span rides its first
    response token."""
    from verl.protocol import DataProto

    from verl_traj.core.keys import TREE_CALLS
    from verl_traj.integration.rows.stepwise_rows import expand_dataproto_step_rows
    from verl_traj.stepwise.call_tree import unpack_leaf_span
    from verl_traj.testing import step_record_batch, token_trajectory

    async def body(call):
        root = await call([1, 2])
        await asyncio.gather(*(call(root + [obs]) for obs in (7, 8)))

    calls = _session(body)
    steps = encode_step_records(calls)
    assert [s.get("parent") for s in steps["steps"]] == [None, None, 0]
    tensors, non = step_record_batch([token_trajectory(np.random.default_rng(0), 2)], ["g0"], [1.0])
    del tensors["rollout_log_probs"]
    non["traj_steps"] = np.array([steps], dtype=object)  # the row's calls branch
    data = DataProto.from_dict(tensors=tensors, non_tensors=non)
    expand_dataproto_step_rows(data, merge_prefix=True)
    full = [c["prompt_ids"] + c["response_ids"] for c in calls]
    rows = [[int(t) for t, a in zip(ids, m) if a] for ids, m in zip(data.batch["input_ids"], data.batch["attention_mask"])]
    assert rows == [full[0] + [8] + calls[2]["response_ids"], full[1]] or rows == [full[0] + [7] + calls[1]["response_ids"],
                                                                                  full[2]]
    spans = [unpack_leaf_span(data.batch[TREE_CALLS][b][data.batch[TREE_CALLS][b] != 0]) for b in range(2)]
    assert [(lo.tolist(), hi.tolist()) for lo, hi, _ in spans][0][1][0] == 2  # the root is above both leaves


def test_each_leaf_can_carry_its_own_outcome_and_the_records_keep_it():
    """Best-of-2 after a root, then a second call on one branch: the leaves are the other branch's call and the
    second call; their outcomes are recorded on them; a missing leaf outcome, one on an inner call, or a wrong count
    is refused naming leaf_rewards."""
    calls = [{"prompt_ids": [1], "response_ids": [2], "parent": -1},
             {"prompt_ids": [1, 2, 7], "response_ids": [3], "parent": 0},
             {"prompt_ids": [1, 2, 8], "response_ids": [4], "parent": 0},
             {"prompt_ids": [1, 2, 8, 4, 9], "response_ids": [5], "parent": 2}]
    assert leaves(calls) == [False, True, False, True]
    out = with_leaf_outcomes(calls, [None, 1.0, None, 0.0])
    steps = encode_step_records(out)["steps"]
    assert [s.get("outcome") for s in steps] == [None, 1.0, None, 0.0] and with_leaf_outcomes(calls, None) is calls
    for bad in ([None, None, None, 0.0], [0.5, 1.0, None, 0.0], [1.0, 0.0]):
        with pytest.raises(StepExpansionError) as raised:
            with_leaf_outcomes(calls, bad)
        assert raised.value.field == "leaf_rewards"


def test_a_chains_own_leaf_outcome_replaces_the_sessions_reward():
    """A chain whose leaf carries its own outcome (leaf_rewards) trains on it, not on the session's reward (never
    dropped in silence): its calls get GRPO's advantage of 0.5 among the group's 0.25 and 0.0 (with the session's 1.0
    they would get another)."""
    from omegaconf import OmegaConf
    from verl.protocol import DataProto
    from verl.trainer.ppo import ray_trainer

    from verl_traj.config import TrajConfig
    from verl_traj.integration.patches.scoped import fit_patches, patched
    from verl_traj.stepwise.step_groups import StepGroupOptions
    from verl_traj.testing import step_record_batch, token_trajectory

    from .verl_batches import stepwise_trainer

    rng = np.random.default_rng(1)
    trajs = [token_trajectory(rng, 2) for _ in range(6)]
    rewards = [1.0, 0.25, 0.0] * 2  # the sessions' rewards
    tensors, non = step_record_batch(trajs, ["g0"] * 3 + ["g1"] * 3, rewards)
    own = encode_step_records(with_leaf_outcomes([dict(c) for c in trajs[0][0]], [None, 0.5]))
    assert own["steps"][-1]["outcome"] == 0.5
    non["traj_steps"] = np.array([own] + [encode_step_records(t[0]) for t in trajs[1:]], dtype=object)
    data = DataProto.from_dict(tensors=tensors, non_tensors=non)
    traj = TrajConfig(step_wise=True)
    stepwise_trainer(traj, 1)._balance_batch(data, {})
    data.batch["token_level_rewards"] = data.batch["rm_scores"].clone()
    with patched(fit_patches(True, step_groups=StepGroupOptions.of(traj))):
        ray_trainer.compute_advantage(data, "grpo", config=OmegaConf.create({}))
    adv, mask, traj_id = data.batch["advantages"], data.batch["response_mask"].bool(), data.non_tensor_batch["traj_id"]
    scores = np.array([0.5, 0.25, 0.0])
    normalised = (scores - scores.mean()) / (scores.std(ddof=1) + 1e-6)
    want = {"T0": normalised[0], "T1": normalised[1], "T2": normalised[2]}
    for b, t in enumerate(traj_id):
        if t in want:
            assert torch.allclose(adv[b][mask[b]], torch.tensor(want[t], dtype=adv.dtype), atol=1e-5)
