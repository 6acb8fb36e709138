"""verl's real FSDP2 engine worker on CPU (gloo): a planned update through ``TrajTrainingWorker`` +
``traj_ppo_loss`` runs exactly one optimizer step per mini-batch, and the per-mini-batch gradient
norms at dp=2 (padding rows, a small token cap -> several micro-batches) equal those at dp=1 with
one micro-batch per mini-batch. Without ``mini_batch_id`` the worker is verl's."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import sys
from argparse import Namespace
from pathlib import Path

import pytest
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.dist


def _bench():
    spec = importlib.util.spec_from_file_location("bench_update", REPO / "scripts" / "bench_update.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_update"] = mod
    spec.loader.exec_module(mod)
    return mod


ARGS = dict(groups=6, n=3, mini_batches=2, prompt_len=32, response_len=96, seed=3, threads=1)


def _proc(rank, world, port, home, cap, out_path, planned):
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "VERL_TRAJ_HOME": home})
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}")
    try:
        b = _bench()
        args = Namespace(**ARGS, cap=cap, home=home)
        cfg = b._load_config(args)
        variant = "traj" if planned else "stock"
        worker = b._build_worker(cfg, variant)
        vocab = int(worker.model_config.hf_config.vocab_size)
        batch, _blocks, n_pad = b._prepared_batch(args, variant, vocab, world)
        td = b._to_rank_td(batch, args, rank, world)
        out = worker.train_mini_batch(td)
        if rank == 0:
            from verl.utils import tensordict_utils as tu

            metrics = tu.get(out, "metrics")
            grad_norm = metrics["grad_norm"]
            res = {"grad_norm": [float(x) for x in grad_norm], "padding_rows": n_pad,
                   "num_optimizer_steps": metrics.get("num_optimizer_steps"), "rows": len(batch)}
            with open(out_path, "w") as f:
                json.dump(res, f)
    finally:
        dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tiny_home(tmp_path_factory):
    home = os.environ.get("VERL_TRAJ_HOME")
    if home and (Path(home) / "model").exists():
        return home
    from verl_traj.cpu.build_tiny import build

    return str(build(str(tmp_path_factory.mktemp("tiny"))))


def _run(home, world, cap, planned, tmp_path):
    out = str(tmp_path / f"w{world}_{cap}_{planned}.json")
    mp.spawn(_proc, args=(world, _free_port(), home, cap, out, planned), nprocs=world, join=True)
    with open(out) as f:
        return json.load(f)


def test_real_engine_update_dp2_capped_equals_dp1(tiny_home, tmp_path):
    ref = _run(tiny_home, 1, 4096, True, tmp_path)
    got = _run(tiny_home, 2, 140, True, tmp_path)
    # 6 groups x 3 rows, 2 mini-batches of 3 groups = 9 rows each -> 1 padding row each at dp=2
    assert got["padding_rows"] == 2 and ref["padding_rows"] == 0
    assert ref["num_optimizer_steps"] == [2] and got["num_optimizer_steps"] == [2]
    assert len(ref["grad_norm"]) == len(got["grad_norm"]) == 2
    for a, b in zip(ref["grad_norm"], got["grad_norm"]):
        assert b == pytest.approx(a, rel=1e-4), (ref, got)


def test_real_engine_stock_path_without_mini_batch_id(tiny_home, tmp_path):
    res = _run(tiny_home, 1, 4096, False, tmp_path)
    assert len(res["grad_norm"]) == 2 and res["num_optimizer_steps"] is None
