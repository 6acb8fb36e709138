#!/usr/bin/env python
"""Benchmark: how many flex-attention kernels a run of many tree sizes compiles, and whether any call falls back to
flex's eager path (the dense ``[H, N, N]`` scores), for :mod:`verl_traj.core.kernels.tree_flex`.

Each size is a GRPO-shaped tree (a prompt of a quarter of the tokens, then 512-token responses under it), forwarded
through :func:`~verl_traj.core.kernels.tree_flex.tree_attention_flex` with grad disabled (the old-log-prob / reference passes)
and enabled (the update; on CUDA its inputs require grad and the backward runs, on CPU a forward only: flex has no CPU
backward), at dynamo's default settings (recompile limit 8). Variants, each in a fresh process (dynamo's cache is per
process):

* ``dynamic`` -- tree_flex as shipped (symbolic length: one kernel per grad mode);
* ``static``  -- the previous scheme for comparison: ``torch.compile(flex_attention, dynamic=False)``, one compile per
  1,024-token bucket and grad mode, eager once past the limit.

Columns: tree tokens, padded length (``pad %`` of the tree), compiled dynamo graphs so far, eager calls so far, the
call's wall time (the first of a kernel includes its compile), and an error where a call raised.

Usage:
    python scripts/bench_flex_compiles.py                          # CPU, fp32, both variants, table
    python scripts/bench_flex_compiles.py --json
    python scripts/bench_flex_compiles.py --device cuda --dtype bfloat16 --heads 12 --kv-heads 2 --head-dim 128 \\
        --sizes 900,2100,3900,5200,6100,7400,9800,12500,16000
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch.nn.attention.flex_attention as flex_module  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402

from verl_traj.core.kernels import tree_flex  # noqa: E402

SIZES = "60,703,1114,1967,2511,3008,3119,4187,4711"  # 9 sizes over 5 buckets (the CPU test's)


def group_tree(n: int) -> torch.Tensor:
    """``subtree_end`` ``[n]`` of a prompt of ``n // 4`` tokens with 512-token responses under it (the last shorter)."""
    prompt = max(1, n // 4)
    se = torch.full((n,), n - 1, dtype=torch.long)
    ends = torch.arange(prompt, n, 512)[1:].tolist() + [n]
    for start, end in zip([prompt] + ends[:-1], ends):
        se[start:end] = end - 1
    return se


def use_static_flex() -> None:
    """The previous compile: static shapes (one kernel per bucket), not fullgraph (eager past the limit)."""
    tree_flex._COMPILED["flex"] = torch.compile(flex_module.flex_attention, dynamic=False)
    tree_flex._admit = lambda key: None


def run_variant(args) -> list:
    eager = []
    real_warn = flex_module._warn_once
    flex_module._warn_once = lambda warning_id, *a, **k: (eager.append(warning_id), real_warn(warning_id, *a, **k))
    if args.variant == "static":
        use_static_flex()
    dtype, dev, rows = getattr(torch, args.dtype), torch.device(args.device), []
    for n in (int(s) for s in args.sizes.split(",")):
        se = group_tree(n).to(dev)
        for grad in (False, True):
            qkv = [torch.randn(n, h, args.head_dim, device=dev, dtype=dtype) for h in (args.heads, args.kv_heads,
                                                                                      args.kv_heads)]
            backward = grad and dev.type == "cuda"
            qkv = [x.requires_grad_(backward) for x in qkv]
            error, start = "", time.perf_counter()
            try:
                with torch.set_grad_enabled(grad):
                    out = tree_flex.tree_attention_flex(*qkv, tree_flex.FlexTree(se))
                    if backward:
                        out.float().sum().backward()
                if dev.type == "cuda":
                    torch.cuda.synchronize()
            except Exception as e:  # reported in the table: an eager OOM, a TreeAttentionError
                error = f"{type(e).__name__}: {str(e)[:70]}"
            padded = tree_flex.bucketed(n)
            rows.append(dict(variant=args.variant, n=n, grad=grad, padded=padded, pad_pct=100 * (padded - n) / n,
                             graphs=int(counters["stats"]["unique_graphs"]), eager=len(eager),
                             ms=1e3 * (time.perf_counter() - start), error=error))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=16)
    p.add_argument("--sizes", default=SIZES)
    p.add_argument("--variants", default="dynamic,static")
    p.add_argument("--variant", help=argparse.SUPPRESS)  # one variant in this process (the parent's child)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if args.variant:
        print(json.dumps(run_variant(args)))
        return
    rows = []
    for variant in args.variants.split(","):
        cmd = [sys.executable, __file__, "--variant", variant] + [a for a in sys.argv[1:] if a != "--json"]
        rows += json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1])
    if args.json:
        print(json.dumps(dict(device=args.device, torch=torch.__version__, rows=rows), indent=1))
        return
    print(f"device={args.device} torch={torch.__version__} dtype={args.dtype} heads={args.heads}/{args.kv_heads}x"
          f"{args.head_dim} recompile_limit={torch._dynamo.config.recompile_limit}")
    print(f"{'variant':<8} {'tokens':>6} {'grad':>5} {'padded':>6} {'pad %':>6} {'graphs':>6} {'eager':>5} "
          f"{'ms':>9}  error")
    for r in rows:
        print(f"{r['variant']:<8} {r['n']:>6} {r['grad']!s:>5} {r['padded']:>6} {r['pad_pct']:>6.1f} {r['graphs']:>6} "
              f"{r['eager']:>5} {r['ms']:>9.1f}  {r['error']}")


if __name__ == "__main__":
    main()
