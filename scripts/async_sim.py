"""A simulated clock around verl_traj's real replay-buffer policies, for ``scripts/bench_async_bias.py`` (issue 43).

What is real: the replay buffer (verl 0.9.1's ``ReplayBuffer`` / ``ReplayBufferAsync`` built as verl_traj builds it,
:func:`~verl_traj.integration.async_modes.v1_failures.group_policy_class` and ``with_group_policies``), the tags the
agent-loop workers leave (version tokens, lengths, failure tags: the functions that write them in production), the
trainer's length-bias metrics (:func:`~verl_traj.integration.trainers.v1_metrics.length_bias_metrics`) and verl's
trainer loop order (dispatch a batch, ``sample``, train, sync weights; warm-up batches and exact refills).

What is modelled: time. TransferQueue is a dict with its kv API (one process), the rollout pool serves ``capacity``
sequences at ``decode_tps`` tokens/s each and shares itself beyond that (continuous batching), a tool call takes
``tool_s``, and an update takes ``train_fixed_s + trained tokens / train_tps``. Time advances in ticks of ``dt``
seconds; the buffer's poll sleep advances the clock instead of sleeping. ``colocate_async`` and ``sync`` pause the
rollout while the trainer updates (one set of GPUs); ``separate_async`` keeps generating.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Optional

import numpy as np

from verl.trainer.ppo.v1 import replay_buffer as verl_buffer
from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer, ReplayBufferAsync

from async_drift import drift_metrics

from verl_traj.config import TrajConfig
from verl_traj.core.rollout.failures import failure_tag
from verl_traj.core.rollout.session_ledger import LENGTH_TAG, VERSION_TOKENS_TAG
from verl_traj.core.rollout.staleness import token_staleness_metrics
from verl_traj.integration.async_modes import v1_failures
from verl_traj.integration.async_modes.v1_failures import group_policy_class, with_group_policies
from verl_traj.integration.trainers.v1_metrics import length_bias_metrics


class MemoryKV:
    """TransferQueue's kv API as the replay buffer and the failure policy call it, in one dict (tags only)."""

    def __init__(self) -> None:
        self.tags: dict[str, dict[str, dict]] = {}

    def kv_list(self, partition_id: Optional[str] = None):
        if partition_id is None:
            return {p: dict(items) for p, items in self.tags.items()}
        return {partition_id: dict(self.tags.get(partition_id, {}))}

    def kv_put(self, key: str, partition_id: str, tag: dict, **_) -> None:
        self.tags.setdefault(partition_id, {}).setdefault(key, {}).update(tag)

    def kv_clear(self, partition_id: str, keys) -> None:
        items = self.tags.get(partition_id, {})
        for key in keys:
            items.pop(key, None)

    def get_client(self) -> "MemoryKV":
        """TransferQueue's client, for the reads by key of :func:`v1_failures._read_tags`: this object."""
        return self

    def kv_retrieve_meta(self, keys, partition_id: str, create: bool = False) -> SimpleNamespace:
        """The stored ``keys``' metadata in TransferQueue's shape: ``size``, ``global_indexes`` (here the keys),
        ``custom_meta`` (the tags); keys not stored are left out."""
        items = self.tags.get(partition_id, {})
        found = [key for key in keys if key in items]
        return SimpleNamespace(size=len(found), global_indexes=found, custom_meta=[dict(items[k]) for k in found])

    def kv_retrieve_keys(self, global_indexes, partition_id: str) -> list:
        return list(global_indexes)


@dataclass
class Session:
    uid: str
    sid: int
    tokens: np.ndarray  # [turns] generated tokens of each LLM call
    context: int  # tokens the update trains for this trajectory (its final context)
    reward: float
    fail_turn: Optional[int]  # the call after which its tool crashes, or None
    start: float
    dispatch_step: int = 0
    turn: int = 0
    left: float = 0.0  # tokens to generate (generating) or seconds of tool (in a tool call)
    generating: bool = True
    ledger: dict = field(default_factory=dict)  # version -> tokens
    done: bool = False


@dataclass
class Knobs:
    """The modelled machine: see the module docstring."""

    decode_tps: float = 30.0
    capacity: int = 192
    tool_s: float = 2.0
    train_tps: float = 10000.0
    train_fixed_s: float = 10.0
    fail_per_call: float = 0.0
    timeout_s: Optional[float] = None
    dt: float = 1.0


class Simulation:
    """One run: ``mode`` (sync, colocate_async, separate_async), a buffer set to ``traj`` (and verl's own bound),
    prompts drawn from ``workload`` (:class:`bench_async_bias.Workload`)."""

    def __init__(self, mode: str, traj: TrajConfig, workload, knobs: Knobs, batch: int, n: int, seed: int,
                 verl_threshold: Optional[int] = None, verl_strategy: str = "drop", warmup_batches: float = 1.0,
                 drift: Optional[float] = None):
        self.mode, self.workload, self.knobs, self.batch, self.n = mode, workload, knobs, batch, n
        self.rng = np.random.default_rng(seed)
        # the trained tokens' log-ratios (scripts/async_drift.py): their own generator, so every policy samples the
        # same sessions whatever the drift; under traj correct they move its gate, as the trainer's do
        self.drift, self.drift_rng, self.correcting = drift, np.random.default_rng(seed + 1), traj.stale_groups == "correct"
        self.kv = MemoryKV()
        base = ReplayBuffer if mode == "sync" else ReplayBufferAsync
        cls = type("Sim" + group_policy_class(base).__name__, (group_policy_class(base),),
                   {"_wait_for_next_poll": lambda buf, partition_id, last: self._poll_wait(buf)})
        buffer = cls(trainer_mode=mode, trainer_config={}, max_off_policy_threshold=verl_threshold,
                     max_off_policy_strategy=verl_strategy, sampler_kwargs={}, refill_fn=self.dispatch,
                     gen_batch_size=1, sync_refill_failed_groups=mode == "sync")
        self.buffer = with_group_policies(buffer, traj, n)
        self.now = 0.0
        self.version = 0  # updates done: the policy the rollout samples from
        self.step = 0
        self.live: list[Session] = []
        self.groups: dict[str, list[Session]] = {}
        self.dispatched: list[Session] = []
        self.busy_seq_s = 0.0  # sum over time of the sequences the pool serves, at most capacity
        self.warmup_batches = warmup_batches
        self.trainer_wait_s = 0.0
        self.uid_counter = 0
        self.trained: set[str] = set()  # row keys trained

    # ----- rollout -----
    def dispatch(self, prompts: int) -> int:
        """verl's ``refill_fn`` and ``prepare_step``: ``prompts`` new groups, running at once, tagged this step."""
        for _ in range(prompts):
            uid = f"p{self.uid_counter:07d}"
            self.uid_counter += 1
            group = [self._session(uid, sid, case) for sid, case in enumerate(self.workload.group(self.rng, self.n))]
            self.groups[uid] = group
            self.live.extend(group)
            self.dispatched.extend(group)
            self.kv.kv_put(uid, "train", {"is_prompt": True, "status": "running", "global_steps": self.step})
        return prompts

    def _session(self, uid: str, sid: int, case) -> Session:
        tokens, context, reward = case
        fail = None
        if self.knobs.fail_per_call > 0:
            draw = self.rng.geometric(self.knobs.fail_per_call)  # calls until the first crash
            fail = int(draw) - 1 if draw <= len(tokens) else None
        return Session(uid, sid, tokens, context, reward, fail, self.now, self.step, left=float(tokens[0]))

    def advance(self, seconds: float, rollout: bool) -> None:
        """Move the clock by ``seconds``; the pool generates only where ``rollout``."""
        end = self.now + seconds
        while self.now < end - 1e-9:
            dt = min(self.knobs.dt, end - self.now)
            if rollout:
                self._tick(dt)
            self.now += dt

    def _tick(self, dt: float) -> None:
        gen = [s for s in self.live if s.generating]
        serving = min(len(gen), self.knobs.capacity)
        self.busy_seq_s += serving * dt
        rate = self.knobs.decode_tps * (serving / len(gen) if gen else 1.0)
        ended = []
        for s in self.live:
            if s.generating:
                made = min(s.left, rate * dt)
                s.left -= made
                s.ledger[self.version] = s.ledger.get(self.version, 0) + made
                if s.left <= 1e-9:
                    s.turn += 1
                    if s.turn == len(s.tokens) or (s.fail_turn is not None and s.turn > s.fail_turn):
                        ended.append(s)
                    else:
                        s.generating, s.left = False, self.knobs.tool_s
            else:
                s.left -= dt
                if s.left <= 1e-9:
                    s.generating, s.left = True, float(s.tokens[s.turn])
            timed_out = self.knobs.timeout_s and self.now + dt - s.start > self.knobs.timeout_s
            if timed_out and not (ended and ended[-1] is s):  # past the deadline and not ended just now
                s.fail_turn = -1
                ended.append(s)
        for s in ended:
            self._end(s)
        if ended:
            self.live = [s for s in self.live if not s.done]

    def _end(self, s: Session) -> None:
        """A session ends: its row's tags (finished) or its group's failure tag (crashed, timed out), as production
        writes them; the prompt key's status once the whole group has ended."""
        s.done = True
        calls = s.turn + (1 if s.generating and s.left > 1e-9 else 0)  # a call cut mid-way counts, as in production
        length = [int(round(sum(s.ledger.values()))), int(calls)]
        if s.fail_turn is not None:
            error = TimeoutError() if s.fail_turn == -1 else RuntimeError("tool crashed")
            self.kv.kv_put(s.uid, "train", failure_tag(s.sid, error, length))
        else:
            versions = [[v, int(round(t))] for v, t in sorted(s.ledger.items()) if round(t) > 0]
            self.kv.kv_put(f"{s.uid}_{s.sid}_0", "train", {
                "status": "success", "min_global_steps": versions[0][0], "max_global_steps": versions[-1][0],
                VERSION_TOKENS_TAG: versions, LENGTH_TAG: length, "sim_context": s.context, "sim_reward": s.reward})
        group = self.groups[s.uid]
        if all(x.done for x in group):
            failed = any(x.fail_turn is not None for x in group)
            self.kv.kv_put(s.uid, "train", {"status": "failure" if failed else "finished"})

    @contextlib.contextmanager
    def _memory_tq(self):
        """The buffer's and the failure policy's ``tq`` module is :class:`MemoryKV` while the buffer samples."""
        kept = verl_buffer.tq, v1_failures.tq
        verl_buffer.tq = v1_failures.tq = SimpleNamespace(kv_list=self.kv.kv_list, kv_put=self.kv.kv_put,
                                                            kv_clear=self.kv.kv_clear, get_client=self.kv.get_client)
        try:
            yield
        finally:
            verl_buffer.tq, v1_failures.tq = kept

    def _poll_wait(self, buf) -> float:
        self.trainer_wait_s += buf.poll_interval
        self.advance(buf.poll_interval, rollout=True)
        return self.now

    # ----- trainer (verl's v1 loop) -----
    def run_step(self) -> dict:
        """One training step as verl's v1 trainer runs it; returns the step's record."""
        self.step += 1
        if self.step == 1 and self.mode != "sync":
            self.dispatch(math.floor(self.warmup_batches * self.batch))
        self.dispatch(self.batch)  # prepare_step: one batch a step
        start, waited = self.now, self.trainer_wait_s
        with self._memory_tq():
            batch, metrics = self.buffer.sample(global_steps=self.step, partition_id="train", batch_size=self.batch)
        tags = [t for t in batch.tags if LENGTH_TAG in t]
        trained = sum(t["sim_context"] for t in tags)
        update_s = self.knobs.train_fixed_s + trained / self.knobs.train_tps
        self.advance(update_s, rollout=self.mode == "separate_async")
        self.kv.kv_clear("train", batch.keys)
        self.trained.update(batch.keys)
        self.version = self.step
        ledgers = [t[VERSION_TOKENS_TAG] for t in tags]
        metrics = {**metrics, **length_bias_metrics(batch, self.buffer.cut_lengths.take(), self.workload.budget),
                   **token_staleness_metrics(ledgers, self.step - 1)}  # as the trainer logs them
        if self.drift is not None:
            health = drift_metrics(self.drift_rng, ledgers, self.step - 1, self.drift)
            metrics.update(health)
            if self.correcting:
                metrics.update(self.buffer.observe_health(health))
        return {"step": self.step, "trained": len(tags), "metrics": metrics, "wait_s": self.trainer_wait_s - waited,
                "step_s": self.now - start, "update_s": update_s}
