"""How many verl_traj modules one planned update passes through on the worker, from ``train_mini_batch`` to the loss
(issue 42, item 5), counted, not estimated: real actor updates on the tiny model (one rank, gloo, CPU), every
Python call traced (``sys.setprofile``).

For each case it prints the verl_traj modules whose code runs during an update (the adapters', and the pure
core's apart), and the verl_traj frames on the stack when the loss is entered (the path a reader follows). Each case
runs two updates in a fresh process: the second is the path every training step takes; what only the first runs
(a process's one-time set-up, such as installing the prefix tree's attention) is listed apart.

    python scripts/worker_hops.py            # the table
    python scripts/worker_hops.py --json     # the same as JSON
    python scripts/worker_hops.py --cases gspo_trees

Cases: rows (``traj.prefix_tree=false``), trees (the default on this preset), GSPO at trajectory scope on rows (its
pre-pass) and on trees.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

import numpy as np

from verl_traj.core.keys import IS_PADDING, RATIO_GROUP
from verl_traj.cpu.attention import CPU_VARLEN
from verl_traj.cpu.build_tiny import build
from verl_traj.testing import as_dataproto, rl_batch
from verl_traj.testing.engine import actor_worker, cpu_config, free_port, init_rank, plan_for_update, rank_tensordict

ADAPTERS = "verl_traj.integration."
CORE = ("verl_traj.core.", "verl_traj.stepwise.")
GSPO = ("actor_rollout_ref.actor.policy_loss.loss_mode=gspo", "actor_rollout_ref.actor.ppo_epochs=1")
CASES = {"rows": ((), False, False), "trees": ((), True, False),
         "gspo_rows": (GSPO, False, True), "gspo_trees": (GSPO, True, True)}


def _chain(frame) -> list[str]:
    """The verl_traj modules on the stack below ``frame``, outermost first, each once (where it first appears)."""
    stack = []
    while frame is not None:
        stack.append(frame.f_globals.get("__name__", ""))
        frame = frame.f_back
    out: list[str] = []
    for name in reversed(stack):
        if name.startswith("verl_traj.") and name not in out:
            out.append(name)
    return out


def _trace(run) -> tuple[list[str], list[str], list[str]]:
    """verl_traj modules that ran during ``run()``, in first-call order; the chain of verl_traj modules on the stack
    at the loss's first call; the longest such chain at any call (the most modules a reader follows at once)."""
    ran: dict[str, None] = {}
    at_loss: list[str] = []
    longest: list[str] = []

    def profile(frame, event, _arg):
        nonlocal longest
        if event != "call" or not frame.f_globals.get("__name__", "").startswith("verl_traj."):
            return
        ran.setdefault(frame.f_globals["__name__"], None)
        chain = _chain(frame)
        if frame.f_code.co_name == "traj_ppo_loss" and not at_loss:
            at_loss.extend(chain)
        if len([m for m in chain if m.startswith(ADAPTERS)]) > len([m for m in longest if m.startswith(ADAPTERS)]):
            longest = chain

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return list(ran), at_loss, longest


def _batch(vocab: int, ratio_groups: bool) -> Any:
    """Eight GRPO groups of 3 long-tailed multi-turn rows (the engine tests' batch); with ``ratio_groups`` each group
    is one GSPO trajectory (its rows share a sequence ratio)."""
    batch = as_dataproto(*rl_batch(8, 3, prompt_len=24, response_len=12, seed=3, long_tail=True, obs_spans=2,
                                   vocab=vocab))
    return batch


def _ratio_groups(batch: Any) -> None:
    group = torch.as_tensor(np.unique(batch.non_tensor_batch["uid"].astype(str), return_inverse=True)[1].reshape(-1))
    batch.batch[RATIO_GROUP] = torch.where(batch.batch[IS_PADDING], -1, group)


def measure(name: str, extra: tuple, trees: bool, ratio_groups: bool) -> dict[str, Any]:
    cfg = cpu_config(["actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.rollout.n=3",
                      "data.train_batch_size=8", "actor_rollout_ref.actor.use_dynamic_bsz=true",
                      "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=4096", "actor_rollout_ref.model.use_remove_padding=true",
                      f"actor_rollout_ref.model.override_config.attn_implementation={CPU_VARLEN}", *extra])
    worker = actor_worker(cfg, True)
    batch = _batch(int(worker.model_config.hf_config.vocab_size), ratio_groups)
    plan_for_update(batch, cfg, 1, ratio_groups=ratio_groups, prefix_tree=trees)
    if ratio_groups:
        _ratio_groups(batch)
    first = _trace(lambda: worker.train_mini_batch(rank_tensordict(batch, 0, 1, len(batch) // 2)))[0]
    ran, at_loss, longest = _trace(lambda: worker.train_mini_batch(rank_tensordict(batch, 0, 1, len(batch) // 2)))
    return {"case": name, "adapter_modules": [m for m in ran if m.startswith(ADAPTERS)],
            "core_modules": [m for m in ran if m.startswith(CORE)], "stack_at_loss": at_loss,
            "longest_chain": [m for m in longest if m.startswith(ADAPTERS)],
            "first_update_only": [m for m in first if m.startswith(ADAPTERS) and m not in ran]}


def _one(name: str, home: str, queue: Any) -> None:
    init_rank(0, 1, free_port(), home)
    torch.manual_seed(0)
    queue.put(measure(name, *CASES[name]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES), help="the cases to run")
    args = parser.parse_args()
    home = os.environ.get("VERL_TRAJ_HOME") or tempfile.mkdtemp()
    build(str(Path(home) / "tiny"))  # the tiny model the presets read (kept where already built)
    ctx = mp.get_context("spawn")
    rows = []
    for name in args.cases:  # a fresh process each: the process-lifetime patches of one case do not reach the next
        queue = ctx.Queue()
        proc = ctx.Process(target=_one, args=(name, home, queue))
        proc.start()
        rows.append(queue.get())
        proc.join()
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(f"{'case':<11} {'ran':>4} {'chain':>5}  adapter modules that ran (longest chain of them on the stack)"
          "  [+ a process's first update only]")
    for r in rows:
        short = [m.removeprefix(ADAPTERS) for m in r["adapter_modules"]]
        chain = " -> ".join(m.removeprefix(ADAPTERS) for m in r["longest_chain"])
        once = ", ".join(m.removeprefix(ADAPTERS) for m in r["first_update_only"])
        print(f"{r['case']:<11} {len(short):>4} {len(r['longest_chain']):>5}  {', '.join(short)}  ({chain})"
              + (f"  [+ {once}]" if once else ""))


if __name__ == "__main__":
    main()
