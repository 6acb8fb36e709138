#!/usr/bin/env python
"""Benchmark: one v1 replay-buffer poll (verl's ``_sync_metadata_from_transfer_queue``) against the number of sessions.

Each poll reads every key's tag of the partition from TransferQueue, so its cost grows with the batch; verl_traj waits
``max(traj.replay_poll_s, 4 x the poll's own time)`` between polls
(``integration/async_modes/v1_failures.poll_interval``). Real Ray and TransferQueue in this process; one prompt key and
``n`` session keys a prompt, tags as verl's agent-loop workers and verl_traj leave them.

    python scripts/bench_replay_poll.py [--sizes 64x4,256x16,1024x16] [--repeats 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import time

import ray
import transfer_queue as tq
from omegaconf import OmegaConf
from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer

from verl_traj.integration.async_modes.v1_failures import poll_interval


def _fill(prompts: int, n: int, tag: str) -> None:
    for p in range(prompts):
        uid = f"{tag}{p:07d}"
        tq.kv_put(key=uid, partition_id="train", tag={"is_prompt": True, "status": "finished", "global_steps": 3})
        for s in range(n):
            tq.kv_put(key=f"{uid}_{s}_0", partition_id="train",
                      tag={"status": "success", "global_steps": 3, "seq_len": 900, "traj_version_tokens": [[3, 400]]})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="64x4,256x16,1024x16", help="prompts x sessions a prompt, comma-separated")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    tq.init(OmegaConf.create({"backend": {"SimpleStorage": {"num_data_storage_units": 1,
                                                            "total_storage_size": 200000}}}))
    out = []
    for i, size in enumerate(args.sizes.split(",")):
        prompts, n = (int(x) for x in size.split("x"))
        keys = (tq.kv_list(partition_id="train") or {}).get("train", {})
        if keys:
            tq.kv_clear(partition_id="train", keys=list(keys))
        _fill(prompts, n, f"s{i}-")
        buffer = ReplayBuffer(trainer_mode="sync", trainer_config=OmegaConf.create({}), max_off_policy_threshold=None,
                              max_off_policy_strategy="drop", sampler_kwargs=OmegaConf.create({}))
        took = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            buffer._sync_metadata_from_transfer_queue()
            took.append(time.perf_counter() - start)
        out.append({"prompts": prompts, "sessions": prompts * n, "keys": prompts * (n + 1),
                    "poll_ms_min": min(took) * 1e3, "poll_ms_max": max(took) * 1e3,
                    "wait_s_at_0.25": poll_interval(0.25, min(took))})
    tq.close()
    ray.shutdown()
    if args.json:
        print(json.dumps(out, indent=1))
        return
    print("| prompts | sessions | poll (ms, min-max) | wait at traj.replay_poll_s=0.25 (s) |\n|---:|---:|---|---:|")
    for r in out:
        print(f"| {r['prompts']} | {r['sessions']} | {r['poll_ms_min']:.1f}-{r['poll_ms_max']:.1f} | "
              f"{r['wait_s_at_0.25']:.2f} |")


if __name__ == "__main__":
    main()
