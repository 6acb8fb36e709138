"""Peak extra memory of the engine's log-probs without flash-attn, side by side: verl_traj's chunked fp32 log-softmax
(``verl_traj.core.kernels.chunked_logprobs``), verl's own fallback (``logprobs_from_logits_v2``: a Python loop over the
rows) and one ``cross_entropy`` over all rows (what verl_traj shipped before: fp32 ``[N, V]`` kept for the backward).

Each variant runs in a fresh process: the logits (``--tokens`` x ``--vocab``, ``--dtype``) are allocated, then the
log-probs' forward and backward run; the figure is the peak resident memory of the process minus its peak before the
call (the logits' gradient, the same size as the logits for every variant, included), on this machine's CPU. A variant
whose predicted peak exceeds ``--max-gib`` is skipped and said so.

    python scripts/bench_logprobs.py                       # 32K tokens x 152K vocabulary, bf16
    python scripts/bench_logprobs.py --tokens 4096 --json
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

GIB = 1 << 30
VARIANTS = ("chunked", "verl", "cross_entropy")


def _cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return -F.cross_entropy(logits.float(), labels, reduction="none")


def _run(variant: str, tokens: int, vocab: int, dtype: str) -> dict:
    """In this process: allocate, then one forward and backward of ``variant``; peak RSS growth and time."""
    from verl.utils.torch_functional import logprobs_from_logits_v2

    from verl_traj.core.kernels.chunked_logprobs import chunked_logprobs

    fn = {"chunked": chunked_logprobs, "verl": logprobs_from_logits_v2, "cross_entropy": _cross_entropy}[variant]
    torch.manual_seed(0)
    logits = torch.randn(tokens, vocab, dtype=getattr(torch, dtype)).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    start = time.perf_counter()
    out = fn(logits, labels)
    out.sum().backward()
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"variant": variant, "extra_gib": (peak - before) / GIB, "seconds": seconds,
            "logits_gib": logits.numel() * logits.element_size() / GIB}


def _predicted_gib(variant: str, tokens: int, vocab: int, itemsize: int) -> float:
    """The variant's predicted peak beyond the logits (the gradient included)."""
    grad = tokens * vocab * itemsize
    extra = {"chunked": 0, "verl": tokens * vocab * itemsize, "cross_entropy": 2 * tokens * vocab * 4}[variant]
    return (tokens * vocab * itemsize + grad + extra) / GIB  # logits + gradient + what the variant keeps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--vocab", type=int, default=152064)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--max-gib", type=float, default=22.0, help="skip a variant predicted to need more")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, of " + ", ".join(VARIANTS))
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_run(args.child, args.tokens, args.vocab, args.dtype)))
        return
    from verl_traj.core.kernels.chunked_logprobs import chunk_rows

    itemsize = torch.empty((), dtype=getattr(torch, args.dtype)).element_size()
    rows = []
    for variant in args.variants.split(","):
        predicted = _predicted_gib(variant, args.tokens, args.vocab, itemsize)
        if predicted > args.max_gib:
            rows.append({"variant": variant, "skipped": f"predicted {predicted:.1f} GiB > --max-gib {args.max_gib}"})
            continue
        cmd = [sys.executable, __file__, "--child", variant, "--tokens", str(args.tokens), "--vocab", str(args.vocab),
               "--dtype", args.dtype]
        run = subprocess.run(cmd, capture_output=True, text=True)
        rows.append(json.loads(run.stdout.strip().splitlines()[-1]) if run.returncode == 0 else
                    {"variant": variant, "skipped": f"failed (rc {run.returncode}): {run.stderr.strip()[-200:]}"})
    result = {"tokens": args.tokens, "vocab": args.vocab, "dtype": args.dtype,
              "chunk_rows": chunk_rows(args.vocab), "chunk_scratch_gib": 2 * chunk_rows(args.vocab) * args.vocab * 4 / GIB,
              "rows": rows}
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"{args.tokens} tokens x {args.vocab} vocabulary, {args.dtype} logits; chunked: {result['chunk_rows']} rows "
          f"a chunk ({result['chunk_scratch_gib']:.3f} GiB fp32 scratch)")
    print(f"{'variant':<14} {'extra peak GiB (grad incl.)':>28} {'seconds':>9}")
    for r in rows:
        if "skipped" in r:
            print(f"{r['variant']:<14} {'skipped: ' + r['skipped']:>38}")
        else:
            print(f"{r['variant']:<14} {r['extra_gib']:>28.2f} {r['seconds']:>9.1f}")


if __name__ == "__main__":
    main()
