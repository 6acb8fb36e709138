#!/usr/bin/env python
"""The v1 driver's tree work at the users' size (issue 55, item 4): one step's ``_balance_batch`` on a batch held in a
real TransferQueue, and what verl_traj adds to the update call, verl_traj vs stock verl 0.9.1, seconds per phase and
bytes moved through TransferQueue.

Set-up (not timed): Ray (``address="local"``) and TransferQueue (SimpleStorage, ``--storage-units`` units sized for
the rows) in this process, as ``tests/integration/test_v1_transfer_queue.py`` starts them; then ``--rows`` step rows
written as verl's v1 agent loop (``AgentLoopWorkerTQ``) writes them: key ``{uid}_{session}_{index}``, its tensor
fields (prompts, responses, input_ids, attention_mask, position_ids, response_mask, loss_mask, rollout_log_probs,
rm_scores) stored unpadded, uid / session_id / num_turns, and the tags the trainers read (``seq_len``,
``prompt_len``, ...), with the row facts verl_traj's agent loop adds (each row's loss tokens and prefix block hashes:
``row_fact_tags``; ``--no-row-facts``: without, as another agent loop writes them). The rows are GRPO groups of ``--n`` sessions behind one shared prompt, each session one row per
LLM call, each call's context extending the previous call's (rows of a session are nested prefixes); per-call
lengths from the SWE-bench agent runs in ``shared/data/swebench_steps.jsonl``, sessions cut at ``--max-turns`` calls
or ``--prompt-len + --response-len`` tokens (``scripts/driver_workload.py``). ``--token-scale`` shrinks every length
(the recorded ones, the row budget and the micro-batch ``--cap``) alike, so the rows' shape against the cap stays
that of the recorded runs at a fraction of the tokens. The meta lists the rows in a random (completion) order, as
the replay buffer hands them over. The rows need at least ``--mini-batches`` groups (the planner refuses an empty
mini-batch): about ``--mini-batches x --n x 33`` rows.

Variants, each given a fresh meta of the same rows, round-robin over ``--repeats`` (median per phase):

* ``stock``: verl 0.9.1's own v1 ``PPOTrainer._balance_batch`` (``verl/trainer/ppo/v1/trainer_base.py``) called on
  a trainer built as the tests build one (``ray_less_trainer``, ``traj.enable=false``): it reads the ``seq_len``
  tags, fetches one whole row as the template of its 128-token synthetic padding rows and puts them
  (``upsample_batch_to_divisible_size``, to a multiple of ``lcm(dp, ppo_mini_batch_size x n)``), Karmarkar-Karp
  balances the rows over the ranks and reorders the meta; it writes nothing else back;
* ``traj rows`` (``traj.prefix_tree=false``) and ``traj trees`` (``traj.prefix_tree=true``): verl_traj's
  ``TrajV1Mixin._balance_batch`` on the same trainer class with ``traj.enable=true``.

Phases (exclusive ``time.perf_counter`` spans around the real functions, wrapped in their modules' namespaces; they
sum to the whole call): ``key_order`` (``in_key_order``), ``read_layout`` (keys, ``seq_len`` tags, the loss tokens
from the row facts' tags; with ``--no-row-facts`` one fetch of ``response_mask``), ``read_rows`` (trees only: the
stand-in rows from the recorded prefix hashes; with ``--no-row-facts`` the fetch of every row's ``input_ids``, hashed),
``plan`` (the planner; stock: ``calculate_workload`` + ``get_seqlen_balanced_partitions``), ``padding`` (writing the
padding rows, their template row fetched), ``tree_facts`` (``row_tree_facts``; the padding rows' ids are known,
not fetched), ``ship``
(the actor's update call shipping the plan's per-row fields, with trees each row's tree segment, and the loss weights
to the ranks: ``rank_blocks``, one Ray put per rank; an inference pass on trees ships the same but the weights),
``other`` (the rest: the metrics, the planned meta, the plan's facts, the update's loss weights; stock: its tag read,
meta reorder and balance metrics). Bytes: every
``transfer_queue.kv_batch_get`` / ``kv_batch_put`` of the call, the tensors' ``nbytes`` (nested: values and
offsets; non-tensor fields not counted). Between runs (not timed) the padding rows are cleared and the template
rows re-put as written, so every run sees the rows as the agent loop left them.

Memory is mostly per row, not per token (measured at 10^4 rows, 71 tokens a row): Ray + TransferQueue + this
process start at ~2.3 GiB, then ~39 KiB a row with the agent loop's fields, ~19 KiB with ``--fields planning`` (only
what the planning reads: ``input_ids``, ``response_mask``, uid, session_id); ``--fields auto`` (the default) stores the
agent loop's fields up to 10^5 rows and the planning's beyond. Fewer fields also make TransferQueue's calls cheaper
(its per-row cost grows with a row's fields): compare sizes stored with the same ``--fields``.

    python scripts/bench_v1_driver.py                                  # 10^4, 10^5, 10^6 rows (~21 GiB)
    python scripts/bench_v1_driver.py --rows 10000 --repeats 3 [--json]
    python scripts/bench_v1_driver.py --quick --json                   # tiny: the test's
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import json
import math
import os
import resource
import statistics
import sys
import threading
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import driver_workload as workload  # noqa: E402

VARIANTS = ("stock", "traj rows", "traj trees")
PHASES = ("key_order", "read_layout", "read_rows", "plan", "padding", "tree_facts", "ship", "other")
PARTITION = "train"
# the fields stored a row: verl's AgentLoopWorkerTQ's, or what the planning reads (a row's schema is also what its
# padding rows copy); None: all
FIELDS = {"agent-loop": None, "planning": ("input_ids", "response_mask", "uid", "session_id")}
QUICK = dict(rows=[610], n=4, dp=2, mini_batches=2, repeats=1, storage_units=1)
_NS = uuid.UUID("7b1d8c4e-2f6a-4e59-8d3c-5a1f0e9b6c21")


# ---- spans and bytes -------------------------------------------------------------------------------------------

@dataclass
class Meter:
    """Exclusive seconds per span (a span's time less its wrapped callees') and TransferQueue bytes per span and
    per fetch (label: the selected fields, ``*`` for all)."""

    seconds: dict = field(default_factory=lambda: defaultdict(float))
    fetched: dict = field(default_factory=lambda: defaultdict(int))  # span -> bytes
    put: dict = field(default_factory=lambda: defaultdict(int))
    fetches: dict = field(default_factory=lambda: defaultdict(lambda: [0, 0]))  # label -> [rows, bytes]
    wall: float = 0.0  # the whole call, timed outside the spans
    padding_rows: int = 0
    _stack: list = field(default_factory=list)  # [name, callee seconds]

    def wrap(self, name: str, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            self._stack.append([name, 0.0])
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = time.perf_counter() - t0
                _, callees = self._stack.pop()
                self.seconds[name] += dt - callees
                if self._stack:
                    self._stack[-1][1] += dt
        return timed

    @property
    def span(self) -> str:
        return self._stack[-1][0] if self._stack else "outside"


def td_nbytes(td: Any) -> int:
    """Bytes of a TensorDict's tensors (nested: values and offsets); non-tensor fields not counted."""
    total = 0
    for value in td.values():
        if isinstance(value, torch.Tensor):
            total += (value.values().nbytes + value.offsets().nbytes) if value.is_nested else value.nbytes
    return total


@contextlib.contextmanager
def counted_transfers(meter: Meter) -> Iterator[None]:
    """``transfer_queue.kv_batch_get`` / ``kv_batch_put`` (looked up on the module by every caller) counting bytes."""
    import transfer_queue as tq

    get, put = tq.kv_batch_get, tq.kv_batch_put

    def counted_get(keys, partition_id, select_fields=None):
        out = get(keys=keys, partition_id=partition_id, select_fields=select_fields)
        nbytes, label = td_nbytes(out), ",".join(select_fields) if select_fields else "*"
        meter.fetched[meter.span] += nbytes
        meter.fetches[label][0] += len(keys)
        meter.fetches[label][1] += nbytes
        return out

    def counted_put(keys, partition_id, fields=None, tags=None, data_parser=None):
        meter.put[meter.span] += td_nbytes(fields) if fields is not None else 0
        return put(keys=keys, partition_id=partition_id, fields=fields, tags=tags, data_parser=data_parser)

    tq.kv_batch_get, tq.kv_batch_put = counted_get, counted_put
    try:
        yield
    finally:
        tq.kv_batch_get, tq.kv_batch_put = get, put


def _span_targets(variant: str) -> list[tuple[Any, str, str]]:
    """(module or class, attribute, span) wrapped for a variant: the functions ``_balance_batch`` calls by name."""
    from verl.trainer.ppo.v1 import trainer_base

    from verl_traj.integration.trainers import v1, v1_planning, v1_updates

    if variant == "stock":
        return [(trainer_base, "upsample_batch_to_divisible_size", "padding"),
                (trainer_base, "calculate_workload", "plan"), (trainer_base, "get_seqlen_balanced_partitions", "plan")]
    return [(v1, "in_key_order", "key_order"), (v1, "read_layout", "read_layout"), (v1, "read_tree_rows", "read_rows"),
            (v1, "plan_layout", "plan"), (v1, "write_padding_rows", "padding"), (v1_updates, "rank_blocks", "ship"),
            (v1_planning, "pad_rows", "tree_facts"), (v1_planning, "row_tree_facts", "tree_facts"),
            (v1, "debug_rows", "debug_rows"), (v1, "plan_facts", "plan_facts"), (v1, "ordered_batch", "ordered_batch")]


@contextlib.contextmanager
def spans(meter: Meter, variant: str) -> Iterator[None]:
    targets = _span_targets(variant)
    saved = [getattr(owner, name) for owner, name, _ in targets]
    for owner, name, span in targets:
        setattr(owner, name, meter.wrap(span, getattr(owner, name)))
    try:
        yield
    finally:
        for (owner, name, _), fn in zip(targets, saved):
            setattr(owner, name, fn)


# ---- the rows, as verl's v1 agent loop stores them --------------------------------------------------------------

@dataclass(frozen=True)
class Rows:
    """Step rows of ``tr``'s sessions (flat per call, session-major): ``session [R]``, ``call [R]`` (index in its
    session), ``context [R]`` (the call's prompt tokens: every earlier token of the session), ``resp [R]``."""

    tr: workload.Trajectories
    session: np.ndarray
    call: np.ndarray
    context: np.ndarray
    resp: np.ndarray

    @property
    def length(self) -> np.ndarray:
        return self.context + self.resp


def step_rows(tr: workload.Trajectories, rows: int) -> Rows:
    """The first ``rows`` LLM calls of ``tr`` (session-major), one row each."""
    session = np.repeat(np.arange(tr.calls.size), tr.calls)[:rows]
    call = (np.arange(tr.obs.size) - np.repeat(tr.start, tr.calls))[:rows]
    start = np.repeat(tr.start, tr.calls)[:rows]
    before = np.cumsum(tr.obs + tr.resp) - (tr.obs + tr.resp)  # tokens of all sessions before each call
    context = (before + tr.obs)[:rows] - before[start]
    return Rows(tr, session, call, context, tr.resp[:rows])


def scaled(args, tokens: int) -> int:
    """A length option (recorded tokens) in the workload's tokens."""
    return max(2, round(tokens * args.token_scale))


def draw_rows(args, rows: int) -> tuple[Rows, int]:
    """``rows`` step rows of the workload and the prompts drawn (a multiple of ``--mini-batches``)."""
    def draw(prompts: int) -> workload.Trajectories:
        return workload.draw(workload.Workload(prompts, args.n, args.max_turns, scaled(args, args.prompt_len),
                                               scaled(args, args.response_len), args.token_scale, args.seed))

    per_prompt = args.n * float(draw(64).calls.mean())
    prompts = args.mini_batches * max(1, math.ceil(1.05 * rows / per_prompt / args.mini_batches))
    while True:
        tr = draw(prompts)
        if tr.calls.sum() >= rows:
            return step_rows(tr, rows), prompts
        prompts += args.mini_batches


def _nested(values: torch.Tensor, lengths: np.ndarray) -> torch.Tensor:
    offsets = torch.from_numpy(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))
    return torch.nested.nested_tensor_from_jagged(values, offsets)


def chunk_fields(r: Rows, sel: slice, n: int, tokens: np.ndarray, session_at: np.ndarray, uids: np.ndarray,
                 score: np.ndarray, rng: np.random.Generator, keep: Optional[tuple] = None) -> Any:
    """The TensorDict ``AgentLoopWorkerTQ`` puts for rows ``sel``: tensors unpadded (nested), one row each;
    ``keep``: only these fields. ``tokens``: every session's token stream, ``session_at [S]`` where each starts."""
    from tensordict import NonTensorStack, TensorDict

    length, context, resp = r.length[sel], r.context[sel], r.resp[sel]
    pos = np.arange(int(length.sum())) - np.repeat(np.cumsum(length) - length, length)
    ids = torch.from_numpy(tokens[np.repeat(session_at[r.session[sel]], length) + pos])
    in_prompt = torch.from_numpy(pos < np.repeat(context, length))
    ones = torch.ones(int(resp.sum()), dtype=torch.int64)
    rm = torch.zeros(int(resp.sum()), dtype=torch.float32)
    rm[torch.from_numpy(np.cumsum(resp) - 1)] = torch.from_numpy(score[r.session[sel]])  # the reward on the last token
    groups = r.tr.group[r.session[sel]]
    td = TensorDict({
        "prompts": _nested(ids[in_prompt], context), "responses": _nested(ids[~in_prompt], resp),
        "input_ids": _nested(ids, length), "attention_mask": _nested(torch.ones_like(ids), length),
        "position_ids": _nested(torch.from_numpy(pos), length), "response_mask": _nested(ones, resp),
        "loss_mask": _nested(ones.clone(), resp), "rm_scores": _nested(rm, resp),
        "rollout_log_probs": _nested(-torch.from_numpy(rng.random(ones.numel(), dtype=np.float32)), resp),
        "uid": NonTensorStack.from_list(uids[groups].tolist()),
        "session_id": NonTensorStack.from_list((r.session[sel] % n).tolist()),
        "num_turns": NonTensorStack.from_list((2 * r.tr.calls[r.session[sel]]).tolist()),
    }, batch_size=[len(length)])
    return td if keep is None else td.select(*keep)


def row_tags(r: Rows, sel: slice) -> list[dict]:
    """The tags ``AgentLoopWorkerTQ`` writes with each row (setup: one dict a row)."""
    return [{"status": "success", "prompt_len": int(p), "response_len": int(q), "seq_len": int(p + q),
             "global_steps": 1, "min_global_steps": 1, "max_global_steps": 1}
            for p, q in zip(r.context[sel], r.resp[sel])]


def session_tokens(r: Rows, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Each session's token stream (its group's shared prompt, then random tokens) and where each starts."""
    tr = r.tr
    length = np.add.reduceat(tr.obs + tr.resp, tr.start)
    at = np.concatenate([[0], np.cumsum(length)[:-1]])
    tokens = rng.integers(1000, 150_000, int(length.sum()))
    prompt_tokens = rng.integers(1000, 150_000, (int(tr.group.max()) + 1, int(tr.prompt.max())))
    pos = np.arange(int(tr.prompt.sum())) - np.repeat(np.cumsum(tr.prompt) - tr.prompt, tr.prompt)
    tokens[np.repeat(at, tr.prompt) + pos] = prompt_tokens[np.repeat(tr.group, tr.prompt), pos]
    return tokens, at


def fact_tags(r: Rows, sel: slice, tokens: np.ndarray, session_at: np.ndarray) -> list[dict]:
    """The row facts verl_traj's agent loop adds to the tags of rows ``sel`` (loss tokens, prefix block hashes:
    ``row_fact_tags``), here from the same token streams, hashed over the chunk at once."""
    from verl_traj.core.rollout.row_tags import LOSS_TOKENS_TAG, PREFIX_HASH_TAG
    from verl_traj.core.trees.prefix_hashes import prefix_block_hashes
    from verl_traj.core.trees.token_rows import TokenRows

    length = r.length[sel]
    pos = np.arange(int(length.sum())) - np.repeat(np.cumsum(length) - length, length)
    ids = tokens[np.repeat(session_at[r.session[sel]], length) + pos].astype(np.int64)
    hashes, offsets = prefix_block_hashes(TokenRows(ids, np.concatenate([[0], np.cumsum(length)]).astype(np.int64)))
    return [{LOSS_TOKENS_TAG: int(q), PREFIX_HASH_TAG: hashes[a:b].tobytes()}
            for q, a, b in zip(r.resp[sel].tolist(), offsets[:-1].tolist(), offsets[1:].tolist())]


def write_rows(tq: Any, r: Rows, n: int, seed: int, keep: Optional[tuple],
               chunk: int = 20_000, facts: bool = True) -> tuple[list[str], list[dict]]:
    """Store ``r`` in TransferQueue in chunks, as the agent loop stores sessions (``facts``: with the row facts
    verl_traj's agent loop tags, :func:`fact_tags`; stock verl reads only its own tags); returns the keys and tags in a
    random (completion) order."""
    rng = np.random.default_rng(seed + 1)
    tokens, session_at = session_tokens(r, rng)
    uids = np.asarray([str(uuid.uuid5(_NS, f"{seed}/{g}")) for g in range(int(r.tr.group.max()) + 1)], dtype=object)
    score = (rng.random(r.tr.calls.size) < 0.5).astype(np.float32)
    keys = [f"{uids[r.tr.group[s]]}_{s % n}_{c}" for s, c in zip(r.session.tolist(), r.call.tolist())]
    tags = row_tags(r, slice(None))
    for lo in range(0, len(keys), chunk):
        sel = slice(lo, lo + chunk)
        if facts:
            tags[sel] = [{**t, **f} for t, f in zip(tags[sel], fact_tags(r, sel, tokens, session_at))]
        tq.kv_batch_put(keys=keys[sel], partition_id=PARTITION, tags=tags[sel],
                        fields=chunk_fields(r, sel, n, tokens, session_at, uids, score, rng, keep))
    order = rng.permutation(len(keys))
    return [keys[i] for i in order], [tags[i] for i in order]


# ---- the trainers and one step ------------------------------------------------------------------------------------

def build_trainer(args, prompts: int, traj: dict) -> Any:
    """verl's v1 sync trainer class as verl_traj runs it, built by its real ``__init__`` (``ray_less_trainer``)."""
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

    from verl_traj.core.trees.tree_cost import DEVICE_COSTS
    from verl_traj.integration.config.verl_config import PlanSettings
    from verl_traj.testing.trainers import ray_less_trainer

    config = {"data": {"train_batch_size": prompts, "max_prompt_length": scaled(args, args.prompt_len),
                       "max_response_length": scaled(args, args.response_len)},
              "actor_rollout_ref": {"rollout": {"n": args.n},
                                    "actor": {"ppo_mini_batch_size": prompts // args.mini_batches, "ppo_epochs": 1}}}
    plan = (PlanSettings(scaled(args, args.cap), "tokens", True, tree_cost=DEVICE_COSTS["cuda"])
            if traj.get("enable", True) else None)
    with contextlib.redirect_stdout(io.StringIO()):  # verl's prints kept off stdout (--json)
        return ray_less_trainer(config, traj, plan=plan, dp=args.dp, v1_class=PPOTrainerSync)


def balance(tr: Any, variant: str, meta: Any) -> Any:
    """One step's ``_balance_batch``: verl's own for ``stock`` (its class's, past the inactive mixin), else the
    mixin's, then what verl_traj adds to the actor's update call: its plan fields and loss weights shipped to the
    ranks (``planned_update``; stock's update call ships nothing of its own)."""
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    from verl_traj.integration.trainers.update_contract import ACTOR
    from verl_traj.integration.trainers.v1_updates import planned_update

    if variant == "stock":
        return PPOTrainer._balance_batch(tr, meta, {})
    out = tr._balance_batch(meta, {})
    with planned_update(out, tr._step_facts, tr.spec, ACTOR, tr._traj_dp_size()):
        pass
    return out


@dataclass
class Batch:
    """The stored rows of one size: keys and tags in completion order, the rows each variant's padding template is
    copied from (restored after every run) and the step rows."""

    keys: list
    tags: list
    template_keys: list
    template: Any
    template_tags: list
    rows: Rows
    prompts: int

    def meta(self) -> Any:
        from transfer_queue import KVBatchMeta

        return KVBatchMeta(keys=list(self.keys), tags=list(self.tags), partition_id=PARTITION)


def restore(tq: Any, batch: Batch, out: Any) -> None:
    """Undo a run (not timed): its padding rows cleared, the template rows put back as written."""
    padding = list(set(out.keys).difference(batch.keys))
    if padding:
        tq.kv_clear(keys=padding, partition_id=PARTITION)
    tq.kv_clear(keys=batch.template_keys, partition_id=PARTITION)
    tq.kv_batch_put(keys=batch.template_keys, partition_id=PARTITION, fields=batch.template,
                    tags=batch.template_tags)


def run_once(tq: Any, tr: Any, variant: str, batch: Batch) -> Meter:
    from verl_traj.integration.trainers.v1_metrics import StepPadding

    meter, meta = Meter(), batch.meta()
    tr._step_padding = StepPadding()  # production forgets the rows at every step's metrics
    with counted_transfers(meter), spans(meter, variant):
        t0 = time.perf_counter()
        out = meter.wrap("other", balance)(tr, variant, meta)
        meter.wall = time.perf_counter() - t0
    restore(tq, batch, out)
    meter.padding_rows = len(out) - len(batch.keys)
    return meter


def phases_of(m: Meter) -> dict[str, float]:
    """One run's seconds per table phase: the named spans, ``other`` every other span."""
    out = {p: m.seconds.get(p, 0.0) for p in PHASES if p != "other"}
    out["other"] = sum(m.seconds.values()) - sum(out.values())
    return out


def summarize(variant: str, meters: list[Meter]) -> dict:
    """Median seconds per phase and span over the repeats, total the median of the calls' wall time (timed outside
    the spans: the phases sum to it); bytes of the last run (the same every run)."""
    names = sorted({k for m in meters for k in m.seconds})
    seconds = {k: statistics.median(m.seconds.get(k, 0.0) for m in meters) for k in names}
    runs = [phases_of(m) for m in meters]
    phases = {p: statistics.median(r[p] for r in runs) for p in PHASES}
    total = statistics.median(m.wall for m in meters)
    last = meters[-1]
    return {"variant": variant, "phases_s": phases, "spans_s": seconds, "total_s": total,
            "fetched_bytes": sum(last.fetched.values()), "put_bytes": sum(last.put.values()),
            "fetched_by_phase": dict(last.fetched), "put_by_phase": dict(last.put),
            "fetches": {k: {"rows": v[0], "bytes": v[1]} for k, v in last.fetches.items()},
            "padding_rows": last.padding_rows}


# ---- memory -----------------------------------------------------------------------------------------------------

class TreeRss:
    """Peak RSS of this process (``driver``) and of it with every process it started (``tree``: Ray's GCS and
    raylet, the TransferQueue controller and storage units), sampled every ``interval`` seconds on a daemon thread;
    :meth:`reset` starts a new peak (and finds the processes again)."""

    def __init__(self, interval: float = 0.25):
        import psutil

        self._proc, self._stop = psutil.Process(), threading.Event()
        self.reset()
        self._thread = threading.Thread(target=self._loop, args=(interval,), daemon=True)
        self._thread.start()

    def reset(self) -> None:
        self._procs = [self._proc, *self._proc.children(recursive=True)]
        self.driver = self.tree = 0
        self._sample()

    def now(self) -> tuple[int, int]:
        rss = []
        for p in self._procs:
            with contextlib.suppress(Exception):
                rss.append(p.memory_info().rss)
        return rss[0], sum(rss)

    def _sample(self) -> None:
        driver, tree = self.now()
        self.driver, self.tree = max(self.driver, driver), max(self.tree, tree)

    def _loop(self, interval: float) -> None:
        while not self._stop.wait(interval):
            self._sample()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def release_freed_memory() -> None:
    """Give the heap's freed pages back (not timed): the rows' set-up leaves glibc holding ~15 KiB a row that RSS
    would count."""
    import ctypes
    import gc

    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


# ---- a size, the sweep --------------------------------------------------------------------------------------------

def stored_batch(tq: Any, args, rows: int) -> Batch:
    r, prompts = draw_rows(args, rows)
    keys, tags = write_rows(tq, r, args.n, args.seed, FIELDS[fields_of(args, rows)], facts=args.row_facts)
    template_keys = list(dict.fromkeys([keys[0], min(keys, key=_key_order)]))  # stock's and the sorted first row
    template = tq.kv_batch_get(keys=template_keys, partition_id=PARTITION)
    template_tags = [tags[keys.index(k)] for k in template_keys]
    return Batch(keys, tags, template_keys, template, template_tags, r, prompts)


def fields_of(args, rows: int) -> str:
    """``--fields``; ``auto``: the agent loop's up to 10^5 rows, beyond only what the planning reads (memory: the
    module docstring)."""
    return args.fields if args.fields != "auto" else ("agent-loop" if rows <= 100_000 else "planning")


def _key_order(key: str) -> tuple:
    from verl_traj.core.rollout.row_key import row_key_order

    return row_key_order(key)


def run_variants(tq: Any, args, batch: Batch) -> list[dict]:
    """Every variant ``--repeats`` times, round-robin (each variant once a round), summarized."""
    trainers = {"stock": build_trainer(args, batch.prompts, {"enable": False}),
                "traj rows": build_trainer(args, batch.prompts, {"step_wise": True, "prefix_tree": False}),
                "traj trees": build_trainer(args, batch.prompts, {"step_wise": True, "prefix_tree": True})}
    meters = defaultdict(list)
    for _ in range(args.repeats):
        for v in args.variants:
            meters[v].append(run_once(tq, trainers[v], v, batch))
    results = [summarize(v, meters[v]) for v in args.variants]
    stock = next((x["total_s"] for x in results if x["variant"] == "stock"), None)
    for x in results:
        x["vs_stock"] = x["total_s"] / stock if stock else None
    return results


def run_size(tq: Any, args, rows: int, rss: TreeRss) -> dict:
    """One size: its rows stored (set-up: time and peak RSS), the variants run on them, the rows cleared."""
    t0 = time.perf_counter()
    rss.reset()
    batch = stored_batch(tq, args, rows)
    rss._sample()
    setup_peak = rss.tree
    release_freed_memory()
    setup_s, (_, stored) = time.perf_counter() - t0, rss.now()
    rss.reset()
    results = run_variants(tq, args, batch)
    rss._sample()
    tq.kv_clear(keys=batch.keys, partition_id=PARTITION)
    length = batch.rows.length
    return {"rows": len(batch.keys), "fields": fields_of(args, rows), "prompts": batch.prompts,
            "sessions": int(np.unique(batch.rows.session).size), "mean_tokens": float(length.mean()),
            "max_tokens": int(length.max()), "tokens": int(length.sum()), "setup_s": setup_s,
            "rss_peak_setup_mib": setup_peak / 2**20, "rss_stored_mib": stored / 2**20,
            "rss_peak_driver_mib": rss.driver / 2**20, "rss_peak_tree_mib": rss.tree / 2**20, "results": results}


@contextlib.contextmanager
def transfer_queue_up(args, max_rows: int) -> Iterator[Any]:
    import ray
    import transfer_queue
    from omegaconf import OmegaConf

    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    size = 10 * max_rows + 100_000  # a run's padding rows on top: a tree plan may pad several times the rows
    transfer_queue.init(OmegaConf.create({"backend": {"SimpleStorage": {
        "num_data_storage_units": args.storage_units, "total_storage_size": size}}}))
    try:
        yield transfer_queue
    finally:
        transfer_queue.close()
        ray.shutdown()


def _ints(text: str) -> list[int]:
    return [int(float(x)) for x in text.split(",")]


def _args(argv: Optional[list]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=_ints, default=[10_000, 100_000, 1_000_000], help="comma-separated sizes")
    ap.add_argument("--token-scale", type=float, default=0.005,
                    help="factor on the recorded token counts and the length options (0.005: ~70 tokens a row)")
    for flag, default, text in (
            ("--repeats", 3, "runs of each variant, round-robin (median)"), ("--dp", 8, "data-parallel ranks"),
            ("--mini-batches", 16, "mini-batches a step"), ("--n", 16, "sessions a prompt (rollout.n)"),
            ("--max-turns", 50, "LLM calls a session at most"),
            ("--prompt-len", 4096, "data.max_prompt_length (recorded tokens, x --token-scale)"),
            ("--response-len", 28672, "a session's whole multi-turn response at most (recorded tokens, x scale)"),
            ("--cap", 32768, "micro-batch token cap a rank, ppo_max_token_len_per_gpu (recorded tokens, x scale)"),
            ("--storage-units", 2, "TransferQueue SimpleStorage units (TransferQueue's default; verl's config: 8)"),
            ("--seed", 0, "workload seed")):
        ap.add_argument(flag, type=int, default=default, help=text)
    ap.add_argument("--variants", type=lambda s: s.split(","), default=list(VARIANTS), help=f"of {VARIANTS}")
    ap.add_argument("--fields", choices=["auto", *FIELDS], default="auto",
                    help="the fields stored a row: the agent loop's, those the planning reads, or auto (the agent "
                         "loop's up to 10^5 rows)")
    ap.add_argument("--quick", action="store_true", help=f"tiny sizes (the test's): {QUICK}")
    ap.add_argument("--no-row-facts", dest="row_facts", action="store_false",
                    help="rows without the facts verl_traj's agent loop tags (loss tokens, prefix hashes): the plan "
                         "then fetches response_mask and, with trees, input_ids (another agent loop's rows)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        for k, x in QUICK.items():
            setattr(args, k, x)
    return args


def print_table(report: dict) -> None:
    c = report["config"]
    print(f"v1 _balance_batch per step, real TransferQueue ({c['storage_units']} SimpleStorage units); dp={c['dp']}, "
          f"{c['mini_batches']} mini-batches, n={c['n']}; SWE-bench lengths, the row budget {c['prompt_len']} + "
          f"{c['response_len']} and the micro-batch cap {c['cap']} tokens, all x {c['token_scale']:g}; median of "
          f"{c['repeats']}")
    cols = " | ".join(p.replace("_", " ") for p in PHASES)
    print(f"| variant | rows | mean tokens/row | {cols} | total (s) | vs stock | MiB fetched | MiB put | "
          "padding rows |")
    print("|---|---:|---:|" + "---:|" * len(PHASES) + "---:|---:|---:|---:|---:|")
    for size in report["sizes"]:
        for x in size["results"]:
            cells = " | ".join(f"{x['phases_s'][p]:.3f}" for p in PHASES)
            vs = f"{x['vs_stock']:.2f}x" if x["vs_stock"] else ""
            print(f"| {x['variant']} | {size['rows']:,} | {size['mean_tokens']:.1f} | {cells} | {x['total_s']:.3f} | "
                  f"{vs} | {x['fetched_bytes'] / 2**20:.2f} | {x['put_bytes'] / 2**20:.2f} | {x['padding_rows']:,} |")
    for size in report["sizes"]:
        print(f"{size['rows']:,} rows: {size['prompts']} prompts, {size['sessions']} sessions, {size['tokens']:,} "
              f"tokens (longest row {size['max_tokens']}), {size['fields']} fields; written in {size['setup_s']:.1f} "
              f"s (peak RSS of all processes {size['rss_peak_setup_mib']:.0f} MiB); with the rows stored "
              f"{size['rss_stored_mib']:.0f} MiB, peak while planning: this process "
              f"{size['rss_peak_driver_mib']:.0f} MiB, with Ray's and TransferQueue's processes "
              f"{size['rss_peak_tree_mib']:.0f} MiB")


def main(argv: Optional[list] = None) -> int:
    args = _args(argv)
    t0 = time.perf_counter()
    rss = TreeRss()
    with transfer_queue_up(args, max(args.rows)) as tq:
        sizes = [run_size(tq, args, rows, rss) for rows in args.rows]
    rss.close()
    report = {"config": {k: x for k, x in vars(args).items() if k != "json"}, "sizes": sizes,
              "wall_s": time.perf_counter() - t0,
              "peak_rss_tree_mib": max(max(x["rss_peak_tree_mib"], x["rss_peak_setup_mib"]) for x in sizes),
              "peak_rss_driver_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    if args.json:
        print(json.dumps(report, indent=1, default=float))
    else:
        print_table(report)
        print(f"wall {report['wall_s']:.1f} s; peak RSS: this process {report['peak_rss_driver_mib']:.0f} MiB "
              f"(set-up included), with Ray's and TransferQueue's processes "
              f"{report['peak_rss_tree_mib']:.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
