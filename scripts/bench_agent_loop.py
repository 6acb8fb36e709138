#!/usr/bin/env python
"""Benchmark: the v1 agent loop at scale, verl_traj's worker vs verl's, on the calculator agent's step-wise tool loop.

N sessions (``data.train_batch_size x rollout.n`` of the quick start, ``configs/quickstart.yaml``) go through the REAL
v1 agent-loop worker code, instantiated in this process (not as a Ray actor): ``generate_sequences`` spawns every
prompt's ``rollout.n`` sessions, each runs the tool agent loop (chat template, tool parser, the calculator tool) and
its postprocess stores the rows in a real TransferQueue (Ray + TQ controller + storage in this process's Ray). The LLM
server is a stub that answers at once with a fixed, well-formed calculator call (``--turns - 1`` times) and then a
final answer, so every session has ``--turns`` LLM calls; the reward handle is a stub too. Variants, same sessions:

* ``verl``: verl's ``AgentLoopWorkerTQ`` and verl's ``ToolAgentLoop`` (no verl_traj code): one row per session;
* ``traj_off``: verl_traj's worker and step-recording loop with ``traj.enable=false`` (the side-by-side switch): one
  row per LLM call, as verl stores a loop's list of outputs;
* ``verl_traj``: the quick start's settings (``traj.step_wise``, ``merge_prefix``, GiGPO anchors): the prefix-merged
  step rows with their tags.

One step = ``generate_sequences`` until every session's rows (and the prompt's final status) are in TransferQueue.
Each N is run ``--repeats`` times, the variants alternating (their order rotates per repeat), after one untimed
warm-up session batch per variant; the table gives medians. The loop's longest stall (longest callback) and the code it
was in come from :mod:`loop_stalls` (``scripts/loop_stalls.py``); the worker, stubs and prompts from
``scripts/agent_loop_parts.py``.

    python scripts/bench_agent_loop.py                       # 64, 256, 1024 sessions x 3 repeats (about 4 minutes)
    python scripts/bench_agent_loop.py --sessions 8 --repeats 1 --json
    python scripts/bench_agent_loop.py --small               # the same: seconds
    python scripts/bench_agent_loop.py --gc-freeze           # gc.freeze() after start-up, in every variant
    python scripts/bench_agent_loop.py --small --pieces      # + verl_traj's per-session pieces, timed one by one
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import logging
import os
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("TQ_LOGGING_LEVEL", "ERROR")  # before transfer_queue's import: it warns per put under 16 cores

from verl_traj.main_ppo import OPTIONAL_ENGINES  # noqa: E402,F401  (first: it filters verl's optional-engine warnings)

import numpy as np  # noqa: E402
import ray  # noqa: E402
import transfer_queue as tq  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from verl.experimental.agent_loop.agent_loop import _agent_loop_registry  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402

from verl_traj.cpu.build_tiny import build  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its helper modules, beside this file

from agent_loop_pieces import piece_costs  # noqa: E402
from agent_loop_parts import AGENT_NAME, VARIANTS, make_worker, prompt_rows, variant_config  # noqa: E402
from loop_stalls import LoopMonitor, StallReport  # noqa: E402


def fresh_batch(rows: dict) -> Any:
    """A step's batch as the v1 trainer hands it to the agent-loop manager: a new uid per prompt, ``global_steps``."""
    rows = dict(rows, uid=np.array([str(uuid.uuid4()) for _ in range(len(rows["raw_prompt"]))], dtype=object))
    batch = tu.get_tensordict(rows)
    tu.assign_non_tensor_data(batch, "global_steps", 1)
    return batch


@dataclass
class Run:
    """One timed step of one variant: seconds, rows stored, LLM calls verl_traj's merge tags account for (0: no
    tags), and the loop's stalls (:class:`loop_stalls.StallReport`, milliseconds)."""

    variant: str
    sessions: int
    seconds: float
    rows: int
    recorded_calls: int
    stalls: StallReport


async def stored_rows(uids: list[str], sessions: int) -> tuple[int, int]:
    """Rows stored for the prompts ``uids`` (keys ``{uid}_{session}_{index}``) and the LLM calls verl_traj's merge tags
    say they hold (0 without tags); every prompt must be ``finished`` and each of the ``sessions`` must have stored
    rows. Clears them (the next step starts empty)."""
    listed = (await tq.async_kv_list(partition_id="train") or {}).get("train", {})
    bad = [u for u in uids if listed.get(u, {}).get("status") != "finished"]
    if bad:
        raise RuntimeError(f"{len(bad)} of {len(uids)} prompts did not finish: {[listed.get(u) for u in bad[:3]]}")
    prefixes = tuple(f"{u}_" for u in uids)
    rows = {k: t for k, t in listed.items() if k.startswith(prefixes)}
    stored = len({key.rsplit("_", 1)[0] for key in rows})
    if stored != sessions:
        raise RuntimeError(f"{stored} of {sessions} sessions stored rows")
    calls = sum(t["traj_merge"]["rows_before"] for t in rows.values() if "traj_merge" in t)
    await tq.async_kv_clear(keys=list(rows) + list(uids), partition_id="train")
    return len(rows), calls


async def one_step(variant: str, worker: Any, entry: dict, rows: dict) -> Run:
    """One step of ``variant``: generate_sequences until every session's rows are stored, under the loop monitor."""
    _agent_loop_registry[AGENT_NAME] = entry
    batch = fresh_batch(rows)
    uids = list(batch["uid"])
    gc.collect()
    async with LoopMonitor() as monitor:
        start = time.perf_counter()
        await worker.generate_sequences(batch)
        await asyncio.gather(*list(worker.background_tasks))
        seconds = time.perf_counter() - start
    sessions = len(uids) * int(worker.config.actor_rollout_ref.rollout.n)
    n_rows, calls = await stored_rows(uids, sessions)
    return Run(variant, sessions, seconds, n_rows, calls, monitor.report())


async def bench(sessions: list[int], repeats: int, turns: int, home: Path, data_dir: Path, gc_freeze: bool = False,
                pieces: int = 0) -> tuple[list[Run], list[dict]]:
    """Every (N, variant) ``repeats`` times, alternating variants; one untimed warm-up step per variant first (then,
    with ``gc_freeze``, every object alive is moved out of the collector's reach, as a worker could after start-up).
    With ``pieces`` (calls per round), verl_traj's per-session pieces are timed too (:func:`piece_costs`)."""
    workers = {}
    for variant in VARIANTS:
        config = variant_config(variant, str(home / "model"), turns)
        workers[variant] = make_worker(variant, config, turns)
    n = int(config.actor_rollout_ref.rollout.n)
    bad = [s for s in sessions if s % n]
    if bad:
        raise SystemExit(f"--sessions {bad}: each must be a multiple of rollout.n={n} (sessions = prompts x n)")
    tokenizer = workers["verl_traj"][0].tokenizer
    prompts = prompt_rows(config, tokenizer, sorted({s // n for s in sessions} | {1}), data_dir)
    data = {s: prompts[s // n] for s in sessions}
    for variant, (worker, entry) in workers.items():
        await one_step(variant, worker, entry, prompts[1])
    costs = await piece_costs(workers["verl_traj"][0], lambda: one_step("verl_traj", *workers["verl_traj"], prompts[1]),
                              tq, number=pieces) if pieces else []
    if gc_freeze:
        gc.collect()
        gc.freeze()
    runs = []
    for repeat in range(repeats):
        order = VARIANTS[repeat % 3:] + VARIANTS[:repeat % 3]
        for count in sessions:
            for variant in order:
                runs.append(await one_step(variant, *workers[variant], data[count]))
    return runs, costs


def _row(count: int, variant: str, mine: list[Run]) -> dict:
    """The table row of one (N, variant) from its repeats: medians of the step, maxima of the stalls."""
    worst = max(mine, key=lambda r: r.stalls.max_stall_ms)
    seconds = statistics.median(r.seconds for r in mine)
    by_owner: dict[str, tuple[float, str]] = {}
    for r in mine:
        for owner, ms in r.stalls.cpu_ms_by_owner.items():
            if ms > by_owner.get(owner, (0.0, ""))[0]:
                by_owner[owner] = (round(ms, 2), r.stalls.where_by_owner[owner])
    return dict(sessions=count, variant=variant, repeats=len(mine), step_s=round(seconds, 3),
                per_session_ms=round(seconds / count * 1e3, 3), step_s_all=[round(r.seconds, 3) for r in mine],
                loop_cpu_ms_per_session=round(statistics.median(r.stalls.loop_cpu_ms for r in mine) / count, 3),
                rows_per_session=round(statistics.median(r.rows for r in mine) / count, 3),
                recorded_calls_per_session=round(statistics.median(r.recorded_calls for r in mine) / count, 3),
                gc_ms_per_step=round(statistics.median(r.stalls.gc_total_ms for r in mine), 1),
                max_stall_ms=round(worst.stalls.max_stall_ms, 2), stall_cpu_ms=round(worst.stalls.stall_cpu_ms, 2),
                stall_owner=worst.stalls.stall_owner, stall_where=worst.stalls.where,
                cpu_ms_by_owner={o: ms for o, (ms, _) in by_owner.items()},
                where_by_owner={o: w for o, (_, w) in by_owner.items()},
                max_gc_pause_ms=round(max(r.stalls.max_gc_ms for r in mine), 2),
                max_callback_ms=round(max(r.stalls.max_callback_ms for r in mine), 2),
                max_heartbeat_late_ms=round(max(r.stalls.max_heartbeat_late_ms for r in mine), 2))


def summarize(runs: list[Run]) -> list[dict]:
    """Per (N, variant), :func:`_row`; verl_traj's row adds ``vs_verl`` / ``vs_traj_off``: its median step time's
    change against theirs at the same N (+0.02 = 2% slower), and ``cpu_vs_*`` the same for the loop's CPU time."""
    table = []
    for count in sorted({r.sessions for r in runs}):
        rows = {v: _row(count, v, [r for r in runs if r.sessions == count and r.variant == v]) for v in VARIANTS}
        for other in ("verl", "traj_off"):
            rows["verl_traj"][f"vs_{other}"] = round(rows["verl_traj"]["step_s"] / rows[other]["step_s"] - 1, 4)
            rows["verl_traj"][f"cpu_vs_{other}"] = round(
                rows["verl_traj"]["loop_cpu_ms_per_session"] / rows[other]["loop_cpu_ms_per_session"] - 1, 4)
        table.extend(rows.values())
    return table


def _short(where: str) -> str:
    """``owner pkg.mod:function:line < pkg.inner:function:line`` -> ``owner mod.function < inner.function``."""
    def frame(name: str) -> str:
        module, function = (name.split(":") + ["", ""])[:2]
        return f"{module.rsplit('.', 1)[-1]}.{function}"
    owner, _, rest = where.partition(" ")
    return f"{owner} " + " < ".join(frame(f) for f in rest.split(" < ")) if rest else where


def print_table(table: list[dict], turns: int) -> None:
    print(f"agent loop, {turns} LLM calls per session; medians over the repeats (step wall time; the event loop's CPU "
          "time); stall = the longest loop callback net of GC pauses (wall, and the loop thread's CPU in it), max over "
          "the repeats; verl_traj CPU = the most CPU one callback spent in verl_traj's code")
    print("| sessions | variant | s / step | ms / session | vs verl | vs traj_off | loop CPU ms / session (vs verl) "
          "| rows / session | GC ms / step | max stall ms (CPU) | stall in | verl_traj CPU ms | max GC pause ms |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|")
    for row in table:
        vs = [f"{row[k]:+.1%}" if k in row else "" for k in ("vs_verl", "vs_traj_off")]
        cpu = f"{row['loop_cpu_ms_per_session']:.2f}"
        cpu += f" ({row['cpu_vs_verl']:+.1%})" if "cpu_vs_verl" in row else ""
        where = _short(row["stall_where"][0]) if row["stall_where"] else row["stall_owner"]
        print(f"| {row['sessions']} | {row['variant']} | {row['step_s']:.3f} | {row['per_session_ms']:.2f} | {vs[0]} | "
              f"{vs[1]} | {cpu} | {row['rows_per_session']:g} | {row['gc_ms_per_step']:.0f} | "
              f"{row['max_stall_ms']:.1f} ({row['stall_cpu_ms']:.1f}) | {where} | "
              f"{row['cpu_ms_by_owner'].get('verl_traj', 0.0):.1f} | {row['max_gc_pause_ms']:.0f} |")


def print_pieces(pieces: list[dict]) -> None:
    if pieces:
        print(f"\nverl_traj per session ({pieces[0]['calls']} LLM calls), the loop thread's CPU, best of 5 rounds")
        print("| piece | ms |\n|---|---:|")
        for piece in pieces:
            print(f"| {piece['piece']} | {piece['ms']:.3f} |")


def start_transfer_queue() -> None:
    """Ray and TransferQueue in this process, as the tests' ``tq`` fixture starts them (kept if already running)."""
    if not ray.is_initialized():
        ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    tq.init(OmegaConf.create({"backend": {"SimpleStorage": {"num_data_storage_units": 1,
                                                                        "total_storage_size": 100000}}}))


def main(argv: Any = None) -> dict:
    """Run, print the table (or ``--json``: the payload), return the payload (``table``: :func:`summarize`)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", default="64,256,1024", help="comma-separated session counts (prompts x n)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--turns", type=int, default=3, help="LLM calls per session (the last one answers)")
    parser.add_argument("--small", action="store_true", help="--sessions 8 --repeats 1: seconds")
    parser.add_argument("--gc-freeze", action="store_true", help="gc.freeze() after the warm-up (every variant)")
    parser.add_argument("--pieces", action="store_true", help="also time verl_traj's per-session pieces")
    parser.add_argument("--home", default=None, help="the tiny model's folder (default: built in a temporary one)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    sessions = [8] if args.small else [int(s) for s in args.sessions.split(",")]
    repeats = 1 if args.small else args.repeats
    if args.turns < 1 or repeats < 1 or min(sessions) < 1:
        parser.error("--turns, --repeats and --sessions must be >= 1")
    logging.getLogger("transfer_queue.utils.common").setLevel(logging.ERROR)  # where imported before this module
    with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stdout(sys.stderr):  # stdout: the table / JSON
        home = build(args.home or str(Path(tmp) / "tiny"))
        start_transfer_queue()
        runs, pieces = asyncio.run(bench(sessions, repeats, args.turns, home, Path(tmp), args.gc_freeze,
                                         (20 if args.small else 200) if args.pieces else 0))
    payload = {"turns": args.turns, "repeats": repeats, "gc_freeze": args.gc_freeze, "table": summarize(runs),
               "pieces": pieces, "runs": [asdict(r) for r in runs]}
    if args.json:
        print(json.dumps(payload))
    else:
        print_table(payload["table"], args.turns)
        print_pieces(pieces)
    return payload


if __name__ == "__main__":
    main()
