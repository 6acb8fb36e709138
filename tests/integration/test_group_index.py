"""The replay buffer's index of its groups' rows (:mod:`verl_traj.integration.async_modes.group_index`): what it holds
after each poll equals a full scan of the stored rows (the code it replaced), it reads only the rows new since the
last poll, and it forgets every group the partition no longer holds."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from omegaconf import OmegaConf
from verl.trainer.ppo.v1 import replay_buffer as verl_buffer
from verl.trainer.ppo.v1.replay_buffer import ReplayBufferAsync

from verl_traj.config import TrajConfig
from verl_traj.core.rollout.failures import failure_tag
from verl_traj.core.rollout.session_ledger import LENGTH_TAG, VERSION_TOKENS_TAG
from verl_traj.integration.async_modes import v1_failures
from verl_traj.integration.async_modes.group_index import RECONCILE_SLACK, GroupIndex


def _scan(rows: dict, uids) -> dict:
    """The facts of ``uids`` by a full pass over ``rows`` (the replaced code's way)."""
    out = {uid: {"keys": [], "sessions": set(), "ledgers": [], "lengths": []} for uid in uids}
    for key, tag in rows.items():
        facts = out.get(key.split("_")[0])
        if facts is not None:
            facts["keys"].append(key)
            facts["sessions"].add(key.rsplit("_", 1)[0])
            if VERSION_TOKENS_TAG in tag:
                facts["ledgers"].append(tag[VERSION_TOKENS_TAG])
            if LENGTH_TAG in tag:
                facts["lengths"].append(tag[LENGTH_TAG])
    return {uid: (tuple(f["keys"]), len(f["sessions"]), tuple(f["ledgers"]), tuple(f["lengths"]))
            for uid, f in out.items()}


class _Store:
    """A partition as TransferQueue lists it: keys in creation order, a cleared key gone; prompt statuses apart."""

    def __init__(self, rng: np.random.Generator):
        self.rng, self.rows, self.status, self.next_uid, self.ran = rng, {}, {}, 0, set()

    def dispatch(self, groups: int) -> None:
        for _ in range(groups):
            self.status[f"g{self.next_uid}"] = "running"
            self.next_uid += 1

    def work(self) -> None:
        """Some running sessions store their rows (a few steps each, the last carrying its ledger and length); some
        fail and clear theirs; some groups settle."""
        for uid in [u for u, s in self.status.items() if s == "running"]:
            for session in range(4):
                if self.rng.random() < 0.3 and (uid, session) not in self.ran:  # each session stores once
                    self.ran.add((uid, session))
                    steps = int(self.rng.integers(1, 5))
                    for i in range(steps):
                        last = ({VERSION_TOKENS_TAG: [[1, 10 + i]], LENGTH_TAG: [10 + i, steps]}
                                if i == steps - 1 else {})
                        self.rows[f"{uid}_{session}_{i}"] = {"status": "success", **last}
                    if self.rng.random() < 0.1:  # the session failed after storing: run_session clears its rows
                        for i in range(steps):
                            del self.rows[f"{uid}_{session}_{i}"]
            if self.rng.random() < 0.4:
                self.status[uid] = "failure" if self.rng.random() < 0.2 else "finished"

    def take(self, fraction: float) -> None:
        """verl evicts or samples some terminal groups (prompt key cleared) and the trainer clears some rows."""
        for uid in [u for u, s in self.status.items() if s != "running" and self.rng.random() < fraction]:
            del self.status[uid]
        orphans = [k for k in self.rows if k.split("_")[0] not in self.status]
        for key in orphans[: len(orphans) // 2]:
            del self.rows[key]

    def terminal(self) -> set:
        return {u for u, s in self.status.items() if s != "running"}


@pytest.mark.parametrize("seed", range(4))
def test_the_index_equals_a_full_scan_after_every_poll_and_reads_only_new_rows(seed):
    store, index = _Store(np.random.default_rng(seed)), GroupIndex()
    listed: set = set()
    for poll in range(60):
        store.dispatch(3)
        store.work()
        if poll % 3 == 2:
            store.take(0.5)
        rows = dict(store.rows)  # verl's partitions[...] of this poll
        before = {uid: index.facts.get(uid) for uid in store.terminal()}
        new = index.refresh(rows, store.terminal(), store.status)
        expected = _scan(rows, store.terminal())
        got = {uid: (f.keys, f.sessions, f.ledgers, f.lengths) for uid, f in index.facts.items()}
        assert got == expected
        assert new == len(rows.keys() - listed)  # the rows not listed at an earlier poll, only
        listed |= rows.keys()
        for uid, facts in before.items():  # a group settled before is not read again
            assert facts is None or index.facts[uid] is facts
        assert index.pending.keys() <= set(store.status) and index.facts.keys() <= set(store.status)
        assert len(index.known) <= len(rows) + RECONCILE_SLACK


def test_a_group_no_longer_listed_is_forgotten_and_its_rows_are_not_read_again():
    index = GroupIndex()
    rows = {"a_0_0": {LENGTH_TAG: [5, 1]}, "a_1_0": {LENGTH_TAG: [7, 1]}, "b_0_0": {}}
    assert index.refresh(rows, {"a"}, {"a": 1, "b": 1}) == 3
    index.prompt_tags["a"] = {"traj_failure_2": "timeout"}
    assert index.lengths(["a"]) == {"a": ([5, 1], [7, 1])} and index.sessions(["a", "b"]) == {"a": 2, "b": 0}
    assert index.refresh(rows, set(), {"b": 1}) == 0  # "a" sampled: its prompt key cleared, its rows not yet
    assert not index.facts and not index.prompt_tags and list(index.pending) == ["b"]
    assert index.refresh({}, set(), {}) == 0  # the trainer cleared the rows, "b" left too
    assert not index.pending and not index.facts


def test_a_key_stored_out_of_order_is_taken_when_the_index_drops_cleared_keys():
    """TransferQueue lists a partition in creation order; were a key ever listed before keys seen earlier, the
    backwards read would miss it, and the next drop of cleared keys (a set difference) takes it."""
    index = GroupIndex()
    old = {f"old{i}_0_0": {} for i in range(RECONCILE_SLACK + 10)}
    index.refresh(old, set(), {})
    rows = {"late_0_0": {LENGTH_TAG: [3, 1]}, "new_0_0": {}}  # "late" listed first: missed by the backwards read
    assert index.refresh(rows, {"late"}, {"late": 1, "new": 1}) == 2  # old rows cleared: the drop runs, takes it
    assert index.group("late").lengths == ([3, 1],) and len(index.known) == 2


class _MemoryTQ:
    """TransferQueue as verl's replay buffer and verl_traj's policies call it, over a dict (tags only), counting the
    whole-partition listings and the reads by key (its client's ``kv_retrieve_meta``)."""

    def __init__(self) -> None:
        self.tags: dict[str, dict] = {}
        self.listings: list = []
        self.read_keys: list = []

    def kv_list(self, partition_id=None):
        self.listings.append(partition_id)
        return {"train": {key: dict(tag) for key, tag in self.tags.items()}}

    def kv_put(self, key: str, partition_id: str, tag: dict, **_) -> None:
        self.tags.setdefault(key, {}).update(tag)

    def kv_clear(self, keys, partition_id: str) -> None:
        for key in [keys] if isinstance(keys, str) else keys:
            self.tags.pop(key, None)

    def get_client(self) -> "_MemoryTQ":
        return self

    def kv_retrieve_meta(self, keys, partition_id: str, create: bool = False):
        self.read_keys.append(sorted(keys))
        found = [key for key in keys if key in self.tags]
        return SimpleNamespace(size=len(found), global_indexes=found, custom_meta=[dict(self.tags[k]) for k in found])

    def kv_retrieve_keys(self, global_indexes, partition_id: str) -> list:
        return list(global_indexes)


def _group(kv: _MemoryTQ, uid: str, ledgers: list, failed: tuple = (), step: int = 5) -> None:
    for session, ledger in enumerate(ledgers):
        kv.kv_put(f"{uid}_{session}_0", "train", {"status": "success", VERSION_TOKENS_TAG: ledger,
                                                  LENGTH_TAG: [sum(n for _, n in ledger), 1]})
    for session in failed:
        kv.kv_put(uid, "train", failure_tag(session, RuntimeError("tool died"), [9, 2]))
    kv.kv_put(uid, "train", {"is_prompt": True, "status": "failure" if failed else "finished", "global_steps": step})


def test_the_buffer_lists_transfer_queue_once_a_poll_and_reads_each_failed_groups_tag_once(monkeypatch):
    """keep_survivors with a staleness bound: the policies' reads of the rows come from the index, and the failed
    groups' prompt tags are read by key, once per group, never by a second listing of the partition."""
    kv = _MemoryTQ()
    monkeypatch.setattr(verl_buffer, "tq", kv)
    monkeypatch.setattr(v1_failures, "tq", kv)
    _group(kv, "fresh", [[[5, 8]], [[5, 6]]])
    _group(kv, "kept", [[[5, 4]], [[5, 5]]], failed=(2, 3))
    _group(kv, "lost", [[[5, 3]]], failed=(1,))
    buffer = v1_failures.group_policy_class(ReplayBufferAsync)(
        trainer_mode="colocate_async", trainer_config=OmegaConf.create({}), max_off_policy_threshold=None,
        max_off_policy_strategy="drop", sampler_kwargs=OmegaConf.create({}),
        refill_fn=lambda k: _group(kv, "refill", [[[5, 2]], [[5, 2]]], step=6))  # sampled after the older
    buffer = v1_failures.with_group_policies(buffer, TrajConfig(max_staleness=1.0, failed_groups="keep_survivors",
                                                                replay_poll_s=0.01), 4)
    batch, metrics = buffer.sample(global_steps=6, partition_id="train", batch_size=2)
    assert {key.split("_")[0] for key in batch.keys} == {"fresh", "kept"}
    assert metrics["traj_failure/groups_kept_total"] == 1.0 and metrics["traj_failure/groups_dropped_total"] == 1.0
    assert kv.listings and set(kv.listings) == {None}  # verl's own listing, once a poll; no partition listed again
    assert kv.read_keys == [["kept", "lost"]]  # both failed groups' tags, in one read, once
    assert buffer.cut_lengths.take()["failed"].tokens.tolist() == [9, 9, 9]
    buffer._sync_metadata_from_transfer_queue()  # sampled and evicted groups leave the index with their prompt keys
    assert set(buffer.group_index("train").facts) == {"refill"} and not buffer.group_index("train").prompt_tags
