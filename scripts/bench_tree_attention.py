#!/usr/bin/env python
"""Benchmark: prefix-tree attention vs per-row attention, forward + backward of one attention layer.

Torch (and numpy) only: no verl, no Ray; runs on CPU by default and with ``--device cuda`` on any GPU machine.
Each workload is a list of rows (token ids); the tree is their trie serialised depth-first with the branch-copy
rule (an extra child of a token hangs under a copy of that token), as the trainer forwards it. q / k / v are random
leaves of the tree's (or the rows') token count; every variant runs forward then backward of the same upstream
gradient. Variants, side by side in each repeat (round-robin, so drift hits them alike; medians reported):

* ``tree/blocked``  -- :func:`verl_traj.core.kernels.tree_attention.tree_attention` (the reference: query blocks against
  their visible keys, recompute in backward);
* ``rows/blocked``  -- the same kernel on the rows packed one after another (each row its own chain): same code,
  so the ratio is the tree's saving alone;
* ``tree/sdpa``     -- the tree through ``scaled_dot_product_attention`` per query block (gathered keys + a boolean
  mask, autograd backward);
* ``rows/sdpa``     -- each row separately through causal ``scaled_dot_product_attention`` (per-row training);
* ``--device cuda`` adds ``tree/flex`` and ``rows/flex``: compiled ``flex_attention`` with
  :func:`~verl_traj.core.kernels.tree_attention.tree_block_mask` (compile excluded from the timings).

``max_err`` is the largest difference between a variant's per-row outputs (gathered from the tree) and the
``rows/sdpa`` outputs, in the run's dtype.

Workloads: ``grpo-8`` / ``grpo-16`` (n responses of 512 tokens behind one 2K-token prompt) and ``steps`` (one row
per LLM call of a 12-turn agent trajectory: 1K-token system prompt, 128-token observations and actions; a quarter
of the actions are re-encoded differently in the next prompt, so the rows branch there). ``--quick`` scales down.

Usage:
    python scripts/bench_tree_attention.py                 # CPU, fp32, table
    python scripts/bench_tree_attention.py --quick --json
    python scripts/bench_tree_attention.py --device cuda --dtype bfloat16 --heads 28 --kv-heads 4 --head-dim 128
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from verl_traj.core.kernels.tree_attention import (per_row_causal_attention, tree_attention, tree_attention_blocks,  # noqa
                                           tree_attention_pairs, tree_block_mask)

VOCAB = 32000


# ------------------------------------------------------------------------------------------------ trees
def build_tree(rows):
    """Trie of ``rows`` (lists of ints) serialised depth-first with the branch-copy rule -> ``(ids, positions,
    subtree_end, row_index)``: ``row_index[r][j]`` is the tree index of row r's token j (the copy leading to the
    row's next token at a branch). Iterative (rows of any length)."""
    children, token = [{}], [-1]
    for row in rows:
        node = 0
        for t in row:
            if t not in children[node]:
                children[node][t] = len(token)
                token.append(t)
                children.append({})
            node = children[node][t]
    kids = [list(c.values()) for c in children]
    ids, pos, se, emitted, frames = [], [], [], {}, []

    def start(node, depth, kid):  # emit the node (a copy when kid > 0) and open its frame
        frames.append([node, depth, kid, len(ids), False])
        ids.append(token[node])
        pos.append(depth)
        se.append(-1)

    for top in kids[0]:
        start(top, 0, 0)
        while frames:
            frame = frames[-1]
            node, depth, kid, i, descended = frame
            if not descended and kids[node]:
                frame[4] = True
                emitted[(node, token[kids[node][kid]])] = i
                start(kids[node][kid], depth + 1, 0)
                continue
            se[i] = len(ids) - 1
            frames.pop()
            if kid == 0:
                emitted[(node, None)] = i
            if kid + 1 < len(kids[node]):
                start(node, depth, kid + 1)
    row_index = []
    for row in rows:
        node, idx = 0, []
        for j, t in enumerate(row):
            node = children[node][t]
            idx.append(emitted[(node, row[j + 1] if j + 1 < len(row) else None)])
        row_index.append(idx)
    return ids, pos, se, row_index


def grpo_rows(gen, n, prompt, response):
    """n rows: one shared prompt, n responses with distinct first tokens."""
    p = torch.randint(VOCAB, (prompt,), generator=gen).tolist()
    firsts = torch.randperm(VOCAB, generator=gen)[:n].tolist()
    return [p + [f] + torch.randint(VOCAB, (response - 1,), generator=gen).tolist() for f in firsts]


def step_rows(gen, turns, system, obs, act, retok=0.25):
    """One row per LLM call: context + observation + action; with probability ``retok`` the action is re-encoded
    (last token changed) in the next context, so the next rows branch from this one there."""
    context, rows = torch.randint(VOCAB, (system,), generator=gen).tolist(), []
    for _ in range(turns):
        prompt = context + torch.randint(VOCAB, (obs,), generator=gen).tolist()
        action = torch.randint(VOCAB, (act,), generator=gen).tolist()
        rows.append(prompt + action)
        if float(torch.rand((), generator=gen)) < retok:
            action = action[:-1] + [(action[-1] + 1) % VOCAB]
        context = prompt + action
    return rows


def workloads(quick):
    gen = torch.Generator().manual_seed(0)
    if quick:
        return [("grpo-4", grpo_rows(gen, 4, 256, 64)), ("grpo-8", grpo_rows(gen, 8, 256, 64)),
                ("steps", step_rows(gen, 4, 128, 32, 32))]
    return [("grpo-8", grpo_rows(gen, 8, 2048, 512)), ("grpo-16", grpo_rows(gen, 16, 2048, 512)),
            ("steps", step_rows(gen, 12, 1024, 128, 128))]


# --------------------------------------------------------------------------------------------- variants
def sdpa_tree(q, k, v, se, blocks):
    """The tree through sdpa per query block (gathered visible keys, boolean mask), autograd backward."""
    outs, g = [], q.shape[1] // k.shape[1]
    for i, keys in enumerate(blocks.keys):
        q0 = i * blocks.block
        qi = torch.arange(q0, min(q0 + blocks.block, blocks.n), device=q.device)[:, None]
        mask = (keys[None, :] <= qi) & (qi <= se[keys][None, :])
        kb, vb = (x.index_select(0, keys).repeat_interleave(g, dim=1).transpose(0, 1) for x in (k, v))
        outs.append(F.scaled_dot_product_attention(q[q0:q0 + len(qi)].transpose(0, 1), kb, vb,
                                                   attn_mask=mask).transpose(0, 1))
    return torch.cat(outs)


def flex_fn():
    from torch.nn.attention.flex_attention import flex_attention

    compiled = torch.compile(flex_attention, dynamic=False)
    return lambda q, k, v, mask: compiled(*(x.transpose(0, 1)[None] for x in (q, k, v)), block_mask=mask,
                                          enable_gqa=True)[0].transpose(0, 1)


def prepare(rows, args, device, dtype):
    """Leaves, upstream gradients and plans for both layouts; returns a dict of variant -> (run, outputs_per_row)."""
    ids, pos, se, row_index = build_tree(rows)
    n_tree, lens = len(ids), [len(r) for r in rows]
    chain_se = [s + length - 1 for s, length in zip([0] + list(torch.tensor(lens).cumsum(0)[:-1].tolist()), lens)
                for _ in range(length)]
    gen = torch.Generator().manual_seed(1)

    def leaves(n):
        make = lambda h: torch.randn(n, h, args.head_dim, generator=gen).to(device, dtype).requires_grad_()  # noqa
        return make(args.heads), make(args.kv_heads), make(args.kv_heads)

    tree_qkv, rows_qkv = leaves(n_tree), leaves(sum(lens))
    # the rows' inputs are the tree's, gathered: outputs must agree row by row
    flat = torch.tensor([i for idx in row_index for i in idx], device=device)
    rows_qkv = tuple(x.detach()[flat].clone().requires_grad_() for x in tree_qkv)
    grad_rows = torch.randn(sum(lens), args.heads, args.head_dim, generator=gen).to(device, dtype)
    grad_tree = torch.zeros(n_tree, args.heads, args.head_dim, device=device, dtype=dtype).index_add_(0, flat,
                                                                                                       grad_rows)
    se_tree, se_rows = (torch.tensor(x, device=device) for x in (se, chain_se))
    t0 = time.perf_counter()
    blocks_tree = tree_attention_blocks(se_tree, args.block)
    plan_s = time.perf_counter() - t0
    blocks_rows = tree_attention_blocks(se_rows, args.block)
    split = lambda x: list(x.split(lens))  # noqa
    variants = {
        "tree/blocked": (tree_qkv, grad_tree, lambda q, k, v: tree_attention(q, k, v, se_tree, blocks=blocks_tree)),
        "rows/blocked": (rows_qkv, grad_rows, lambda q, k, v: tree_attention(q, k, v, se_rows, blocks=blocks_rows)),
        "tree/sdpa": (tree_qkv, grad_tree, lambda q, k, v: sdpa_tree(q, k, v, se_tree, blocks_tree)),
        "rows/sdpa": (rows_qkv, grad_rows, lambda q, k, v: torch.cat(per_row_causal_attention(
            split(q), split(k), split(v)))),
    }
    if device.type == "cuda" and not args.no_flex:
        flex = flex_fn()
        mask_tree, mask_rows = tree_block_mask(se_tree, 128), tree_block_mask(se_rows, 128)
        variants["tree/flex"] = (tree_qkv, grad_tree, lambda q, k, v: flex(q, k, v, mask_tree))
        variants["rows/flex"] = (rows_qkv, grad_rows, lambda q, k, v: flex(q, k, v, mask_rows))
    facts = dict(rows=len(rows), row_tokens=sum(lens), tree_tokens=n_tree,
                 row_pairs=sum(n * (n + 1) // 2 for n in lens), tree_pairs=tree_attention_pairs(se_tree),
                 plan_build_s=plan_s)
    return variants, flat, facts


def timed(fn, device):
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0, out


def bench_workload(name, rows, args, device, dtype):
    variants, flat, facts = prepare(rows, args, device, dtype)
    times, errs = {v: [] for v in variants}, {}

    def step(variant):
        (q, k, v), grad, fn = variants[variant]
        for x in (q, k, v):
            x.grad = None
        out = fn(q, k, v)
        out.backward(grad)
        return out.detach()

    outs = {v: step(v) for v in variants}  # warm-up (and compile)
    ref = outs["rows/sdpa"].float()
    for v, out in outs.items():
        errs[v] = float(((out[flat] if v.startswith("tree") else out).float() - ref).abs().max())
    for _ in range(args.repeats):
        for v in variants:
            times[v].append(timed(lambda v=v: step(v), device)[0])
    records = []
    for v in variants:
        kernel = v.split("/")[1]
        tree = v.startswith("tree")
        med = statistics.median(times[v])
        rows_med = statistics.median(times["rows/" + kernel])
        records.append(dict(workload=name, variant=v, **facts,
                            tokens=facts["tree_tokens" if tree else "row_tokens"],
                            pairs=facts["tree_pairs" if tree else "row_pairs"], seconds=med, times=times[v],
                            speedup_vs_rows_same_kernel=rows_med / med, max_err=errs[v]))
    return records


def run(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small workloads (seconds)")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, help="float32 (CPU default) / bfloat16 (CUDA default) / float64")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block", type=int, default=128, help="query block of the blocked / sdpa tree variants")
    p.add_argument("--repeats", type=int, default=None, help="timed repeats per variant (default 3, quick 2)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--no-flex", action="store_true", help="skip the compiled flex-attention variants on CUDA")
    args = p.parse_args(argv)
    args.repeats = args.repeats or (2 if args.quick else 3)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    records = []
    for name, rows in workloads(args.quick):
        records += bench_workload(name, rows, args, device, dtype)
    config = dict(device=str(device), dtype=str(dtype).replace("torch.", ""), heads=args.heads,
                  kv_heads=args.kv_heads, head_dim=args.head_dim, block=args.block, repeats=args.repeats,
                  threads=torch.get_num_threads(), torch=torch.__version__, quick=args.quick)
    return dict(config=config, records=records)


def table(result):
    c = result["config"]
    lines = [f"device={c['device']} dtype={c['dtype']} heads={c['heads']}/{c['kv_heads']}x{c['head_dim']} "
             f"block={c['block']} repeats={c['repeats']} (median) threads={c['threads']} torch={c['torch']}", "",
             "| workload | variant | tokens | attention pairs | fwd+bwd s | speed-up vs rows (same kernel) | max err |",
             "|---|---|---|---|---|---|---|"]
    for r in result["records"]:
        lines.append(f"| {r['workload']} ({r['rows']} rows) | {r['variant']} | {r['tokens']:,} | {r['pairs']:,} | "
                     f"{r['seconds']:.4f} | {r['speedup_vs_rows_same_kernel']:.2f}x | {r['max_err']:.1e} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    result = run(argv)
    print(json.dumps(result, indent=1) if "--json" in (argv if argv is not None else sys.argv[1:]) else table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
