#!/usr/bin/env python
"""Benchmark: what the v1 replay buffer's poll and a failed session cost, verl_traj's code now against before
(commit bec84a5), over a real TransferQueue (Ray and TransferQueue in this process).

Each size is ``prompts x sessions x steps``: a partition of ``prompts`` groups of ``sessions`` sessions, each session
``steps`` stored rows (its last carrying the tags verl_traj's worker leaves), as verl's agent-loop workers store
them; one group in 16 has failed with one session (kept under ``traj.failed_groups=keep_survivors``), one in 64 with
all but one (dropped). Defaults: 1,024 x 16 x 1 (16K rows) and 977 x 16 x 8 (125K step rows).

* **poll**: verl's metadata read (``_sync_metadata_from_transfer_queue``: it lists every key's tag; the same code
  both ways) and the policy work of verl_traj's replay-buffer hooks on it (``keep_survivors`` and
  ``traj.max_staleness``: failed groups' survivors, every group's version ledgers, the evicted groups' lengths and
  failure tags). Before: a pass over every row per policy, and a second listing of the partition for the failure
  tags. Now: the index (``group_index.py``) reads the rows new since the last poll, the failed groups' tags are read
  by key, once, and each finished group's staleness and lag facts are learnt once (a poll checks a cached pair
  per group). Timed on the hooks alone (verl's own eviction stubbed out, so every poll evicts the same groups),
  after 8 groups finished and 8 were taken between polls; the first poll (the index reading the whole partition
  once) apart.
* **stall**: 1,024 sessions of 16 calls on one event loop (an agent-loop worker's), 8 of which fail after storing
  their 16 rows: ``run_session`` before (a synchronous listing of the partition and a synchronous clear, on the
  loop) and now (the session's own keys, cleared through the async API). The longest callback on the loop
  (``scripts/loop_stalls.py``'s monitor) and its owner.

    python scripts/bench_replay_poll.py [--sizes 1024x16x1,977x16x8] [--polls 5] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import ray
import transfer_queue as tq
from omegaconf import OmegaConf
from verl.trainer.ppo.v1.replay_buffer import ReplayBufferAsync

from verl_traj.config import TrajConfig
from verl_traj.core.rollout.failures import (FAILURE_TAG_PREFIX, failed_groups_to_evict, failure_metrics, failure_tag,
                                     fatal_failure)
from verl_traj.core.rollout.session_ledger import LENGTH_TAG, VERSION_TOKENS_TAG, current_ledger
from verl_traj.core.rollout.staleness import groups_over_bound
from verl_traj.integration.async_modes import v1_failures, v1_staleness
from verl_traj.integration.async_modes.cut_lengths import CutLengths, failed_lengths
from verl_traj.integration.async_modes.v1_failures import FailedGroupPolicy, poll_interval, run_session
from verl_traj.integration.async_modes.v1_staleness import StaleGroupPolicy

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loop_stalls import failing_sessions  # noqa: E402

STEP = 6  # the step sampled for: the rows' tokens are of version 5, none over traj.max_staleness=1

# verl_traj's code at bec84a5 (run_session without its tag lock), compiled under its package path so that the loop
# monitor attributes it as it did there
OLD_SOURCE = '''
async def run_session(session, timeout_s, uid, session_id, partition_id="train"):
    try:
        return await (asyncio.wait_for(session, timeout_s) if timeout_s else session)
    except Exception as error:
        ledger = current_ledger()
        tag = failure_tag(session_id, error, ledger.length() if ledger is not None else None)
        await tq.async_kv_put(key=uid, partition_id=partition_id, tag=tag)
        prefix = f"{uid}_{int(session_id)}_"
        stored = [key for key in (tq.kv_list(partition_id=partition_id) or {}).get(partition_id, {})
                  if key.startswith(prefix)]
        if stored:
            tq.kv_clear(partition_id=partition_id, keys=stored)
        raise


def finished_lengths(rows, groups_by_cause):
    cause_of = {uid: cause for cause, uids in groups_by_cause.items() for uid in uids}
    out = defaultdict(list)
    if cause_of:
        for key, tag in rows.items():
            cause = cause_of.get(key.split("_")[0])
            if cause is not None and LENGTH_TAG in tag:
                out[cause].append(list(tag[LENGTH_TAG]))
    return dict(out)


class OldFailedGroupPolicy:
    def _terminal_eviction_reasons(self, global_steps, partition_id):
        stale, dapo, failed, counts = super()._terminal_eviction_reasons(global_steps, partition_id)
        failing = self.failure_keys[partition_id]
        survivors = Counter()
        if failing and self.failed_group_policy != "drop":
            sessions = {key.rsplit("_", 1)[0] for key in self.partitions[partition_id] if key.split("_")[0] in failing}
            survivors.update(session.split("_")[0] for session in sessions)
        return stale, dapo, failed_groups_to_evict(failing, survivors, self.failed_group_policy,
                                                   self.min_survivors), counts

    def _evict_terminal_groups(self, global_steps, partition_id, eviction_reasons):
        stale, filtered, failed = eviction_reasons[:3]
        if stale or filtered or failed:
            tags = self._prompt_tags(partition_id) if failed or self.failed_group_policy != "drop" else {}
            if failed:
                fatal_failure(tags)
                self._log(failure_metrics(tags, failed, ()))
            finished = finished_lengths(self.partitions[partition_id],
                                        {"stale": stale, "filtered": filtered, "failed_group": failed})
            for cause, lengths in finished.items():
                self.cut_lengths.add(cause, lengths)
            for cause, lengths in failed_lengths(tags, set(stale) | set(filtered) | set(failed)).items():
                self.cut_lengths.add(cause, lengths)
        return super()._evict_terminal_groups(global_steps, partition_id, eviction_reasons)

    @staticmethod
    def _prompt_tags(partition_id):
        listed = (tq.kv_list(partition_id=partition_id) or {}).get(partition_id, {})
        return {key: tag for key, tag in listed.items()
                if tag.get("is_prompt") and any(k.startswith(FAILURE_TAG_PREFIX) for k in tag)}


class OldStaleGroupPolicy:
    def _terminal_eviction_reasons(self, global_steps, partition_id):
        stale, dapo, failed, counts = super()._terminal_eviction_reasons(global_steps, partition_id)
        over = groups_over_bound(self._group_ledgers(partition_id, failed), global_steps - 1, self.max_staleness)
        return stale | over, dapo, failed, counts

    def _group_ledgers(self, partition_id, failed_evicted):
        with_rows = {key.split("_")[0] for key in self.partitions[partition_id]}
        kept = (self.failure_keys[partition_id] - set(failed_evicted)) & with_rows
        ledgers = {uid: [] for uid in self.finished_keys[partition_id] | kept}
        for key, tag in self.partitions[partition_id].items():
            uid = key.split("_")[0]
            if uid in ledgers and VERSION_TOKENS_TAG in tag:
                ledgers[uid].append(tag[VERSION_TOKENS_TAG])
        return ledgers
'''
OLD: dict[str, Any] = {"asyncio": asyncio, "tq": tq, "Counter": Counter, "defaultdict": defaultdict,
                       **{f.__name__: f for f in (current_ledger, failure_tag, failed_groups_to_evict, fatal_failure,
                                                  failure_metrics, failed_lengths, groups_over_bound)},
                       "FAILURE_TAG_PREFIX": FAILURE_TAG_PREFIX, "LENGTH_TAG": LENGTH_TAG,
                       "VERSION_TOKENS_TAG": VERSION_TOKENS_TAG}
exec(compile(OLD_SOURCE, "bec84a5/verl_traj/integration/async_modes/v1_failures.py", "exec"), OLD)


class _Hooks(ReplayBufferAsync):
    """verl's async buffer with its own eviction stubbed out (nothing cleared: each poll sees the same groups) and
    its staleness reasons reduced to its failed groups (as verl's async buffer gives them): the hooks above it are
    all that is timed."""

    def _terminal_eviction_reasons(self, global_steps: int, partition_id: str) -> tuple:
        return set(), set(), set(self.failure_keys[partition_id]), Counter()

    def _evict_terminal_groups(self, global_steps: int, partition_id: str, eviction_reasons: tuple) -> tuple:
        return set(), 0, 0, {}

    def _log(self, metrics: dict) -> None:  # FailedGroupPolicy's, for the old mixins
        pass

    @property
    def cut_lengths(self) -> CutLengths:
        return self.__dict__.setdefault("_cut_lengths", CutLengths())


def _buffers() -> tuple[Any, Any]:
    """(now, before): verl_traj's policies as mixed in now, and at bec84a5, over :class:`_Hooks`."""
    kw = dict(trainer_mode="colocate_async", trainer_config=OmegaConf.create({}), max_off_policy_threshold=None,
              max_off_policy_strategy="drop", sampler_kwargs=OmegaConf.create({}))
    now = type("Now", (StaleGroupPolicy, FailedGroupPolicy, _Hooks), {})(**kw)
    v1_failures.with_group_policies(now, TrajConfig(max_staleness=1.0, failed_groups="keep_survivors"), 16)
    before = type("Before", (OLD["OldStaleGroupPolicy"], OLD["OldFailedGroupPolicy"], _Hooks), {})(**kw)
    before.failed_group_policy, before.min_survivors, before.max_staleness = "keep_survivors", 2, 1.0
    return now, before


def _put_groups(uids: list[str], n: int, steps: int) -> None:
    """Groups of ``n`` sessions of ``steps`` rows, settled; one in 16 lost a session, one in 64 all but one."""
    keys, tags, prompts = [], [], []
    for uid in uids:
        g = int(uid.rsplit("g", 1)[1])
        failed = range(1, n) if g % 64 == 0 else [n - 1] if g % 16 == 8 else []
        prompt = {"is_prompt": True, "status": "failure" if failed else "finished", "global_steps": STEP - 1}
        for s in failed:
            prompt.update(failure_tag(s, RuntimeError("tool died"), [120, 3]))
        prompts.append(prompt)
        for s in set(range(n)) - set(failed):
            for i in range(steps):
                keys.append(f"{uid}_{s}_{i}")
                last = {VERSION_TOKENS_TAG: [[STEP - 1, 400]], LENGTH_TAG: [400, steps]} if i == steps - 1 else {}
                tags.append({"status": "success", "global_steps": STEP - 1, "seq_len": 900, **last})
    for j in range(0, len(keys), 5000):
        tq.kv_batch_put(keys=keys[j:j + 5000], partition_id="train", tags=tags[j:j + 5000])
    tq.kv_batch_put(keys=uids, partition_id="train", tags=prompts)


def _clear_all() -> None:
    keys = list((tq.kv_list(partition_id="train") or {}).get("train", {}))
    for j in range(0, len(keys), 20000):
        tq.kv_clear(partition_id="train", keys=keys[j:j + 20000])


def _churn(buffer: Any, n: int, steps: int, fresh: list[str]) -> None:
    """Between polls: 8 groups taken (evicted or sampled: prompt key and rows cleared), 8 new ones settled."""
    taken = sorted(buffer.finished_keys["train"])[:8]
    rows = [key for key in buffer.partitions["train"] if key.split("_")[0] in set(taken)]
    tq.kv_clear(partition_id="train", keys=taken + rows)
    _put_groups([fresh.pop() for _ in range(8)], n, steps)


def _timed(fn: Any, *args: Any) -> float:
    start = time.perf_counter()
    fn(*args)
    return (time.perf_counter() - start) * 1e3


# inside the hooks: TransferQueue's reads (by key now, the partition's listing before) and the staleness check
# (core/rollout/staleness.py's groups_over_bound, the same code both ways: O(sessions of the groups held) a poll)
PARTS = {"reads": 0.0, "bound": 0.0}


def _counted(fn: Any, part: str) -> Any:
    """``fn``, its time (ms) added to ``PARTS[part]``."""
    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            PARTS[part] += (time.perf_counter() - start) * 1e3
    return timed


def _measure(fn: Any, *args: Any) -> tuple[float, float, float]:
    """(ms of ``fn(*args)``, of which TransferQueue reads, of which the staleness check)."""
    PARTS.update(reads=0.0, bound=0.0)
    return _timed(fn, *args), PARTS["reads"], PARTS["bound"]


def _hooks(buffer: Any) -> None:
    buffer._evict_terminal_groups(STEP, "train", buffer._terminal_eviction_reasons(STEP, "train"))


def poll_costs(tag: str, prompts: int, n: int, steps: int, polls: int) -> dict:
    """One size's poll: verl's read, and the hooks' work on it before and now (milliseconds)."""
    _clear_all()
    _put_groups([f"{tag}g{g:06d}" for g in range(prompts)], n, steps)
    fresh = [f"{tag}g{g:06d}" for g in range(prompts, prompts + 8 * polls)]
    now, before = _buffers()
    read, now_ms, old_ms = [], [], []
    for poll in range(polls):
        read.append(_timed(ReplayBufferAsync._sync_metadata_from_transfer_queue, now))
        for name in ("partitions", "pending_keys", "running_keys", "finished_keys", "failure_keys",
                     "prompt_global_steps"):
            setattr(before, name, getattr(now, name))  # the same metadata, read once
        now_ms.append(_measure(lambda: (now._refresh_group_indexes(), _hooks(now))))
        old_ms.append(_measure(_hooks, before))
        _churn(now, n, steps, fresh)
    med = {name: [statistics.median(x[i] for x in ms[1:]) for i in (0, 1, 2)]
           for name, ms in (("now", now_ms), ("before", old_ms))}
    return {"size": f"{prompts}x{n}x{steps}", "rows": len(now.partitions["train"]),
            "verl_read_ms": statistics.median(read), "wait_s_at_0.25": poll_interval(0.25, min(read) / 1e3),
            **{f"{name}_{part}ms": med[name][i] for name in med for i, part in enumerate(("", "reads_", "bound_"))},
            "now_first_ms": now_ms[0][0]}


def print_table(out: list[dict], polls: int, count: int, calls: int) -> None:
    """The markdown table of :func:`main`'s results (``--json`` prints them as they are)."""
    print(f"poll: verl's read, then verl_traj's policy work on it, in ms (median of {polls - 1} polls after "
          f"the first; its TransferQueue reads / its staleness check: groups_over_bound before, now each group's cached "
          f"facts, counted in the total); stall: {count} sessions x "
          f"{calls} calls on one event loop, {out[0]['now']['failed']} failing: the longest callback (ms, its CPU ms, "
          "owner)\n")
    print("| size | rows | verl's read | policy work before | now | now, first poll | longest stall before | now "
          "|\n|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in out:
        b, n = r["before"], r["now"]
        print(f"| {r['size']} | {r['rows']} | {r['verl_read_ms']:.0f} | {r['before_ms']:.1f} "
              f"({r['before_reads_ms']:.1f} / {r['before_bound_ms']:.1f}) | {r['now_ms']:.1f} "
              f"({r['now_reads_ms']:.1f} / {r['now_bound_ms']:.1f}) | {r['now_first_ms']:.1f} | "
              + " | ".join(f"{x['max_stall_ms']:.1f} ({x['stall_cpu_ms']:.1f}, {x['stall_owner']})" for x in (b, n))
              + " |")


def main(argv: Any = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1024x16x1,977x16x8", help="prompts x sessions x steps, comma-separated")
    ap.add_argument("--polls", type=int, default=5)
    ap.add_argument("--sessions", default="1024x16", help="sessions x calls of the stall run")
    ap.add_argument("--fail-every", type=int, default=128)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    tq.init(OmegaConf.create({"backend": {"SimpleStorage": {"num_data_storage_units": 1,
                                                            "total_storage_size": 400000}}}))
    count, calls = (int(x) for x in args.sessions.split("x"))
    v1_failures._read_tags = _counted(v1_failures._read_tags, "reads")  # the bench's timers
    v1_staleness.groups_over_bound = OLD["groups_over_bound"] = _counted(groups_over_bound, "bound")
    OLD["tq"] = SimpleNamespace(**{name: getattr(tq, name) for name in ("async_kv_put", "kv_clear")},
                                kv_list=_counted(tq.kv_list, "reads"))
    out = []
    try:
        for i, size in enumerate(args.sizes.split(",")):
            prompts, n, steps = (int(x) for x in size.split("x"))
            row = poll_costs(f"s{i}", prompts, n, steps, args.polls)
            for variant in ("before", "now"):
                runner = run_session if variant == "now" else OLD["run_session"]
                row[variant] = asyncio.run(failing_sessions(runner, f"stall{variant}", count, calls, args.fail_every))
            out.append(row)
    finally:
        tq.close()
        ray.shutdown()
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    print_table(out, args.polls, count, calls)
    return 0


if __name__ == "__main__":
    sys.exit(main())
