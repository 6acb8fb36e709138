"""A failed session releases exactly the rows it stored, through TransferQueue's async API, without listing the
partition or blocking the agent-loop worker's event loop (issue: "The event loop never waits on bookkeeping").

verl's v1 worker stores a session's rows inside the session (``_run_agent_loop`` awaits the loop, then
``_agent_loop_postprocess``); verl_traj's worker records each key in the session's ledger before the put
(``SessionLedger.stored_keys``), and :func:`~verl_traj.integration.async_modes.v1_failures.run_session` clears those
when the session fails, also when a timeout cuts the put half-way. The store here is a spy: any synchronous call
(``kv_list``, ``kv_clear``) fails the test.
"""

from __future__ import annotations

import asyncio
from typing import Optional

import numpy as np
import pytest
from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput
from verl.trainer.ppo.v1 import agent_loop_tq

from verl_traj.config import TrajConfig
from verl_traj.core.rollout.failures import FAILURE_TAG_PREFIX
from verl_traj.core.rollout.session_ledger import current_ledger, session_ledger
from verl_traj.integration.agent_loops import v1_agent_loop
from verl_traj.integration.agent_loops.v1_agent_loop import TrajAgentLoopWorkerTQ
from verl_traj.integration.async_modes import v1_failures
from verl_traj.integration.async_modes.v1_failures import run_session
from verl_traj.stepwise.expand import encode_step_records
from verl_traj.testing import token_trajectory


class SpyKV:
    """TransferQueue's async KV calls over a dict; a put can be held half-way (its keys created, as TransferQueue
    creates them before storing) until a timeout cuts it. Synchronous calls fail."""

    def __init__(self) -> None:
        self.tags: dict[str, dict] = {}
        self.stored: dict[str, tuple[list, list]] = {}  # key -> (input_ids, response_mask) as verl stored them
        self.cleared: list[list[str]] = []
        self.hold: Optional[str] = None  # a key whose put, once its keys exist, never returns

    async def async_kv_put(self, key: str, partition_id: str, tag: dict, **_) -> None:
        self.tags.setdefault(key, {}).update(tag)

    async def async_kv_batch_put(self, keys: list, partition_id: str, fields=None, tags=None, **_) -> None:
        for key, tag in zip(keys, tags or [{}] * len(keys)):
            self.tags.setdefault(key, {}).update(tag)
        if fields is not None:
            self.stored.update({k: (fields["input_ids"][i].tolist(), fields["response_mask"][i].tolist())
                                for i, k in enumerate(keys)})
        if self.hold in keys:
            await asyncio.Event().wait()

    async def async_kv_clear(self, keys, partition_id: str) -> None:
        self.cleared.append(list(keys))
        for key in keys:
            self.tags.pop(key, None)

    def kv_list(self, *args, **kwargs):
        raise AssertionError("a failed session listed the partition (a synchronous kv_list on the event loop)")

    def kv_clear(self, *args, **kwargs):
        raise AssertionError("a failed session cleared its rows synchronously, on the event loop")


@pytest.fixture
def spy(monkeypatch) -> SpyKV:
    kv = SpyKV()
    for module in (agent_loop_tq, v1_agent_loop, v1_failures):
        monkeypatch.setattr(module, "tq", kv)
    return kv


def _worker(step_wise: bool) -> TrajAgentLoopWorkerTQ:
    """verl_traj's v1 agent-loop worker without its Ray actor, scoring and teacher (no-ops), storing rows as verl
    does."""
    worker = object.__new__(TrajAgentLoopWorkerTQ)
    worker.traj_config, worker.records_anchors, worker.processor = TrajConfig(step_wise=step_wise), False, None

    async def nothing(*args, **kwargs) -> None:
        return None

    worker._compute_score = worker._compute_teacher_logprobs = nothing
    return worker


def _output(calls: int) -> AgentLoopOutput:
    """One call's output (``calls=1``: verl's row), or a step-wise trajectory of ``calls`` recorded calls (as many
    step rows, the context rewritten before the second so that prefix merging keeps them apart)."""
    versions = {"min_global_steps": 1, "max_global_steps": 1}
    if calls == 1:
        return AgentLoopOutput(prompt_ids=[1, 2], response_ids=[3, 4], response_mask=[1, 1], num_turns=2,
                               metrics=AgentLoopMetrics(), extra_fields=versions)
    records, prompt, response, mask, lps = token_trajectory(np.random.default_rng(calls), calls, break_at=1)
    return AgentLoopOutput(prompt_ids=prompt.tolist(), response_ids=response.tolist(), response_mask=mask.tolist(),
                           response_logprobs=lps.tolist(), num_turns=2 * calls, metrics=AgentLoopMetrics(),
                           extra_fields={"traj_steps": encode_step_records(records), **versions})


async def _session(worker, uid: str, session_id: int, outputs: int, fail: Optional[Exception] = None):
    """One session: its agent loop's call, then its ``outputs`` rows stored as the worker stores them (a list of
    outputs without step-wise rows, a recorded trajectory with); ``fail``: raised after they are stored."""
    ledger = current_ledger()
    ledger.attempts.append((1, 2))
    ledger.calls += 1
    await asyncio.sleep(0)
    step_wise = worker.traj_config.step_wise
    output = _output(outputs) if step_wise else [_output(1) for _ in range(outputs)]
    await worker._agent_loop_postprocess(output, False, uid=uid, session_id=session_id, global_steps=1)
    if fail is not None:
        raise fail


async def _run(worker, uid: str, session_id: int, outputs: int, timeout_s=None, fail=None):
    with session_ledger("tool_agent"):
        return await run_session(_session(worker, uid, session_id, outputs, fail), timeout_s, uid, session_id)


def test_a_failed_session_clears_its_own_rows_asynchronously_and_a_concurrent_ones_stay(spy):
    worker = _worker(step_wise=False)

    async def main():
        return await asyncio.gather(_run(worker, "g", 0, 3), _run(worker, "g", 1, 2, fail=RuntimeError("tool died")),
                                    _run(worker, "h", 1, 1), return_exceptions=True)

    results = asyncio.run(main())
    assert results[0] is None and isinstance(results[1], RuntimeError) and results[2] is None
    assert spy.cleared == [["g_1_0", "g_1_1"]]  # exactly what it stored
    assert sorted(k for k in spy.tags if "_" in k) == ["g_0_0", "g_0_1", "g_0_2", "h_1_0"]
    assert spy.tags["g"][f"{FAILURE_TAG_PREFIX}1"] == "RuntimeError"


@pytest.mark.parametrize("step_wise", [False, True])
def test_a_timeout_that_cuts_the_put_half_way_leaves_nothing_of_the_session(spy, step_wise):
    """The put was cut after TransferQueue created its keys: those keys were recorded before it, and are cleared."""
    worker = _worker(step_wise)
    spy.hold = "g_2_0"

    async def main():
        return await asyncio.gather(_run(worker, "g", 2, 2, timeout_s=0.2), _run(worker, "g", 3, 1),
                                    return_exceptions=True)

    results = asyncio.run(main())
    assert isinstance(results[0], (asyncio.TimeoutError, TimeoutError)) and results[1] is None
    assert spy.cleared == [["g_2_0", "g_2_1"]] and not any(k.startswith("g_2_") for k in spy.tags)
    assert "g_3_0" in spy.tags and spy.tags["g"][f"{FAILURE_TAG_PREFIX}2"] == "timeout"


def test_a_session_that_fails_before_storing_clears_nothing(spy):
    async def main():
        with session_ledger():
            await run_session(asyncio.sleep(10), 0.05, "g", 0)

    with pytest.raises((asyncio.TimeoutError, TimeoutError)):
        asyncio.run(main())
    assert spy.cleared == [] and list(spy.tags) == ["g"]


@pytest.mark.parametrize("step_wise", [True, False])
def test_every_stored_training_row_carries_its_facts_for_the_plan(spy, step_wise):
    """Issue 55, item 4: each row verl stores (step rows, or verl's own rows of a list output) is tagged with its loss
    tokens and prefix block hashes, computed from what was stored, so the trainer plans without fetching them."""
    from verl_traj.core.rollout.row_tags import LOSS_TOKENS_TAG, PREFIX_HASH_TAG, row_fact_tags

    asyncio.run(_run(_worker(step_wise), "g", 0, 3))
    keys = sorted(k for k in spy.stored if k.startswith("g_"))
    assert len(keys) == (2 if step_wise else 3)  # step-wise: the 3 calls merge into 2 rows (context rewritten once)
    want = row_fact_tags(*zip(*(spy.stored[k] for k in keys)))
    for key, facts in zip(keys, want):
        assert spy.tags[key][LOSS_TOKENS_TAG] == facts[LOSS_TOKENS_TAG] == sum(spy.stored[key][1])
        assert spy.tags[key][PREFIX_HASH_TAG] == facts[PREFIX_HASH_TAG]


def test_a_run_without_prefix_trees_stores_no_prefix_hashes(spy):
    """``traj.prefix_tree=false``: the rows carry their loss tokens only (no hashing, nothing in the controller)."""
    from verl_traj.core.rollout.row_tags import LOSS_TOKENS_TAG, PREFIX_HASH_TAG

    worker = _worker(True)
    worker.traj_config = TrajConfig(step_wise=True, prefix_tree=False)
    asyncio.run(_run(worker, "g", 0, 3))
    rows = [k for k in spy.stored if k.startswith("g_")]
    assert rows and all(LOSS_TOKENS_TAG in spy.tags[k] and PREFIX_HASH_TAG not in spy.tags[k] for k in rows)
