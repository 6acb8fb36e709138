"""What verl_traj adds to one agent-loop session, piece by piece: ``scripts/bench_agent_loop.py --pieces``.

One session of the calculator agent runs through verl_traj's v1 worker (quick-start settings); its output, as the
worker's postprocess receives it, is kept, and each piece verl_traj runs on it per session is timed again on it, in the
loop thread's CPU time (``time.thread_time``; best of ``repeats`` rounds of ``number`` calls, so other work on a shared
machine weighs least): recording (``encode_step_records`` of the calls), the step rows (``step_outputs``, of which
``trajectory_step_rows``) and the tags-only TransferQueue put after verl's row put.
"""

from __future__ import annotations

import copy
import time
from typing import Any, Awaitable, Callable

from verl_traj.core.rollout.row_tags import MERGE_TAG
from verl_traj.integration.agent_loops.stepwise_agent_loop import truncate_calls
from verl_traj.integration.agent_loops.v1_agent_loop import step_outputs
from verl_traj.stepwise.expand import DEFAULT_STEPS_KEY, decode_step_records, encode_step_records, trajectory_step_rows

__all__ = ["piece_costs"]


def _best(fn: Callable[[], Any], number: int, repeats: int) -> float:
    """Milliseconds of the thread's CPU per call of ``fn``, best of ``repeats`` rounds of ``number`` calls."""
    best = float("inf")
    for _ in range(repeats):
        start = time.thread_time()
        for _ in range(number):
            fn()
        best = min(best, (time.thread_time() - start) / number)
    return best * 1e3


async def _best_async(fn: Callable[[], Awaitable[Any]], number: int, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.thread_time()
        for _ in range(number):
            await fn()
        best = min(best, (time.thread_time() - start) / number)
    return best * 1e3


async def piece_costs(worker: Any, run_one: Callable[[], Awaitable[Any]], tq: Any, number: int = 200,
                      repeats: int = 5) -> list[dict]:
    """``[{"piece", "ms"}]`` for one session of ``worker`` (verl_traj's, step-wise): ``run_one()`` runs one prompt
    through it; the output its postprocess receives is kept (a copy) and the pieces are timed on it."""
    kept: dict[str, Any] = {}
    postprocess = worker._agent_loop_postprocess

    async def keep(output: Any, validate: bool, **kwargs: Any) -> Any:
        kept.setdefault("output", copy.deepcopy(output))
        return await postprocess(output, validate, **kwargs)

    worker._agent_loop_postprocess = keep
    try:
        await run_one()
    finally:
        del worker._agent_loop_postprocess
    out = kept["output"]
    records = out.extra_fields[DEFAULT_STEPS_KEY]
    calls = [{k: rec[k] for k in ("prompt_ids", "response_ids", "response_logprobs")} for rec in
             decode_step_records(records)]
    merge, anchors = worker.traj_config.merge_prefix, worker.records_anchors
    tag = {MERGE_TAG: {"rows_before": len(calls)}}

    async def tags_put() -> None:
        await tq.async_kv_batch_put(keys=["bench_pieces_0_0"], partition_id="train", tags=[tag])

    pieces = [
        ("encode_step_records (StepRecordingMixin.run)",
         _best(lambda: encode_step_records(truncate_calls(calls, 1 << 30)), number, repeats)),
        ("step_outputs (TrajAgentLoopWorkerTQ._agent_loop_postprocess)",
         _best(lambda: step_outputs(out, merge, anchors=anchors), number, repeats)),
        ("  of which trajectory_step_rows", _best(lambda: trajectory_step_rows(
            out.prompt_ids, out.response_ids, out.response_mask, out.response_logprobs, records, merge_prefix=merge),
            number, repeats)),
        ("tags-only TransferQueue put (after verl's row put)", await _best_async(tags_put, number, repeats)),
    ]
    await tq.async_kv_clear(keys=["bench_pieces_0_0"], partition_id="train")
    return [{"piece": name, "ms": round(ms, 4), "calls": len(calls)} for name, ms in pieces]
