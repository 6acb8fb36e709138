"""What the replay buffer's group policies read of a partition's stored rows, learnt once per group, so that a poll
costs O(rows stored since the last poll), not O(rows stored).

verl's replay buffer lists every key's tag of TransferQueue on each poll (``_sync_metadata_from_transfer_queue``) into
``partitions[partition_id]``, a dict row key -> tag in the listing's order. TransferQueue's controller lists a
partition's keys in the order they were created (a dict it appends a key to when it is first stored, and deletes it
from when it is cleared), and so does the dict verl builds: the rows stored since the last poll are a suffix of it,
found by reading it backwards up to the first key seen before (:meth:`GroupIndex.refresh`).

A group's rows are final once its prompt key's status is terminal (``finished`` / ``failure``): verl's agent-loop
worker publishes that status only after every session of the group has settled, each having stored its rows and
verl_traj's tags of them, or cleared them (a failed one). So each group is read once, when first seen terminal
(:class:`GroupFacts`): its row keys, how many sessions stored rows, its rows' version tokens and lengths. A group is
forgotten at the first refresh whose listing no longer has its prompt key (verl clears it when it evicts or samples
the group): the index holds the groups the partition holds, never more.

Pure module (stdlib, the tag names of :mod:`verl_traj.core.rollout.session_ledger` and the core's staleness reads): no verl,
no TransferQueue.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import AbstractSet, Collection, Mapping, Optional

from verl_traj.core.rollout.offpolicy import first_version
from verl_traj.core.rollout.session_ledger import LENGTH_TAG, VERSION_TOKENS_TAG
from verl_traj.core.rollout.staleness import stalest

__all__ = ["GroupFacts", "GroupIndex", "NO_FACTS"]

RECONCILE_SLACK = 4096  # keys cleared from TransferQueue the index may still hold before it drops them


@dataclass(frozen=True)
class GroupFacts:
    """One terminal group's stored rows, read once. ``keys``: its row keys in storage order; ``sessions``: the
    sessions with a row (``{uid}_{session}``, distinct); ``ledgers`` / ``lengths``: the
    :data:`~verl_traj.core.rollout.session_ledger.VERSION_TOKENS_TAG` / :data:`~verl_traj.core.rollout.session_ledger.LENGTH_TAG` of
    the rows that carry one (a session's last row), in the same order; ``stalest`` / ``first_version``: what the
    staleness bound and the lag cap read of the ledgers (:func:`~verl_traj.core.rollout.staleness.stalest`,
    :func:`~verl_traj.core.rollout.offpolicy.first_version`), learnt once: a poll checks each group in O(1)."""

    keys: tuple = ()
    sessions: int = 0
    ledgers: tuple = ()
    lengths: tuple = ()
    stalest: tuple = (0, 0)
    first_version: Optional[int] = None

    @classmethod
    def of(cls, keys: list[str], rows: Mapping[str, Mapping]) -> "GroupFacts":
        """The facts of a group whose row keys were seen as ``keys`` (those no longer in ``rows`` are skipped: a
        failed session cleared them)."""
        tags = [(key, rows[key]) for key in keys if key in rows]
        ledgers = tuple(tag[VERSION_TOKENS_TAG] for _, tag in tags if VERSION_TOKENS_TAG in tag)
        return cls(keys=tuple(key for key, _ in tags),
                   sessions=len({key.rsplit("_", 1)[0] for key, _ in tags}), ledgers=ledgers,
                   lengths=tuple(tag[LENGTH_TAG] for _, tag in tags if LENGTH_TAG in tag),
                   stalest=stalest(ledgers), first_version=first_version(ledgers))


NO_FACTS = GroupFacts()


@dataclass
class GroupIndex:
    """One partition's groups, kept up to date from verl's synced metadata by :meth:`refresh` (once a poll).

    ``facts``: uid -> :class:`GroupFacts` of every terminal group listed; ``prompt_tags``: uid -> its prompt key's
    tag, for the failed groups whose tag was read (:class:`~verl_traj.integration.async_modes.v1_failures.
    FailedGroupPolicy` fills it); ``pending``: uid -> row keys seen, of groups not yet terminal; ``known``: every
    row key seen (a superset of the partition's: keys cleared since are dropped in bulk, :data:`RECONCILE_SLACK`)."""

    facts: dict = field(default_factory=dict)
    prompt_tags: dict = field(default_factory=dict)
    pending: dict = field(default_factory=dict)
    known: set = field(default_factory=set)

    def refresh(self, rows: Mapping[str, Mapping], terminal: AbstractSet[str], prompts: Collection[str]) -> int:
        """Learn from one poll: ``rows`` (verl's ``partitions[partition_id]``, row key -> tag, in storage order),
        ``terminal`` (the uids whose status is ``finished`` or ``failure``) and ``prompts`` (every listed prompt
        key: the groups the partition holds). Reads the new rows' keys and the rows of the newly terminal groups
        only; forgets the groups no longer listed. Returns the number of new rows."""
        new = self._new_keys(rows)
        for key in new:
            self.pending.setdefault(key.split("_")[0], []).append(key)
        grown = self.facts.keys() & self.pending.keys()  # rows of a terminal group stored after it settled (none
        for uid in grown:  # from verl's worker): read it again, whole
            self.pending[uid] = [*self.facts.pop(uid).keys, *self.pending[uid]]
        for table in (self.facts, self.prompt_tags, self.pending):
            for uid in table.keys() - prompts:
                del table[uid]
        for uid in terminal - self.facts.keys():
            self.facts[uid] = GroupFacts.of(self.pending.pop(uid, []), rows)
        return len(new)

    def _new_keys(self, rows: Mapping[str, Mapping]) -> list[str]:
        """The keys of ``rows`` not seen before, in storage order: its suffix after the last key seen (read
        backwards). When the index holds more than :data:`RECONCILE_SLACK` keys beyond the partition's (cleared
        since), it drops them and also takes any key the suffix missed (a set difference, C-speed; amortised over
        those clearings)."""
        new: list[str] = []
        for key in reversed(rows):  # a plain dict reads backwards from its end
            if key in self.known:
                break
            new.append(key)
        new.reverse()
        self.known.update(new)
        if len(self.known) > len(rows) + RECONCILE_SLACK:
            missed = rows.keys() - self.known  # empty while TransferQueue appends each new key
            self.known.intersection_update(rows.keys())
            if missed:
                self.known.update(missed)
                new.extend(key for key in rows if key in missed)
        return new

    def group(self, uid: str) -> GroupFacts:
        """``uid``'s facts (:data:`NO_FACTS` for a group not terminal at the last refresh, or with no rows)."""
        return self.facts.get(uid, NO_FACTS)

    def lengths(self, uids: Collection[str]) -> dict[str, tuple]:
        """uid -> the ``[tokens, calls]`` of its finished sessions, for ``uids``."""
        return {uid: self.group(uid).lengths for uid in uids}

    def sessions(self, uids: Collection[str]) -> dict[str, int]:
        """uid -> its sessions that stored rows (its finished ones: a failed session clears its rows), for ``uids``."""
        return {uid: self.group(uid).sessions for uid in uids}

    def missing_prompt_tags(self, uids: Collection[str]) -> list[str]:
        """The uids among ``uids`` whose prompt tag was not read yet, sorted."""
        return sorted(set(uids) - self.prompt_tags.keys())

    def tags_of(self, uids: Collection[str]) -> dict[str, dict]:
        """uid -> prompt tag of each of ``uids`` read (:attr:`prompt_tags`)."""
        return {uid: self.prompt_tags[uid] for uid in uids if uid in self.prompt_tags}

