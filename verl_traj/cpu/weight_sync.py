"""Weight sync over gloo: verl's checkpoint-engine backend ``gloo`` for a rollout pool apart from the trainer on CPUs.

verl's ``separate_async`` trainer keeps a standalone rollout pool and, after every ``parameter_sync_step`` local
updates, sends the actor's weights there through a :class:`~verl.checkpoint_engine.CheckpointEngine` (verl ships
NCCL / HCCL / NIXL / Mooncake / Kimi / delta backends, all for accelerators; ``naive`` serves only colocated rollout).
This one does what the NCCL backend does, with ``torch.distributed``'s gloo on CPU tensors:

* ``prepare``: actor rank 0 (the master) picks a free port on its node for a ``TCPStore``;
* ``build_topology``: actor rank 0 sends (group rank 0), the other actor ranks sit out (rank ``-1``: they still
  walk the weight generator, whose every item is an FSDP all-gather over the actor group), rollout workers receive
  (group ranks ``1..``);
* ``init_process_group``: one ``ProcessGroupGloo`` over a ``TCPStore`` at the master's address, built for this sync
  (verl's manager rebuilds the topology every sync) and dropped in ``finalize``;
* ``send_weights`` / ``receive_weights``: verl's own chunking (:func:`~verl.checkpoint_engine.base.split_weight_chunks`
  / ``merge_weight_chunks``) into buckets of ``update_weights_bucket_megabytes``, each chunk at an aligned offset;
  per bucket, one broadcast of its metadata (pickled) and one of its bytes. The receiver yields ``(name, tensor)``
  pairs, each in a bucket of its own (never overwritten), to the rollout's server adapter.

Registered as ``gloo`` in verl's ``CheckpointEngineRegistry`` when this module is imported: the CPU platform names it
in ``actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module``, which verl's workers and manager import
before they look the backend up. Tested by ``tests/integration/test_weight_sync.py`` (gloo, four processes: two
actor ranks, two rollout workers, two syncs).
"""

from __future__ import annotations

import datetime
import logging
import os
import pickle
import time
from dataclasses import dataclass
from typing import Any, AsyncGenerator, Generator, Optional

import ray
import torch
import torch.distributed as dist

from verl.checkpoint_engine.base import (CheckpointEngine, CheckpointEngineRegistry, TensorMeta, merge_weight_chunks,
                                         split_weight_chunks)
from verl.utils.net_utils import get_free_port

logger = logging.getLogger(__name__)
logger.setLevel(os.getenv("VERL_LOGGING_LEVEL", "WARN"))

__all__ = ["ALIGN", "GlooCheckpointEngine", "MasterAddress"]

ALIGN = 64  # bytes: every chunk starts at a multiple (a view as any dtype needs its element size)


@dataclass(frozen=True)
class MasterAddress:
    """Where the sync's ``TCPStore`` listens (actor rank 0's node)."""

    host: str
    port: int


def _broadcast_object(group: Any, obj: Any, rank: int) -> Any:
    """``obj`` from group rank 0 to every rank (a length, then the pickled bytes)."""
    payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8) if rank == 0 else None
    length = torch.tensor([payload.numel() if rank == 0 else 0], dtype=torch.int64)
    group.broadcast(length, 0).wait()
    if rank != 0:
        payload = torch.empty(int(length.item()), dtype=torch.uint8)
    group.broadcast(payload, 0).wait()
    return obj if rank == 0 else pickle.loads(payload.numpy().tobytes())


@CheckpointEngineRegistry.register("gloo")
class GlooCheckpointEngine(CheckpointEngine):
    """verl's checkpoint engine on ``torch.distributed`` gloo (CPU tensors): actor rank 0 broadcasts buckets of the
    weights to every rollout worker.

    Args:
        bucket_size: bytes per broadcast bucket (verl: ``update_weights_bucket_megabytes << 20``).
        is_master: actor rank 0 (verl's actor worker passes it; rollout workers do not).
        timeout_seconds: how long a broadcast waits for its peers before gloo raises.
    """

    def __init__(self, bucket_size: int, is_master: bool = False, timeout_seconds: float = 600.0) -> None:
        self.bucket_size = int(bucket_size)
        self.is_master = bool(is_master)
        self.timeout = datetime.timedelta(seconds=float(timeout_seconds))
        self.rank: Optional[int] = None
        self.world_size: Optional[int] = None
        self._store: Any = None
        self._group: Any = None
        self._address: Optional[MasterAddress] = None

    def prepare(self) -> dict[str, Any]:
        if not self.is_master:
            return {"master": None}
        host = ray.util.get_node_ip_address().strip("[]")
        port, _ = get_free_port(host)
        self._address = MasterAddress(host=host, port=int(port))
        return {"master": self._address}

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int,
                       metadata: list[dict]) -> tuple[dict[str, list], dict[str, list]]:
        master = metadata[0].get("master")
        if master is None:
            raise RuntimeError("gloo weight sync: actor rank 0 is not the checkpoint-engine master (verl's actor "
                               "worker builds it with is_master=(rank == 0)); the topology has no sender.")
        world = 1 + rollout_world_size
        actor = {"rank": [0] + [-1] * (actor_wg_world_size - 1), "world_size": [world] * actor_wg_world_size,
                 "master": [master] * actor_wg_world_size}
        rollout = {"rank": list(range(1, world)), "world_size": [world] * rollout_world_size,
                   "master": [master] * rollout_world_size}
        return actor, rollout

    def init_process_group(self, rank: int, world_size: int, master: MasterAddress) -> None:
        self.rank, self.world_size = int(rank), int(world_size)
        if self.rank < 0:
            return
        self._store = dist.TCPStore(master.host, master.port, world_size, is_master=self.rank == 0,
                                    timeout=self.timeout, wait_for_workers=False)
        self._group = dist.ProcessGroupGloo(dist.PrefixStore("verl_traj_weight_sync", self._store), self.rank,
                                            world_size, self.timeout)
        self._group.barrier().wait()

    def finalize(self) -> None:
        self._group, self._store, self._address = None, None, None
        self.rank, self.world_size = None, None

    @torch.no_grad()
    async def send_weights(self, weights: Generator[tuple[str, torch.Tensor], None, None],
                           global_steps: Optional[int] = None) -> dict:
        if self.rank is None:
            raise RuntimeError("gloo weight sync: send_weights before init_process_group")
        if self.rank < 0:  # not a sender: the generator is collective over the actor group
            for _ in weights:
                pass
            return {}
        if self.rank != 0:
            raise RuntimeError(f"gloo weight sync: group rank {self.rank} asked to send; only rank 0 sends")
        start, sent, buckets = time.perf_counter(), 0, 0
        bucket, metas, offset = torch.empty(self.bucket_size, dtype=torch.uint8), [], 0
        async for meta, chunk in split_weight_chunks(weights, self.bucket_size):
            offset = -(-offset // ALIGN) * ALIGN  # the receiver views each chunk as its dtype: aligned offsets
            if offset + meta.chunk_size > self.bucket_size:
                self._broadcast_bucket(bucket[:offset], metas, last=False)
                sent, buckets, metas, offset = sent + offset, buckets + 1, [], 0
            meta.offset = offset
            metas.append(meta)
            bucket[offset:offset + meta.chunk_size] = chunk.detach().to("cpu").view(torch.uint8)
            offset += meta.chunk_size
        self._broadcast_bucket(bucket[:offset], metas, last=True)
        seconds = time.perf_counter() - start
        return {"weight_sync/gloo_megabytes": (sent + offset) / 2**20, "weight_sync/gloo_buckets": buckets + 1,
                "weight_sync/gloo_seconds": seconds}

    def _broadcast_bucket(self, payload: torch.Tensor, metas: list[TensorMeta], last: bool) -> None:
        _broadcast_object(self._group, {"metas": metas, "length": payload.numel(), "last": last}, 0)
        self._group.broadcast(payload.contiguous(), 0).wait()

    @torch.no_grad()
    async def receive_weights(self, global_steps: Optional[int] = None
                              ) -> AsyncGenerator[tuple[str, torch.Tensor], None]:
        if self.rank is None or self.rank < 1:
            raise RuntimeError(f"gloo weight sync: receive_weights on group rank {self.rank}; receivers are 1..")
        async for name, tensor in merge_weight_chunks(self._chunks(), self.bucket_size):
            yield name, tensor

    async def _chunks(self) -> AsyncGenerator[tuple[TensorMeta, torch.Tensor], None]:
        while True:
            header = _broadcast_object(self._group, None, self.rank)
            bucket = torch.empty(int(header["length"]), dtype=torch.uint8)  # fresh: yielded views stay valid
            self._group.broadcast(bucket, 0).wait()
            for meta in header["metas"]:
                yield meta, bucket[meta.offset:meta.offset + meta.chunk_size]
            if header["last"]:
                return
