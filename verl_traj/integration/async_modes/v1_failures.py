"""Failed rollouts on verl's v1 trainer, handled per group (``traj.failed_groups``, :mod:`verl_traj.core.rollout.failures`).

Two places:

* the agent-loop worker (:func:`run_session`, from
  :class:`~verl_traj.integration.agent_loops.v1_agent_loop.TrajAgentLoopWorkerTQ`): each session runs under
  ``traj.trajectory_timeout_s``; when it fails, it tags its group's prompt key with the reason and clears any rows it
  had stored (never half a trajectory), then re-raises, so verl marks the group ``failure`` as usual;
* the replay buffer (from :class:`~verl_traj.integration.trainers.v1.TrajV1Mixin`): verl builds it with
  :func:`group_policy_class` of its choice (sync or async, or a user's subclass), :class:`FailedGroupPolicy` first in
  its MRO, and :func:`with_group_policies` sets it to ``traj:``. It decides which failed
  groups leave (all under ``drop``; those without a finished session under ``keep_survivors``), lets verl evict and
  refill them, and logs ``traj_failure/*`` on every sampling (zeros when nothing failed).

verl's sync trainer refills evicted groups only with exact, one-prompt dataloader fetches
(``trainer.v1.sampler.sync_refill_failed_groups=true``, which sets ``data.gen_batch_size=1``; the prompts and their
order are unchanged): :func:`settle_failed_groups` turns it on at start-up on v1's sync mode with ``traj.enable``.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Awaitable, Optional

import transfer_queue as tq
from omegaconf import open_dict

from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer, ReplayBufferAsync

from verl_traj.config import TrajConfig, TrajConfigError
from verl_traj.core.rollout.failures import (FAILURE_TAG_PREFIX, failed_groups_to_evict, failure_metrics, failure_tag,
                                     fatal_failure, min_survivors)
from verl_traj.core.rollout.session_ledger import current_ledger
from verl_traj.integration.async_modes.cut_lengths import CutLengths, failed_lengths, finished_lengths
from verl_traj.integration.async_modes.group_index import GroupIndex
from verl_traj.integration.async_modes.v1_staleness import StaleGroupPolicy

__all__ = ["FailedGroupPolicy", "POLL_COST_SHARE", "REFILL", "group_policy_class", "poll_interval", "run_session",
           "settle_failed_groups", "with_group_policies"]

REFILL = "trainer.v1.sampler.sync_refill_failed_groups"
POLL_COST_SHARE = 0.2  # the most of the trainer's wait for a step's groups spent reading TransferQueue's metadata


def poll_interval(floor: float, took: float) -> float:
    """Seconds to wait before the next replay-buffer poll: ``traj.replay_poll_s`` (``floor``), or longer where one
    poll took ``took`` seconds, so polling costs at most ``POLL_COST_SHARE`` of the wait. A poll reads every key's
    tag of the partition: 1-2 ms at 64 prompts x 4 sessions, 69-398 ms at 1,024 x 16 (scripts/bench_replay_poll.py),
    where a fixed 0.25 s would keep the driver and the TransferQueue controller busy most of the time."""
    return max(floor, took * (1 - POLL_COST_SHARE) / POLL_COST_SHARE)


def settle_failed_groups(config: Any, traj_config: TrajConfig) -> Optional[str]:
    """On v1's sync mode with ``traj.enable``: exact refills (``REFILL=true``), which dropping a failed group needs.
    Returns the setting written, or None. On v0 (whose agent loops stop training when one raises) a setting only v1
    serves is refused."""
    if traj_config.enable and not config.trainer.get("use_v1", False):
        for name, value, default in (("trajectory_timeout_s", traj_config.trajectory_timeout_s, None),
                                     ("failed_groups", traj_config.failed_groups, "drop")):
            if value != default:
                raise TrajConfigError(
                    f"traj.{name}={value!r} needs verl's v1 trainer (trainer.use_v1=true): on v0 an agent loop that "
                    f"raises stops the step, and no failed group is dropped or kept. Fix: set trainer.use_v1=true, or "
                    f"remove traj.{name}.", field=f"traj.{name}")
        if traj_config.replay_poll_s != TrajConfig.replay_poll_s:
            raise TrajConfigError(
                f"traj.replay_poll_s={traj_config.replay_poll_s!r} needs verl's v1 trainer (trainer.use_v1=true): v0 "
                "has no replay buffer to poll (its generation returns when the last session ends). Fix: set "
                "trainer.use_v1=true, or remove traj.replay_poll_s.", field="traj.replay_poll_s")
    v1 = config.trainer.get("use_v1", False) and config.trainer.v1.get("trainer_mode", "sync") == "sync"
    if not (traj_config.enable and v1) or config.trainer.v1.sampler.get("sync_refill_failed_groups", False):
        return None
    with open_dict(config):
        config.trainer.v1.sampler.sync_refill_failed_groups = True
    return f"{REFILL}=true"


async def run_session(session: Awaitable, timeout_s: Optional[float], uid: str, session_id: int,
                      partition_id: str = "train") -> Any:
    """Await one session under ``timeout_s``; on failure tag the group, clear the session's stored rows, re-raise.

    A session stores its rows inside itself (verl's ``_run_agent_loop`` awaits the loop, then
    ``_agent_loop_postprocess``, which puts them), and the worker records each row key in the session's ledger before
    the put that stores it (:attr:`~verl_traj.core.rollout.session_ledger.SessionLedger.stored_keys`): a failure or a timeout
    that cuts the put half-way leaves at most those keys, and exactly those are cleared, through TransferQueue's async
    API (no listing of the partition; the event loop serves the other sessions meanwhile). Nothing of the session runs
    after this: its task has ended, and verl publishes the group's status only once every session has settled."""
    try:
        return await (asyncio.wait_for(session, timeout_s) if timeout_s else session)
    except Exception as error:
        ledger = current_ledger()  # its length so far: the length bias of losing it (traj_bias/*)
        tag = failure_tag(session_id, error, ledger.length() if ledger is not None else None)
        async with _tag_lock():  # concurrent tag writes to one key lose fields in TransferQueue: one at a time
            await tq.async_kv_put(key=uid, partition_id=partition_id, tag=tag)
        stored = list(dict.fromkeys(ledger.stored_keys)) if ledger is not None else []
        if stored:
            await tq.async_kv_clear(keys=stored, partition_id=partition_id)
        raise


_LOCKS: dict[int, asyncio.Lock] = {}


def _tag_lock() -> asyncio.Lock:
    """One lock per event loop (the agent-loop worker's)."""
    loop = asyncio.get_running_loop()
    return _LOCKS.setdefault(id(loop), asyncio.Lock())


class FailedGroupPolicy:
    """Mixed in before verl's replay buffer class (:func:`with_group_policies`). Its ``_log`` collects what the next
    training ``sample`` reports, for :class:`~verl_traj.integration.async_modes.v1_staleness.StaleGroupPolicy` too; each
    metadata read sets the wait before the next (:func:`poll_interval`). What the policies read of the stored rows
    comes from each partition's :class:`~verl_traj.integration.async_modes.group_index.GroupIndex`, refreshed with
    each read (work for the rows new since the last), and the failed groups' prompt tags are read once each, by key."""

    failed_group_policy = "drop"
    min_survivors = 2  # keep_survivors: the fewest finished sessions a failed group trains on (with_group_policies)
    replay_poll_s = 2.0  # traj.replay_poll_s (with_group_policies sets it)

    def _sync_metadata_from_transfer_queue(self) -> None:
        start = time.perf_counter()
        super()._sync_metadata_from_transfer_queue()
        self._refresh_group_indexes()
        self.poll_interval = poll_interval(self.replay_poll_s, time.perf_counter() - start)  # the index's work too

    def _refresh_group_indexes(self) -> int:
        """Every training partition's :class:`GroupIndex` brought up to the metadata just read; the rows new to it."""
        return sum(self.group_index(partition_id).refresh(
            self.partitions[partition_id], self.finished_keys[partition_id] | self.failure_keys[partition_id],
            self.prompt_global_steps[partition_id])
            for partition_id in (self.partitions.keys() | self.prompt_global_steps.keys()) - {"val"})

    def group_index(self, partition_id: str) -> GroupIndex:
        """``partition_id``'s index of its groups' rows, as of the last metadata read."""
        return self.__dict__.setdefault("_group_indexes", {}).setdefault(partition_id, GroupIndex())

    def _terminal_eviction_reasons(self, global_steps: int, partition_id: str) -> tuple:
        stale, dapo, failed, counts = super()._terminal_eviction_reasons(global_steps, partition_id)
        if partition_id == "val":
            return stale, dapo, failed, counts
        failing = self.failure_keys[partition_id]
        survivors = (self.group_index(partition_id).sessions(failing)  # the finished sessions of failed groups
                     if failing and self.failed_group_policy != "drop" else {})
        return stale, dapo, failed_groups_to_evict(failing, survivors, self.failed_group_policy,
                                                   self.min_survivors), counts

    def _evict_terminal_groups(self, global_steps: int, partition_id: str, eviction_reasons: tuple) -> tuple:
        stale, filtered, failed = eviction_reasons[:3]
        if partition_id != "val" and (stale or filtered or failed):
            let_go, failing = set(stale) | set(filtered) | set(failed), self.failure_keys[partition_id]
            # failed sessions sit in failed groups only (a kept one can leave as stale under keep_survivors)
            tags = self._prompt_tags(partition_id, failing) if let_go & failing else {}
            if failed:
                fatal_failure(tags)  # a verl_traj refusal: every refill would fail the same way
                self._log(failure_metrics(tags, failed, ()))
            finished = finished_lengths(self.group_index(partition_id).lengths(let_go),
                                        {"stale": stale, "filtered": filtered, "failed_group": failed})
            for cause, lengths in finished.items():
                self.cut_lengths.add(cause, lengths)
            for cause, lengths in failed_lengths(tags, let_go).items():
                self.cut_lengths.add(cause, lengths)
        return super()._evict_terminal_groups(global_steps, partition_id, eviction_reasons)

    @property
    def cut_lengths(self) -> CutLengths:
        """The trajectories let go since the trainer last took them (``traj_bias/*``)."""
        return self.__dict__.setdefault("_cut_lengths", CutLengths())

    def _materialize_batch(self, partition_id: str, selected_prompt_uids: list[str], partition_snapshot: dict) -> Any:
        kept = set(selected_prompt_uids) & self.failure_keys[partition_id]
        if kept and partition_id != "val":  # keep_survivors: trained on the finished sessions
            tags = self._prompt_tags(partition_id, self.failure_keys[partition_id])
            fatal_failure(tags)
            self._log(failure_metrics(tags, (), kept))
            for cause, lengths in failed_lengths(tags, kept).items():  # the failed sessions of the kept groups
                self.cut_lengths.add(cause, lengths)
        return super()._materialize_batch(partition_id, selected_prompt_uids, partition_snapshot)

    def sample(self, global_steps: int, partition_id: str, batch_size: int) -> tuple:
        batch, metrics = super().sample(global_steps, partition_id, batch_size)
        if partition_id != "val":  # what was handled since the last training sample (zeros: logged every step)
            metrics.update({**failure_metrics({}, (), ()), **self.__dict__.pop("_group_log", {})})
        return batch, metrics

    def _log(self, metrics: dict[str, float]) -> None:
        """Add to what the next training ``sample`` reports (evictions can happen outside ``sample`` too: verl's
        ``wait_for_sampleable``)."""
        totals = self.__dict__.setdefault("_group_log", {})
        for key, value in metrics.items():
            totals[key] = totals.get(key, 0.0) + value

    def _prompt_tags(self, partition_id: str, uids: set) -> dict[str, dict]:
        """The prompt keys' tags of the failed groups ``uids`` (all of them where handled: a verl_traj refusal in
        any stops training, :func:`fatal_failure`) that carry a failure (:func:`failure_tag`), each read once (settled:
        no session writes it again) and kept in the partition's index until the group leaves."""
        index = self.group_index(partition_id)
        missing = index.missing_prompt_tags(uids)
        if missing:
            read = _read_tags(missing, partition_id)
            index.prompt_tags.update({uid: read.get(uid, {}) for uid in missing})
        return {uid: tag for uid, tag in index.tags_of(uids).items()
                if any(k.startswith(FAILURE_TAG_PREFIX) for k in tag)}


def _read_tags(keys: list[str], partition_id: str) -> dict[str, dict]:
    """key -> tag of the stored ``keys`` of ``partition_id``, in one request: TransferQueue's KV interface lists only
    whole partitions (1.2-2.4 s at 125K keys on 2 shared cores, scripts/bench_replay_poll.py), its client reads the
    given keys' metadata (``kv_retrieve_meta``, whose ``custom_meta`` are the tags; keys not stored are left out)."""
    client = tq.get_client()
    meta = client.kv_retrieve_meta(keys=list(keys), partition_id=partition_id, create=False)
    if meta.size == 0:
        return {}
    found = list(keys) if meta.size == len(keys) else client.kv_retrieve_keys(meta.global_indexes, partition_id)
    return dict(zip(found, meta.custom_meta))


_CLASSES: dict[type, type] = {}


def group_policy_class(cls: type) -> type:
    """The class verl builds the replay buffer with instead of ``cls`` (verl's ``ReplayBuffer``, or a subclass):
    :class:`FailedGroupPolicy` first in its MRO and, on the async modes (:class:`ReplayBufferAsync`: the only ones
    whose rows can be stale), :class:`~verl_traj.integration.async_modes.v1_staleness.StaleGroupPolicy` before both
    (it bounds the groups the failure policy keeps, so it reads that policy's choice). One class per input."""
    if not (isinstance(cls, type) and issubclass(cls, ReplayBuffer)):
        raise TrajConfigError(
            f"trainer.v1.sampler.custom_sampler gives {getattr(cls, '__name__', cls)}, not a subclass of verl's "
            "ReplayBuffer: verl_traj cannot apply traj.failed_groups to it, and failed groups would be handled by rules "
            "it does not know. Fix: subclass verl.trainer.ppo.v1.replay_buffer.ReplayBuffer (or ReplayBufferAsync), or "
            "set traj.enable=false.", field="trainer.v1.sampler.custom_sampler")
    if issubclass(cls, FailedGroupPolicy):
        return cls
    mixins = (StaleGroupPolicy, FailedGroupPolicy) if issubclass(cls, ReplayBufferAsync) else (FailedGroupPolicy,)
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"Traj{cls.__name__}", (*mixins, cls), {"__module__": __name__})
    return _CLASSES[cls]


def with_group_policies(buffer: Any, traj_config: TrajConfig, group_size: int) -> Any:
    """``buffer`` (built as :func:`group_policy_class` of verl's choice) set to ``traj:``'s policies for groups of
    ``group_size`` sessions (``actor_rollout_ref.rollout.n``); it polls every ``traj.replay_poll_s`` seconds, or less
    often where a poll is slow (:func:`poll_interval`)."""
    if not isinstance(buffer, FailedGroupPolicy):
        raise RuntimeError(f"the replay buffer is a {type(buffer).__name__}, not built as group_policy_class(...) of "
                           "verl's: failed and stale groups would follow verl's rules. Build it inside "
                           "TrajV1Mixin._build_replay_buffer (replay_buffer_patches).")
    if (traj_config.max_staleness is not None and not isinstance(buffer, ReplayBufferAsync)
            and getattr(buffer, "trainer_mode", "sync") != "sync"):
        raise TrajConfigError(
            f"traj.max_staleness={traj_config.max_staleness} on trainer mode {buffer.trainer_mode!r} with the sampler "
            f"{type(buffer).__name__}, a subclass of verl's sync ReplayBuffer: verl_traj bounds staleness on verl's "
            "async buffer only, and the bound would not apply. Fix: subclass verl.trainer.ppo.v1.replay_buffer."
            "ReplayBufferAsync, or unset traj.max_staleness.", field="traj.max_staleness")
    buffer.poll_interval = buffer.replay_poll_s = traj_config.replay_poll_s  # verl's 2.0 s is not in its config
    buffer.failed_group_policy = traj_config.failed_groups
    buffer.min_survivors = min_survivors(group_size)
    buffer.max_staleness, buffer.stale_group_policy = traj_config.max_staleness, traj_config.stale_groups
    buffer.lag_cap, buffer.correct_fallback = traj_config.lag_cap, traj_config.correct_fallback
    buffer.health_thresholds = traj_config.health_thresholds
    return buffer
