"""The gloo checkpoint engine (``verl_traj.cpu.weight_sync``, verl's backend ``gloo``): real processes, real gloo.

Four processes as verl's ``CheckpointEngineManager`` arranges them for ``separate_async``: two actor ranks (rank 0
sends; rank 1 sits out but walks its weight generator) and two rollout workers that receive. Every weight arrives
bit-exact, in order, whatever its dtype or size (tensors larger than a bucket are chunked and merged); a second sync
rebuilds the group on a fresh port, as verl's manager does every sync.
"""

from __future__ import annotations

import asyncio
import pickle

import pytest
import torch
import torch.multiprocessing as mp

pytestmark = pytest.mark.dist

BUCKET = 1024  # bytes: most weights below span several buckets


def _weights(version: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(version)
    return {
        "embed.weight": torch.randn(40, 16, generator=g),  # 2,560 bytes: chunked over 3 buckets
        "layer.0.bias": torch.randn(7, generator=g),
        "layer.0.scale": torch.randn(3, 5, generator=g).to(torch.bfloat16),
        "step": torch.tensor([version], dtype=torch.int64),
        "big": torch.arange(1000, dtype=torch.float32) * version,  # 4,000 bytes
    }


def _proc(index: int, roles: list, topologies: list, out_dir: str) -> None:
    from verl_traj.cpu.weight_sync import GlooCheckpointEngine

    role = roles[index]
    engine = GlooCheckpointEngine(bucket_size=BUCKET, is_master=index == 0, timeout_seconds=60)
    received = []
    for version, topology in enumerate(topologies, start=1):
        engine.init_process_group(**topology[index])
        if role == "actor":
            metrics = asyncio.run(engine.send_weights(iter(_weights(version).items()), global_steps=version))
            received.append(metrics)
        else:
            async def collect():
                return [(name, tensor.clone()) async for name, tensor in engine.receive_weights(global_steps=version)]

            received.append(asyncio.run(collect()))
        engine.finalize()
    with open(f"{out_dir}/{index}.pkl", "wb") as f:
        pickle.dump(received, f)


def _topology(actors: int, receivers: int) -> list[dict]:
    from verl_traj.cpu.weight_sync import GlooCheckpointEngine

    metadata = [GlooCheckpointEngine(BUCKET, is_master=True).prepare()] + [{"master": None}] * (actors - 1)
    actor_kwargs, rollout_kwargs = GlooCheckpointEngine.build_topology(actors, receivers, metadata)
    columns = [{k: v[i] for k, v in actor_kwargs.items()} for i in range(actors)]
    return columns + [{k: v[i] for k, v in rollout_kwargs.items()} for i in range(receivers)]


def test_gloo_weight_sync_delivers_every_weight_bit_exact_twice(tmp_path):
    roles = ["actor", "actor", "rollout", "rollout"]
    topologies = [_topology(2, 2), _topology(2, 2)]  # two syncs, each its own port and group
    assert [t["rank"] for t in topologies[0]] == [0, -1, 1, 2]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_proc, args=(i, roles, topologies, str(tmp_path))) for i in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0, 0, 0]
    results = [pickle.loads((tmp_path / f"{i}.pkl").read_bytes()) for i in range(4)]
    for version in (1, 2):
        sent = _weights(version)
        metrics = results[0][version - 1]
        assert metrics["weight_sync/gloo_buckets"] > len(sent)  # the chunking was exercised
        assert results[1][version - 1] == {}  # the sitting-out actor rank sends nothing
        for receiver in (2, 3):
            got = results[receiver][version - 1]
            assert [name for name, _ in got] == list(sent)
            for name, tensor in got:
                assert tensor.dtype == sent[name].dtype and torch.equal(tensor, sent[name]), name


def test_topology_without_a_master_is_refused():
    from verl_traj.cpu.weight_sync import GlooCheckpointEngine

    with pytest.raises(RuntimeError, match="no sender"):
        GlooCheckpointEngine.build_topology(2, 1, [{"master": None}] * 3)
