#!/usr/bin/env python
"""Benchmark one real actor update: verl_traj's planned update vs stock verl, same rows, same process.

Each of ``--dp`` processes (torch.multiprocessing spawn, gloo) builds verl's actor engine worker as
``ActorRolloutRefWorker.init_model`` does (FSDP2 on CPU through the verl_traj CPU plugin, the tiny Qwen2 of
``verl_traj.cpu.build_tiny``, ``configs/cpu_tiny.yaml``: sdpa, no remove-padding) and runs the same batch
through

* ``stock``: the row order of the v1 trainer's ``_balance_batch`` (verl 0.9.1's default trainer: Karmarkar-Karp
  over ranks, each rank's rows in batch order), verl's ``TrainingWorker.train_mini_batch`` (fixed-size
  mini-batch slices), verl's dynamic micro-batching (``rearrange_micro_batches`` under the cap), verl's
  ``ppo_loss`` (token-mean);
* ``stock_v0``: the same with the v0 trainer's order (``RayPPOTrainer._balance_batch`` also sorts each rank's
  rows by length and interleaves them, so the fixed-size slices are length-sorted mini-batches: the first and
  last hold the shortest rows of the batch);
* ``traj``: the verl_traj plan (whole GRPO groups per mini-batch, DP balancing, padding, micro-batches packed
  for the attention path: here, without remove-padding, the token cap as verl reads it and the least padded
  area at that count), ``TrajTrainingWorker`` running exactly the planned micro-batches, ``traj_ppo_loss``;
* ``traj_area``: the same with ``traj.padded_cap=area`` (the cap bounds each micro-batch's padded area).

With ``--remove-padding`` (verl's remove-padding path, the GPU users' mode: flash-attn varlen there, here
transformers' sdpa on the packed layout) a micro-batch costs its token sum: the plan packs the fewest micro-batches
under the cap (``traj_area`` and the pass costs, which weigh padded positions, do not apply and are left out), and
verl cuts its own dynamic micro-batches the same way; padded positions are then none but the padding rows' tokens.

All do the same number of optimizer steps under the same per-micro-batch cap. The variants alternate
after one warm-up each, each repeat starting one variant later (stock, stock_v0, traj, traj_area; then
stock_v0, traj, traj_area, stock; ...); the table shows medians and the ratio
to ``stock`` and to ``stock_v0`` (the median of the per-repeat ratios).

Cases (``--cases``): ``default`` (16 prompts x 4, long-tailed responses up to 448 tokens with masked tool
spans), ``swebench`` (step rows of SWE-bench trajectories, lengths scaled by 1/32 to fit a CPU, GRPO groups
= repositories), ``small_cap`` (the default batch under a cap that forces several micro-batches per rank),
``shared_prompt`` (GRPO groups of 8 behind one 1024-token prompt), ``gspo`` (GSPO, ``loss_mode=gspo``, over unmerged
step rows: 4 groups x 4 trajectories x 4 turns behind a 512-token prompt; with ``--remove-padding`` every verl_traj
variant also runs at ``traj.ratio_scope=trajectory``, each row's sequence ratio taken over its whole trajectory: on
rows through GSPO's no-grad pre-pass, on trees from the loss where every trajectory is atomic; the table's last line
gives each one's time over the same variant at row scope).

Columns: s/update; optimizer steps; micro-batches per rank per update: planned, run by the workers (the
worker's own count), and what verl's ``rearrange_micro_batches`` would cut for the same rows; padded
positions (without remove-padding every micro-batch is padded to its longest row: the share of computed
positions that are padding); padding rows.

On a CUDA GPU (``--device cuda``, ``scripts/gpu_update_ab.sh``): nccl, one GPU per rank, verl's own GPU settings
(``gpu_config``: bf16 mixed precision, gradient checkpointing), the model of ``--model``. The rows' attention is
``--rows-attention`` (flash-attn is not needed: e.g. transformers' ``flex_attention`` or ``sdpa``, which mask packed
sequences by their position ids); with ``--tree`` the tree variants use ``torch_varlen`` (the flash-attention path,
where the tree's compiled flex attention sits) and the rows variants keep ``--rows-attention``.

    python scripts/bench_update.py --dp 2 [--cases default swebench small_cap] [--remove-padding] [--json]
    python scripts/bench_update.py --device cuda --dp 1 --model DIR --remove-padding --tree \
        --rows-attention flex_attention --cases shared_prompt gspo --variants traj traj_tree --json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

CASES = {
    "default": dict(groups=16, n=4, mini_batches=4, prompt_len=64, response_len=448, cap=2048, source="synthetic"),
    "swebench": dict(groups=8, n=4, mini_batches=2, prompt_len=512, response_len=64, cap=4096, source="swebench"),
    "small_cap": dict(groups=16, n=4, mini_batches=4, prompt_len=64, response_len=448, cap=640, source="synthetic"),
    "shared_prompt": dict(groups=8, n=8, mini_batches=2, prompt_len=1024, response_len=128, cap=8192,
                          source="shared_prompt"),
    # GSPO over unmerged step rows: 4 groups x 4 trajectories x 4 turns behind a 512-token shared prompt, each
    # turn's row repeating the trajectory so far (64-token turns, 64-token tool results)
    "gspo": dict(groups=4, n=4, steps=4, mini_batches=2, shared_len=512, turn_len=64, obs_len=64, cap=4096,
                 source="step_rows", loss_mode="gspo"),
    # the break-even sweep (scripts/bench_tree_break_even.py): GRPO 8 x 8, each group's samples sharing the first
    # `share` of their group's prompt (up to 512 tokens), the rest of every prompt distinct; `low_share`: every prompt
    # distinct behind one 32-token system prompt (a chat agent's tasks, little to share)
    **{f"share_{p}": dict(groups=8, n=8, mini_batches=2, prompt_len=512, response_len=128, cap=4096,
                          source="partial_share", share=p / 100, system=0) for p in (0, 25, 50, 75, 100)},
    "low_share": dict(groups=8, n=8, mini_batches=2, prompt_len=512, response_len=128, cap=4096,
                      source="partial_share", share=0.0, system=32),
    # sessions that branch (scripts/bench_branching.py): SWE-bench call lengths / scale, one layout each
    # (verl's stock order needs a row count divisible by dp, which step rows need not have: no stock variant)
    **{f"branching_{layout}": dict(groups=16, n=4, mini_batches=2, scale=32, cap=8192, source="branching",
                                   layout=layout, stock=False) for layout in ("tree", "paths", "chain")},
}


def _step_row_lengths(case: dict) -> tuple[int, int]:
    """``(prompt_len, response_len)`` of the step-row case's layout: the longest context, the longest turn."""
    return case["shared_len"] + (case["steps"] - 1) * (case["turn_len"] + case["obs_len"]), case["turn_len"]


def step_rows(case: dict, seed: int, vocab: int):
    """Unmerged step rows as an agent loop records them: per GRPO group one shared prompt, per trajectory turns
    ``r_k`` and tool results ``o_k``; the row of turn ``j`` has the context ``prompt r_0 o_0 .. r_(j-1) o_(j-1)`` as
    its prompt and ``r_j`` as its response (every token a loss token), ``traj_id`` / ``step_index`` attached. So a
    trajectory's rows are nested prefixes and a group's rows share its prompt: a tree per group, where linear
    merging would leave these rows as they are (the rollouts of one trajectory are its turns)."""
    import numpy as np
    import torch

    from verl_traj.testing import rl_batch

    G, n, S = case["groups"], case["n"], case["steps"]
    P, R = _step_row_lengths(case)
    tensors, nt = rl_batch(G, n * S, prompt_len=P, response_len=R, seed=seed, steps_per_traj=S, vocab=vocab)
    rng = np.random.default_rng(seed)
    ids, attn = torch.zeros_like(tensors["input_ids"]), torch.zeros_like(tensors["attention_mask"])
    for g in range(G):
        shared = torch.as_tensor(rng.integers(3, vocab, case["shared_len"]))
        for t in range(n):
            context = shared
            for j in range(S):
                row = (g * n + t) * S + j
                turn = torch.as_tensor(rng.integers(3, vocab, int(rng.integers(case["turn_len"] // 2, R + 1))))
                ids[row, P - len(context):P], ids[row, P:P + len(turn)] = context, turn
                attn[row, P - len(context):P + len(turn)] = 1
                obs = torch.as_tensor(rng.integers(3, vocab, int(rng.integers(case["obs_len"] // 2, case["obs_len"] + 1))))
                context = torch.cat([context, turn, obs])
    tensors.update(input_ids=ids, attention_mask=attn, prompts=ids[:, :P].clone(), responses=ids[:, P:].clone(),
                   response_mask=attn[:, P:].clone(), position_ids=torch.clamp(torch.cumsum(attn, -1) - 1, min=0))
    g = torch.Generator().manual_seed(seed)
    mask, traj = tensors["response_mask"], torch.arange(ids.shape[0]) // S  # GRPO over trajectories: one advantage each
    tensors["old_log_probs"] = -torch.rand(mask.shape, generator=g) * 2 * mask
    tensors["advantages"] = (torch.randn(G * n, generator=g)[traj][:, None] * mask).contiguous()
    return tensors, nt


def swebench_rows(groups: int, n: int, prompt_len: int, response_len: int, seed: int, multiple: int):
    """Step rows of ``groups`` repositories x ``n`` trajectories (their first 1-3 steps), lengths / 32; the row
    count is trimmed to a multiple of ``multiple`` (dp x mini-batches: stock verl slices fixed-size
    mini-batches and asserts divisibility) by dropping later steps."""
    import numpy as np
    import torch

    from verl_traj.testing import rl_batch
    from verl_traj.testing.swebench import load_trajectories

    by_repo: dict[str, list] = {}
    for t in load_trajectories():
        by_repo.setdefault(t["id"].split("__")[0], []).append(t)
    repos = [r for r, ts in sorted(by_repo.items()) if len(ts) >= n][:groups]
    rng = np.random.default_rng(seed)
    steps = [(g, k, j, s) for g, r in enumerate(repos) for k, t in enumerate(by_repo[r][:n])
             for j, s in enumerate(t["steps"][: int(rng.integers(1, 4))])]
    later = [i for i, st in enumerate(steps) if st[2] > 0]
    drop = set(later[len(later) - len(steps) % multiple:]) if len(steps) % multiple else set()
    steps = [(g, k, s) for i, (g, k, _, s) in enumerate(steps) if i not in drop]
    tensors, nt = rl_batch(len(steps), 1, prompt_len=prompt_len, response_len=response_len, seed=seed, obs_spans=2)
    P, R = prompt_len, response_len
    lp = torch.tensor([min(max(s[2][0] // 32, 4), P) for s in steps])
    lr = torch.tensor([min(max(s[2][1] // 32, 4), R) for s in steps])
    cols_p, cols_r = torch.arange(P), torch.arange(R)
    pmask = (cols_p[None] >= (P - lp)[:, None]).long()
    rmask = (cols_r[None] < lr[:, None]).long()
    tensors["attention_mask"] = torch.cat([pmask, rmask], 1)
    tensors["response_mask"] = tensors["response_mask"] * rmask
    tensors["position_ids"] = torch.clamp(torch.cumsum(tensors["attention_mask"], -1) - 1, min=0)
    nt["uid"] = np.array([f"repo{g}" for g, _, _ in steps], dtype=object)
    return tensors, nt


def make_batch(case: dict, vocab: int, seed: int, dp: int):
    from verl_traj.testing import as_dataproto, rl_batch

    if case["source"] == "swebench":
        return as_dataproto(*swebench_rows(case["groups"], case["n"], case["prompt_len"], case["response_len"], seed,
                                           dp * case["mini_batches"]))
    if case["source"] == "step_rows":
        return as_dataproto(*step_rows(case, seed, vocab))
    if case["source"] == "branching":
        from verl_traj.testing.branching import layout_rows

        return as_dataproto(*layout_rows(case["layout"], case["groups"], case["n"], seed, vocab, case["scale"]))
    tensors, non_tensors = rl_batch(case["groups"], case["n"], prompt_len=case["prompt_len"],
                                    response_len=case["response_len"], seed=seed, long_tail=True, obs_spans=2,
                                    vocab=vocab)
    if case["source"] == "shared_prompt":  # GRPO as agents have it: a group's n samples behind one long prompt
        share_group_prompts(tensors, case["n"], case["prompt_len"])
    if case["source"] == "partial_share":
        share_group_prompts(tensors, case["n"], case["prompt_len"])
        redraw_prompt_tails(tensors, case["prompt_len"], case["share"], case["system"], vocab, seed)
    return as_dataproto(tensors, non_tensors)


def redraw_prompt_tails(tensors: dict, prompt_len: int, share: float, system: int, vocab: int, seed: int) -> None:
    """In place, after :func:`share_group_prompts`: each row keeps the first ``share`` of its group's prompt tokens
    (real tokens, ``[B]`` left-padded prompts) and gets the rest drawn anew, so a group's rows share exactly that
    prefix; with ``system > 0`` every row's first ``system`` prompt tokens are then one system prompt for the whole
    batch. ``responses`` are untouched; ``prompts`` follows ``input_ids``."""
    import torch

    g = torch.Generator().manual_seed(seed + 1)
    ids, mask = tensors["input_ids"], tensors["attention_mask"][:, :prompt_len]
    real = mask.sum(-1, keepdim=True)
    at = torch.arange(prompt_len)[None, :] - (prompt_len - real)  # position within the real prompt (<0: padding)
    fresh = torch.randint(3, vocab, (ids.shape[0], prompt_len), generator=g)
    redraw = at >= torch.round(share * real)
    ids[:, :prompt_len] = torch.where(redraw, fresh, ids[:, :prompt_len]) * mask
    if system:
        system_ids = torch.randint(3, vocab, (system,), generator=g)
        inside = (at >= 0) & (at < system)
        ids[:, :prompt_len] = torch.where(inside, system_ids[at.clamp(0, system - 1)], ids[:, :prompt_len])
    tensors["prompts"] = ids[:, :prompt_len].clone()


def share_group_prompts(tensors: dict, n: int, prompt_len: int) -> None:
    """Every row gets its group's first row's prompt (ids and mask), in place; positions recomputed."""
    import torch

    first = (torch.arange(tensors["input_ids"].shape[0]) // n) * n
    for key in ("input_ids", "attention_mask"):
        tensors[key][:, :prompt_len] = tensors[key][first, :prompt_len]
    tensors["prompts"] = tensors["input_ids"][:, :prompt_len].clone()
    tensors["position_ids"] = torch.clamp(torch.cumsum(tensors["attention_mask"], -1) - 1, min=0)


def stock_order(batch, dp: int, trainer: str) -> None:
    """verl's ``_balance_batch``: KK over ranks (partitions in batch order, as the v1 trainer leaves them);
    ``trainer="v0"`` (RayPPOTrainer, default branch) then sorts each rank's rows and interleaves them."""
    import torch

    from verl.utils.seqlen_balancing import calculate_workload, get_seqlen_balanced_partitions

    workload = calculate_workload(batch.batch["attention_mask"].sum(-1))
    parts = get_seqlen_balanced_partitions(workload, k_partitions=dp, equal_size=True)
    for i, part in enumerate(parts if trainer == "v0" else []):
        part.sort(key=lambda x: (workload[x], x))
        parts[i] = part[::2] + part[1::2][::-1]
    batch.reorder(torch.tensor([j for p in parts for j in p]))


def verl_micro_batches(lens: list[list[int]], cap: int) -> tuple[int, list[list[list[int]]]]:
    """verl's ``rearrange_micro_batches`` on one mini-batch's per-rank row lengths: the synced count and parts."""
    from verl.utils.seqlen_balancing import calculate_workload, ceildiv, get_seqlen_balanced_partitions

    import torch

    k = max(min(len(x), ceildiv(sum(x), cap)) for x in lens)
    while True:
        parts = [get_seqlen_balanced_partitions(calculate_workload(torch.tensor(x)).tolist(), k, equal_size=False)
                 for x in lens]
        if all(sum(x[j] for j in p) <= cap for x, ps in zip(lens, parts) for p in ps):
            return k, parts
        k += 1


def micro_batch_report(batch, dp: int, num_mb: int, cap: int, planned: bool, packed: bool = False) -> dict:
    """Per rank and update: planned / verl micro-batch counts and padded-position shares of what runs (``packed``:
    remove-padding computes each micro-batch's tokens only)."""
    lens = batch.batch["attention_mask"].sum(-1).tolist()
    per_rank = len(lens) // dp
    mb = batch.batch["mini_batch_id"].tolist() if planned else [(i % per_rank) // (per_rank // num_mb) for i in range(len(lens))]
    micro = batch.batch["micro_batch_id"].tolist() if planned else None
    verl_total, area, real, planned_total = 0, 0, 0, 0
    for m in range(num_mb):
        rows = [[i for i in range(r * per_rank, (r + 1) * per_rank) if mb[i] == m] for r in range(dp)]
        k, parts = verl_micro_batches([[lens[i] for i in rs] for rs in rows], cap)
        verl_total += k
        groups = ([[[i for i in rs if micro[i] == j] for j in sorted({micro[i] for i in rs})] for rs in rows] if planned
                  else [[[rs[j] for j in p] for p in ps] for rs, ps in zip(rows, parts)])
        planned_total += max(len(g) for g in groups) if planned else 0
        for g in groups:
            for part in g:
                area += sum(lens[i] for i in part) if packed else len(part) * max(lens[i] for i in part)
                real += sum(lens[i] for i in part)
    return {"micro_batches_planned": planned_total if planned else None, "micro_batches_verl": verl_total,
            "padded_positions": 1.0 - real / max(area, 1)}


STOCK = {"stock": "v1", "stock_v0": "v0"}  # stock variant -> the trainer whose _balance_batch order it runs
SCOPE = " scope=trajectory"  # the suffix of a GSPO variant at traj.ratio_scope=trajectory


ALWAYS_TREE = 1e-6  # traj.tree_token_cost that makes every micro-batch a tree (a tree token all but free)


def variants(pass_costs: list[Optional[int]], remove_padding: bool = False, tree: bool = False,
             case: Optional[dict] = None, tree_costs: tuple = ()) -> dict[str, Optional[dict]]:
    """Variant name -> ``traj:`` options (None: stock verl, :data:`STOCK`): ``traj`` with each pass cost, then
    ``traj_area``; with remove-padding only ``traj`` (the cost is the token sum), and with ``tree`` ``traj_tree``
    (``traj.prefix_tree``: every micro-batch forwarded as its prefix tree) and ``traj_auto`` (the default: each
    micro-batch a tree or rows by the device's cost model, ``core/trees/tree_cost.py``), plus ``traj_auto cost=X``
    for each of ``tree_costs`` (``traj.tree_token_cost=X``). A GSPO case (``loss_mode=gspo``) adds
    each verl_traj variant at ``traj.ratio_scope=trajectory`` (``ratio_groups``: each row's sequence ratio over its
    trajectory; on rows through the pre-pass, on trees from the loss where every trajectory is atomic)."""
    out: dict[str, Optional[dict]] = {name: None for name in STOCK}
    if remove_padding:
        trees = {"traj_tree": {"prefix_tree": True, "tree_token_cost": ALWAYS_TREE},
                 "traj_auto": {"prefix_tree": True},
                 **{f"traj_auto cost={c:g}": {"prefix_tree": True, "tree_token_cost": c} for c in tree_costs}}
        out.update({"traj": {}, **(trees if tree else {})})
        if (case or {}).get("loss_mode") == "gspo":
            out.update({f"{name}{SCOPE}": {**out[name], "ratio_groups": True}
                        for name in [v for v in out if v not in STOCK]})
        return out
    for i, cost in enumerate(pass_costs):
        out["traj" if i == 0 else f"traj pass_cost={cost}"] = {"padded_cap": "tokens", "pass_cost_tokens": cost}
    out["traj_area"] = {"padded_cap": "area"}
    return out


def prepare(case: dict, variant: str, options: Optional[dict], cfg, vocab: int, dp: int, seed: int,
            packed: bool = False):
    from verl_traj.core.keys import OLD_LOG_PROBS_AT_START, RATIO_GROUP, RATIO_IN_LOSS, TRAJ_INDEX
    from verl_traj.testing.engine import plan_for_update

    batch = make_batch(case, vocab, seed, dp)
    source_rows, n_pad, atomic = len(batch), 0, None
    if options is None:
        stock_order(batch, dp, STOCK[variant])
    else:
        options = dict(options)
        ratio_groups = options.pop("ratio_groups", False)
        mode = "seq-mean-token-mean" if case.get("loss_mode") == "gspo" else "token-mean"
        plan = plan_for_update(batch, cfg, dp, mode=mode, ratio_groups=ratio_groups, **options)
        n_pad = int(plan.stats.padding_rows.sum())
        if plan.stats.atomic_trajectories is not None:
            atomic = int(plan.stats.atomic_trajectories.sum()) / max(int(plan.stats.trajectories.sum()), 1)
        if ratio_groups:  # staged by hand, as trainers/update_contract.py writes them for step rows at trajectory
            # scope: the benchmark stages the worker's update without the trainer, so it attaches the markers itself
            batch.batch[RATIO_GROUP] = batch.batch[TRAJ_INDEX].clone()
            batch.meta_info[RATIO_IN_LOSS] = plan.all_trajectories_atomic
            batch.meta_info[OLD_LOG_PROBS_AT_START] = True  # the trainer's word: old log-probs just recomputed
    report = micro_batch_report(batch, dp, case["mini_batches"], case["cap"], options is not None, packed)
    return batch, {"padding_rows": n_pad, "rows": len(batch), "source_rows": source_rows, "atomic_share": atomic,
                   "row_tokens": int(batch.batch["attention_mask"].sum()), **report}


def _config(case: dict, remove_padding: bool = False, attention: Optional[str] = None, device: str = "cpu",
            model: Optional[str] = None):
    from verl_traj.testing.engine import cpu_config, gpu_config

    attn = [f"actor_rollout_ref.model.override_config.attn_implementation={attention}"] if attention else []
    attn += [f"actor_rollout_ref.model.path={model}"] if model else []
    if case.get("loss_mode") == "gspo":  # verl's GSPO recipe: sequence-mean of token-means
        attn += ["actor_rollout_ref.actor.policy_loss.loss_mode=gspo", "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean"]
    if case["source"] == "step_rows":
        case = {**case, **dict(zip(("prompt_len", "response_len"), _step_row_lengths(case)))}
    if case["source"] == "branching":  # the rows' widths (the same rows every process builds)
        batch = make_batch(case, 1000, case.get("seed", 0), 1)  # bench_branching.py passes the run's seed as seed=
        case = {**case, "prompt_len": batch.batch["prompts"].shape[1], "response_len": batch.batch["responses"].shape[1]}
    return (gpu_config if device == "cuda" else cpu_config)([*attn, f"actor_rollout_ref.model.use_remove_padding={str(remove_padding).lower()}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={case['groups'] // case['mini_batches']}",
        f"actor_rollout_ref.rollout.n={case['n']}", f"data.train_batch_size={case['groups']}",
        f"data.max_prompt_length={case['prompt_len']}", f"data.max_response_length={case['response_len']}",
        "actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true",
        f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={case['cap']}",
    ])


def _time_update(worker, batch, rank: int, dp: int, rows: int, cuda: bool = False):
    import torch
    import torch.distributed as dist
    from verl.utils import tensordict_utils as tu

    from verl_traj.testing.engine import rank_tensordict

    td = rank_tensordict(batch, rank, dp, rows)
    if cuda:
        torch.cuda.synchronize()
    dist.barrier()
    t0 = time.perf_counter()
    out = worker.train_mini_batch(td)
    if cuda:
        torch.cuda.synchronize()
    dist.barrier()
    metrics = tu.get(out, "metrics") if out is not None else {}
    return time.perf_counter() - t0, metrics


def _attention(args, options: Optional[dict]) -> Optional[str]:
    """The variant's attn_implementation: without ``--rows-attention`` as before (``cpu_varlen`` for every variant
    with ``--tree``, else the platform's choice); with it, that one for rows and the flash-attention path (CPU:
    ``cpu_varlen``; CUDA: ``torch_varlen``, registered here) for the prefix-tree variants."""
    if args.rows_attention is None:
        return "cpu_varlen" if args.tree else None
    if not (options or {}).get("prefix_tree"):
        return args.rows_attention
    if args.device != "cuda":
        return "cpu_varlen"
    from verl_traj.testing.engine import register_torch_varlen

    return register_torch_varlen()


def _fused_logprobs_wanted(args) -> bool:
    """``--logprobs auto``: on CUDA without flash-attn (verl's per-token fallback), else verl's own."""
    import importlib.util

    return args.logprobs == "fused" or (args.logprobs == "auto" and args.device == "cuda"
                                        and importlib.util.find_spec("flash_attn") is None)


def _install_fused_logprobs() -> None:
    """verl's engine computes log-probs with flash-attn's fused cross-entropy kernel where flash-attn is installed,
    else ``logprobs_from_logits_v2``, a Python loop over the tokens (one log-softmax each): on a GPU without flash-attn
    that loop, not the model, would set the time. In this process the engine gets the chunked fp32 log-softmax (the
    fused kernel's numbers, bounded scratch) instead, for rows and trees alike (what a CUDA process without flash-attn
    gets when its model selects torch_varlen: :mod:`verl_traj.cpu.torch_flash`)."""
    import verl.workers.engine.fsdp.transformer_impl  # noqa: F401  (installed now: the module must be loaded)

    from verl_traj.core.kernels.chunked_logprobs import chunked_logprobs
    from verl_traj.integration.patches.process import fused_logprobs_patches, install

    install(fused_logprobs_patches(lambda _verl: chunked_logprobs), on_import=None)


def _proc(rank: int, dp: int, port: int, args, out_path: str):
    from verl_traj.testing.engine import actor_worker, init_rank

    init_rank(rank, dp, port, args.home, args.threads, args.device)
    cuda = args.device == "cuda"
    if _fused_logprobs_wanted(args):
        _install_fused_logprobs()
    results = {}
    for name in args.cases:
        case = {**CASES[name], **args.case_set}
        runs = {}
        chosen = variants(args.pass_cost, args.remove_padding, args.tree, case, tuple(args.tree_costs))
        for variant, options in {v: o for v, o in chosen.items() if (v in STOCK and case.get("stock", True))
                                 or (v not in STOCK and (not args.variants or v in args.variants))}.items():
            cfg = _config(case, args.remove_padding, _attention(args, options), args.device, args.model)
            worker = actor_worker(cfg, options is not None)
            batch, info = prepare(case, variant, options, cfg, int(worker.model_config.hf_config.vocab_size), dp, args.seed,
                                  args.remove_padding)
            runs[variant] = {"worker": worker, "batch": batch, "info": info, "times": [], "metrics": None}
        names = list(runs)
        for it in range(args.repeats + 1):
            for variant in names[it % len(names):] + names[:it % len(names)]:  # rotated: no variant always first
                r = runs[variant]
                # stock: fixed-size mini-batches of rows / M (the same optimizer steps as the plan)
                dt, metrics = _time_update(r["worker"], r["batch"], rank, dp, r["info"]["source_rows"] // case["mini_batches"],
                                           cuda)
                if it:
                    r["times"].append(dt)
                r["metrics"] = metrics
        if args.profile:
            for variant, r in runs.items():
                r["profile"] = _profiled_update(r, rank, dp, r["info"]["source_rows"] // case["mini_batches"], cuda,
                                                os.path.join(args.profile, f"{name}_{variant}"))
        results[name] = {v: _summary(r) for v, r in runs.items()}
        if cuda:  # this case's workers (model, optimizer) off the GPU before the next case builds its own
            _release(runs)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    import torch.distributed as dist

    dist.destroy_process_group()


TREE_SPANS = ("verl_traj.tree.build", "verl_traj.tree.inputs", "verl_traj.tree.mask", "verl_traj.tree.attention",
              "verl_traj.tree.outputs")


def _profiled_update(run: dict, rank: int, dp: int, rows: int, cuda: bool, path: str) -> dict:
    """One more update of ``run`` under torch's profiler (CPU, and CUDA on a GPU): rank 0 writes the operator table
    (``path``.txt, by self device time on a GPU, else CPU time) and returns the seconds spent in each of the tree's
    stages (:data:`TREE_SPANS`, ``record_function`` spans in ``integration/tree/tree_forward.py``: the trees' build from
    the plan's facts, verl's input preparation over them, the attention's mask, the attention calls, the gathers back to
    the rows), in the attention's kernels, and in the whole update."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with profile(activities=activities) as prof:
        total, _ = _time_update(run["worker"], run["batch"], rank, dp, rows, cuda)
    if rank:
        return {}
    events = prof.key_averages()
    sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".txt", "w") as f:
        f.write(events.table(sort_by=sort, row_limit=50))
    spans = {e.key: e for e in events if e.key in TREE_SPANS}
    device = "device_time_total" if cuda else "cpu_time_total"
    out = {"update_s": total, **{k.rsplit(".", 1)[-1] + "_s": getattr(spans[k], "cpu_time_total") / 1e6
                                 for k in spans}}
    if cuda:  # the device time of each span's kernels
        out.update({k.rsplit(".", 1)[-1] + "_device_s": getattr(spans[k], device) / 1e6 for k in spans})
    return out


def _release(runs: dict) -> None:
    import gc

    import torch

    runs.clear()
    gc.collect()
    torch.cuda.empty_cache()


def _summary(run: dict) -> dict:
    m = run["metrics"] or {}
    grad = m.get("grad_norm")
    return {"seconds_per_update": statistics.median(run["times"]), "seconds_all": run["times"],
            "optimizer_steps": len(grad) if isinstance(grad, list) else None,
            "micro_batches_run": (m.get("micro_batches_per_epoch") or [None])[0],
            "prepass_micro_batches": (m.get("prepass_micro_batches_per_epoch") or [None])[0],
            "tree_tokens": (m.get("tree_tokens") or [None])[0],
            # a mixed update: the tree micro-batches' row tokens (the rest ran as rows), micro-batches run as rows
            "tree_row_tokens": (m.get("tree_row_tokens") or [None])[0],
            "row_micro_batches": (m.get("tree_planned_row_micro_batches") or [None])[0], **run["info"],
            **({"profile": run["profile"]} if run.get("profile") else {})}


def _paired(times: list[float], base: list[float]) -> float:
    """Median of the per-repeat ratios (the variants of one repeat run back to back, so slow drift of the
    machine cancels)."""
    return statistics.median(t / b for t, b in zip(times, base))


def _forwarded(r: dict) -> str:
    """Tokens one epoch forwards: the tree's (both ranks) for a tree variant, else the rows' attended tokens."""
    atomic = f", {r['atomic_share']:.0%} of trajectories atomic" if r.get("atomic_share") is not None else ""
    if r.get("row_micro_batches"):  # a mixed update: the trees' tokens plus the rows' of the row micro-batches
        forwarded = r["tree_tokens"] + r["row_tokens"] - r["tree_row_tokens"]
        return f"{forwarded:,.0f} (trees and {r['row_micro_batches']:.0f} row micro-batches/rank{atomic})"
    return f"{r['tree_tokens']:,.0f} (tree{atomic})" if r.get("tree_tokens") else f"{r['row_tokens']:,}"


def _table(report: dict) -> str:
    lines = ["| case | variant | s/update | vs stock | vs stock_v0 | optimizer steps | micro-batches/rank: planned / run / verl's cut of these rows | padded positions | rows (padding) | tokens forwarded |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, res in report["results"].items():
        base, base_v0 = (res[v]["seconds_all"] for v in STOCK)
        for variant, r in res.items():
            prepass = (f" (+{r['prepass_micro_batches']:.0f} pre-pass)" if r.get("prepass_micro_batches") is not None else "")
            micro = (f"{r['micro_batches_planned']} / {r['micro_batches_run']:.0f}{prepass} / {r['micro_batches_verl']}"
                     if variant not in STOCK else f"- / - / {r['micro_batches_verl']}")
            t = r["seconds_per_update"]
            lines.append(f"| {name} | {variant} | {t:.3f} | {_paired(r['seconds_all'], base):.2f}x | "
                         f"{_paired(r['seconds_all'], base_v0):.2f}x | "
                         f"{r['optimizer_steps']} | {micro} | {r['padded_positions']:.1%} | {r['rows']} ({r['padding_rows']}) | "
                         f"{_forwarded(r)} |")
    for name, res in report["results"].items():  # GSPO: the trajectory scope's price over the row scope's
        pairs = [f"{v[:-len(SCOPE)]} {_paired(r['seconds_all'], res[v[:-len(SCOPE)]]['seconds_all']):.2f}x"
                 for v, r in res.items() if v.endswith(SCOPE)]
        if pairs:
            lines.append(f"\n{name}: s/update at scope=trajectory over the same variant at row scope (median of the "
                         f"per-repeat ratios): {', '.join(pairs)}")
    return "\n".join(lines)


def _device_config(args) -> dict:
    """The report's device keys: none for the CPU defaults (their JSON unchanged)."""
    if args.device == "cpu" and args.model is None and args.rows_attention is None and args.logprobs == "auto":
        return {}
    import torch

    gpu = torch.cuda.get_device_name() if args.device == "cuda" and torch.cuda.is_available() else None
    return {"device": args.device, "gpu": gpu, "model": args.model, "rows_attention": args.rows_attention,
            "tree_attention": ("torch_varlen" if args.device == "cuda" else "cpu_varlen") if args.tree else None,
            "logprobs": "chunked fp32 log-softmax" if _fused_logprobs_wanted(args) else "verl's",
            "torch": torch.__version__}


def _case_value(text: str) -> dict:
    key, _, value = text.partition("=")
    return {key: int(value)}


class _Merge(argparse.Action):
    """``--case-set a=1 b=2`` -> ``{"a": 1, "b": 2}``."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, {k: v for d in values for k, v in d.items()})


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--cases", nargs="+", default=list(CASES)[:5], choices=list(CASES),
                    help="default: the first five; share_* and low_share are the break-even sweep's")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pass-cost", nargs="+", type=lambda v: None if v == "null" else int(v), default=[1024],
                    help="traj.pass_cost_tokens of the traj variant; more values add variants (null: the fewest passes)")
    ap.add_argument("--home", default=os.environ.get("VERL_TRAJ_HOME", os.path.join(tempfile.gettempdir(), "verl_traj_tiny_bench")))
    ap.add_argument("--remove-padding", action="store_true",
                    help="verl's remove-padding path (actor_rollout_ref.model.use_remove_padding=true): the GPU mode")
    ap.add_argument("--tree", action="store_true",
                    help="with --remove-padding: add traj_tree (traj.prefix_tree=true); every variant then runs the "
                         "CPU platform's flash-attention path (cpu_varlen), where the tree attention sits")
    ap.add_argument("--tree-costs", nargs="*", type=float, default=[],
                    help="with --tree: add 'traj_auto cost=X' for each X (traj.tree_token_cost=X: the cost model of "
                         "another device, e.g. 2.19, the CUDA figure, to see a mixed update here)")
    ap.add_argument("--variants", nargs="+", default=None,
                    help="run only these verl_traj variants (the stock ones always run: the baseline), e.g. "
                         "'traj_tree' 'traj_tree scope=trajectory'")
    ap.add_argument("--case-set", nargs="*", default={}, type=_case_value, action=_Merge, metavar="KEY=INT",
                    help="override integer settings of every chosen case, e.g. groups=4 n=2 (bench_branching.py)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="cuda: one GPU per rank (nccl), verl's GPU settings (bf16 mixed precision); use --dp 1 on one GPU")
    ap.add_argument("--model", default=None, help="the model directory (default: the tiny model under --home)")
    ap.add_argument("--rows-attention", default=None,
                    help="attn_implementation of the rows variants (e.g. flex_attention, sdpa); with --tree the tree "
                         "variants use the flash-attention path (cpu_varlen on CPU, torch_varlen on CUDA)")
    ap.add_argument("--logprobs", choices=["auto", "verl", "fused"], default="auto",
                    help="fused: one vectorised fp32 log-softmax in verl's engine instead of its per-token fallback "
                         "(auto: on CUDA without flash-attn, whose fused cross-entropy verl uses where installed)")
    ap.add_argument("--profile", default=None, metavar="DIR",
                    help="after the timed updates, one more per variant under torch's profiler: its operator table in "
                         "DIR/<case>_<variant>.txt, the seconds in each prefix-tree stage in the JSON (issue 41 item 3)")
    ap.add_argument("--json", action="store_true", help="print JSON instead of the table")
    return ap


def run(args) -> dict:
    """The report (``config`` and per-case ``results``) of the parsed ``args``: every rank's updates, timed."""
    if args.device == "cuda" and args.rows_attention is None:
        args.rows_attention = "sdpa"  # no cpu_varlen there: transformers' sdpa masks packed sequences by position ids
    if args.model is None and not (Path(args.home) / "tiny" / "model").exists():
        from verl_traj.cpu.build_tiny import build

        build(str(Path(args.home) / "tiny"))
    os.environ["VERL_TRAJ_HOME"] = args.home
    import torch.multiprocessing as mp

    from verl_traj.testing.engine import free_port

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "bench.json")
        mp.spawn(_proc, args=(args.dp, free_port(), args, out), nprocs=args.dp, join=True)
        with open(out) as f:
            results = json.load(f)
    report = {"config": {"dp": args.dp, "repeats": args.repeats, "threads": args.threads, "seed": args.seed,
                         "remove_padding": args.remove_padding, "tree": args.tree, "cases": {c: {**CASES[c], **args.case_set} for c in args.cases},
                         **_device_config(args)},
              "results": results}
    return report


def main(argv=None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    if args.tree and not args.remove_padding:
        ap.error("--tree needs --remove-padding (the prefix tree runs on verl's remove-padding path)")
    report = run(args)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        mode = "remove-padding" if args.remove_padding else "padded (sdpa, no remove-padding)"
        if args.rows_attention is None:
            mode += ", cpu_varlen attention for every variant" if args.tree else ""
        else:
            mode += f", rows attention {args.rows_attention}" + (", tree variants on the flash-attention path" if args.tree else "")
        where = "CPU" if args.device == "cpu" else f"CUDA ({args.model or 'tiny model'}, bf16 mixed precision)"
        print(f"actor update on {where}, dp={args.dp}, {mode}, median of {args.repeats} (alternating, after one warm-up each)")
        print(_table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
