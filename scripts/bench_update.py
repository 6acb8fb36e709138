#!/usr/bin/env python
"""Benchmark one real actor update: verl_traj's workers vs stock verl, same batch, CPU engine.

Each of ``--dp`` processes (torch.multiprocessing spawn, gloo) builds verl's actor engine worker
exactly as ``ActorRolloutRefWorker.init_model`` does (FSDP2 engine on CPU through the verl_traj CPU
platform plugin, the tiny Qwen2 of ``verl_traj.cpu.build_tiny``, ``configs/cpu_tiny.yaml``), then
runs the same synthetic GRPO batch through

* ``stock``: verl's ``_balance_batch`` ordering (Karmarkar-Karp over DP ranks on verl's workload,
  per-rank sort), verl's ``TrainingWorker.train_mini_batch`` (fixed-size mini-batches) and verl's
  ``ppo_loss``;
* ``traj``: verl_traj's plan (whole GRPO groups per mini-batch, per-mini-batch DP balancing,
  padding), ``compute_loss_weights``, ``TrajTrainingWorker.train_mini_batch`` and ``traj_ppo_loss``.

Both use verl's dynamic micro-batching with the same token cap and perform the same number of
optimizer steps. Reported per variant: seconds per update (median of ``--repeats``, after a warm-up),
optimizer steps, and the slowest-rank share: per mini-batch, the largest per-rank share of the
mini-batch's attention workload (verl's ``calculate_workload``: 24576*L + L^2 summed over rows),
averaged over mini-batches (ideal = 1/dp). A mini-batch step lasts as long as its slowest rank.

    python scripts/bench_update.py --dp 2 [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------------------------
# synthetic batch (identical in every process: seeded)
# ------------------------------------------------------------------------------------------------


def make_batch(args, vocab: int):
    import numpy as np
    import torch

    from verl import DataProto

    g = torch.Generator().manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    B = args.groups * args.n
    P, R = args.prompt_len, args.response_len
    attn = torch.zeros(B, P + R, dtype=torch.long)
    resp_mask = torch.zeros(B, R, dtype=torch.long)
    # long-tailed response lengths (multi-turn agents: most short, a few near the budget)
    lens = np.clip(rng.lognormal(mean=np.log(R / 6), sigma=0.9, size=B), 4, R).astype(int)
    for i in range(B):
        lp = int(rng.integers(P // 2, P + 1))
        lr = int(lens[i])
        attn[i, P - lp: P + lr] = 1
        m = torch.ones(lr, dtype=torch.long)
        # observation (tool output) spans without loss inside the response
        for _ in range(int(rng.integers(0, 3))):
            a = int(rng.integers(0, lr))
            m[a: a + int(rng.integers(1, 8))] = 0
        m[0] = 1
        resp_mask[i, :lr] = m
    input_ids = torch.randint(3, vocab, (B, P + R), generator=g) * attn
    adv = torch.randn(B, 1, generator=g).expand(B, R) * resp_mask
    tensors = {
        "input_ids": input_ids,
        "prompts": input_ids[:, :P],
        "responses": input_ids[:, P:],
        "attention_mask": attn,
        "position_ids": torch.clamp(torch.cumsum(attn, -1) - 1, min=0),
        "response_mask": resp_mask,
        "advantages": adv.contiguous(),
        "old_log_probs": (-torch.rand(B, R, generator=g) * 2) * resp_mask,
    }
    uid = np.array([f"g{i // args.n}" for i in range(B)], dtype=object)
    return DataProto.from_dict(tensors=tensors, non_tensors={"uid": uid})


def stock_order(batch, dp: int):
    """verl's RayPPOTrainer._balance_batch (default branch)."""
    import torch

    from verl.utils.seqlen_balancing import calculate_workload, get_seqlen_balanced_partitions

    seqlen = batch.batch["attention_mask"].sum(-1)
    workload = calculate_workload(seqlen)
    parts = get_seqlen_balanced_partitions(workload, k_partitions=dp, equal_size=True)
    for i, part in enumerate(parts):
        part.sort(key=lambda x: (workload[x], x))
        parts[i] = part[::2] + part[1::2][::-1]
    batch.reorder(torch.tensor([j for p in parts for j in p]))


def mini_batch_blocks_stock(batch, dp: int, num_mb: int):
    """(mini-batch, rank) -> rows, as verl's worker slices each rank's shard."""
    B = len(batch)
    per_rank = B // dp
    mb_rows = per_rank // num_mb
    return {(m, r): list(range(r * per_rank + m * mb_rows, r * per_rank + (m + 1) * mb_rows))
            for m in range(num_mb) for r in range(dp)}


def mini_batch_blocks_traj(batch, dp: int):
    B = len(batch)
    per_rank = B // dp
    mb = batch.batch["mini_batch_id"].tolist()
    blocks = {}
    for i in range(B):
        blocks.setdefault((mb[i], i // per_rank), []).append(i)
    return blocks


def micro_batches_per_update(batch, blocks, dp: int, cap: int) -> tuple[int, float]:
    """Micro-batches per rank per update as verl's dynamic micro-batching cuts them (count synced to
    the max over ranks, then raised until every rank's partition fits the cap), and the share of
    padded positions the model computes without remove-padding (each micro-batch is padded to its
    longest row: rows x max length vs real tokens)."""
    from verl.utils.seqlen_balancing import ceildiv, get_seqlen_balanced_partitions

    lens = batch.batch["attention_mask"].sum(-1).tolist()
    total, padded, real = 0, 0, 0
    for m in sorted({m for m, _ in blocks}):
        rank_lens = [[lens[i] for i in blocks.get((m, r), [])] for r in range(dp)]
        k = max(min(len(x), ceildiv(sum(x), cap)) for x in rank_lens)
        while True:
            parts = [get_seqlen_balanced_partitions(x, k, equal_size=False) for x in rank_lens]
            if all(all(sum(x[j] for j in part) <= cap for part in ps) for x, ps in zip(rank_lens, parts)):
                break
            k += 1
        total += k
        for x, ps in zip(rank_lens, parts):
            for part in ps:
                padded += len(part) * max(x[j] for j in part)
                real += sum(x[j] for j in part)
    return total, 1.0 - real / max(padded, 1)


def slowest_rank_share(batch, blocks, dp: int) -> float:
    from verl.utils.seqlen_balancing import calculate_workload

    w = calculate_workload(batch.batch["attention_mask"].sum(-1)).tolist()
    shares = []
    for m in sorted({m for m, _ in blocks}):
        per = [sum(w[i] for i in blocks.get((m, r), [])) for r in range(dp)]
        shares.append(max(per) / max(sum(per), 1))
    return sum(shares) / len(shares)


# ------------------------------------------------------------------------------------------------
# one process
# ------------------------------------------------------------------------------------------------


def _load_config(args):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    overrides = [
        f"actor_rollout_ref.actor.ppo_mini_batch_size={args.groups // args.mini_batches}",
        f"actor_rollout_ref.rollout.n={args.n}",
        f"data.train_batch_size={args.groups}",
        "actor_rollout_ref.actor.use_dynamic_bsz=true",
        f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={args.cap}",
    ]
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base=None):
        cfg = compose(config_name="cpu_tiny", overrides=overrides)
    OmegaConf.resolve(cfg)
    return cfg


def _build_worker(cfg, variant: str):
    from functools import partial

    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import TrainingWorkerConfig
    from verl.workers.engine_workers import TrainingWorker
    from verl.workers.utils.losses import ppo_loss

    from verl_traj.integration.losses import traj_ppo_loss
    from verl_traj.integration.workers import TrajTrainingWorker

    model_config = omega_conf_to_dataclass(cfg.actor_rollout_ref.model)
    actor_config = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    actor_config.model_config = model_config
    twc = TrainingWorkerConfig(
        model_type="language_model",
        model_config=model_config,
        engine_config=actor_config.engine,
        optimizer_config=actor_config.optim,
        checkpoint_config=actor_config.checkpoint,
    )
    twc.engine_config.use_dynamic_bsz = True
    twc.engine_config.max_token_len_per_gpu = cfg.actor_rollout_ref.actor.ppo_max_token_len_per_gpu
    twc.engine_config.infer_max_token_len_per_gpu = cfg.actor_rollout_ref.actor.ppo_max_token_len_per_gpu
    twc.engine_config.use_remove_padding = model_config.get("use_remove_padding", False)
    cls = TrajTrainingWorker if variant == "traj" else TrainingWorker
    worker = cls(config=twc)
    worker.reset()
    worker.set_loss_fn(partial(traj_ppo_loss if variant == "traj" else ppo_loss, config=actor_config))
    return worker


def _prepared_batch(args, variant: str, vocab: int, dp: int):
    from verl_traj.config import TrajConfig
    from verl_traj.core import compute_loss_weights
    from verl_traj.integration.trainer import plan_batch_in_place

    batch = make_batch(args, vocab)
    if variant == "stock":
        stock_order(batch, dp)
        blocks = mini_batch_blocks_stock(batch, dp, args.mini_batches)
        return batch, blocks, 0
    plan = plan_batch_in_place(batch, TrajConfig(group_by="group", micro_batch_max_tokens=args.cap),
                               args.mini_batches, dp)
    import torch

    batch.batch["loss_weight"] = compute_loss_weights(
        "token-mean", batch.batch["response_mask"], batch.batch["mini_batch_id"],
        torch.arange(len(batch)), batch.batch["is_padding"],
    )
    return batch, mini_batch_blocks_traj(batch, dp), int(plan.stats.padding_rows.sum())


def _to_rank_td(batch, args, rank: int, dp: int):
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    td = left_right_2_no_padding(batch.to_tensordict())
    mini = args.groups // args.mini_batches * args.n
    tu.assign_non_tensor(
        td, calculate_entropy=False, global_batch_size=mini, mini_batch_size=mini, epochs=1, seed=0,
        dataloader_kwargs={"shuffle": False}, compute_loss=True, temperature=1.0,
    )
    per = len(batch) // dp
    return tu.index_select_tensor_dict(td, list(range(rank * per, (rank + 1) * per)))


def _proc(rank: int, dp: int, port: int, args, out_path: str):
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(dp), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "VERL_TRAJ_HOME": args.home})
    import torch

    torch.set_num_threads(max(1, args.threads))
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=dp, init_method=f"tcp://127.0.0.1:{port}")
    cfg = _load_config(args)
    results = {}
    for variant in args.variants:
        worker = _build_worker(cfg, variant)
        vocab = int(worker.model_config.hf_config.vocab_size)
        batch, blocks, n_pad = _prepared_batch(args, variant, vocab, dp)
        share = slowest_rank_share(batch, blocks, dp)
        n_micro, pad_waste = micro_batches_per_update(batch, blocks, dp, args.cap)
        times, steps = [], None
        for it in range(args.repeats + 1):
            td = _to_rank_td(batch, args, rank, dp)
            dist.barrier()
            t0 = time.perf_counter()
            out = worker.train_mini_batch(td)
            dist.barrier()
            dt = time.perf_counter() - t0
            if it > 0:  # first = warm-up
                times.append(dt)
            if out is not None:
                grad_norms = out["metrics"].get("grad_norm") if hasattr(out, "keys") else None
                steps = len(grad_norms) if isinstance(grad_norms, list) else steps
        results[variant] = {
            "seconds_per_update": statistics.median(times),
            "seconds_all": times,
            "optimizer_steps": steps,
            "slowest_rank_share": share,
            "ideal_share": 1.0 / dp,
            "rows": len(batch),
            "padding_rows": n_pad,
            "micro_batches_per_rank": n_micro,
            "padded_position_share": pad_waste,
        }
        del worker
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--groups", type=int, default=16, help="prompts (GRPO groups) per batch")
    ap.add_argument("--n", type=int, default=4, help="rollouts per prompt")
    ap.add_argument("--mini-batches", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--response-len", type=int, default=448)
    ap.add_argument("--cap", type=int, default=2048, help="tokens per micro-batch per rank (both variants)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--variants", nargs="+", default=["stock", "traj"], choices=["stock", "traj"])
    ap.add_argument("--home", default=os.environ.get("VERL_TRAJ_HOME", os.path.join(tempfile.gettempdir(), "verl_traj_tiny_bench")))
    ap.add_argument("--json", action="store_true", help="print JSON instead of the table")
    args = ap.parse_args(argv)
    if args.groups % args.mini_batches:
        ap.error("--groups must be a multiple of --mini-batches")

    if not (Path(args.home) / "model").exists():
        from verl_traj.cpu.build_tiny import build

        build(args.home)
    os.environ["VERL_TRAJ_HOME"] = args.home

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "bench.json")
        mp.spawn(_proc, args=(args.dp, _free_port(), args, out), nprocs=args.dp, join=True)
        with open(out) as f:
            results = json.load(f)
    report = {"config": {k: v for k, v in vars(args).items() if k != "json"}, "results": results}
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"actor update, dp={args.dp}, {args.groups} groups x n={args.n}, {args.mini_batches} mini-batches, "
          f"cap {args.cap} tokens/micro-batch, median of {args.repeats}")
    print("| variant | s/update | optimizer steps | rows | padding rows | micro-batches/rank | "
          "padded positions (no rmpad) | slowest-rank share |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['seconds_per_update']:.3f} | {r['optimizer_steps']} | {r['rows']} | {r['padding_rows']} | "
              f"{r['micro_batches_per_rank']} | {r['padded_position_share']:.1%} | {r['slowest_rank_share']:.3f} (ideal {r['ideal_share']:.3f}) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
