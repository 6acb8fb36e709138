#!/usr/bin/env bash
# The update A/B on one CUDA GPU (docs/prefix_tree.md, "Left to build", item 1): one real actor update through verl's
# engine (scripts/bench_update.py --device cuda: verl's engine worker built in-process, no Ray) for stock verl rows,
# verl_traj rows (traj) and the verl_traj prefix tree (traj_tree), remove-padding, bf16 mixed precision (verl's own
# GPU defaults), a randomly initialised Qwen2 of Qwen2.5-0.5B's shape. Results into $OUT:
#   1. facts, wheel install, versions, `import verl, verl_traj` and the update's modules      -> $OUT/env.txt
#   2. the model (built here, saved bf16) and the rows attention, stock verl's on this machine: flash_attention_2
#      where flash-attn is installed (verl's default), else sdpa, else flex_attention, each on the
#      packed layout vs each row alone (fp32 + bf16, forward + backward); the first exact one   -> $OUT/model_check.json
#   3. one bench_update.py run per case ($CASES), merged                                       -> $OUT/bench_update.{json,txt}
#      (.txt: the table, and per case traj_tree over traj and over stock; stderr of 2 and 3    -> $OUT/bench_update.log)
#   summary (exit code and seconds of each stage)                                               -> $OUT/summary.txt
# Every stage has its own timeout; nothing starts after $DEADLINE s (default 390) and none runs past it (+10 s to kill).
# Expected on an H100: install ~10 s, imports ~20 s, model ~60-100 s, gspo ~110-170 s, shared_prompt the rest.
#
# The machine has no verl: the wheels in .whl travel (`carry: [".whl"]`), installed with --no-deps into $SITE. Ray is
# imported by verl at module level but never used on this path, and its wheel is too large to carry: a stub (below)
# stands in, and raises on any real use. Make .whl here (with PyPI):  bash scripts/gpu_update_ab.sh --download
# Usage on the GPU machine (repo root):  OUT=/some/dir bash scripts/gpu_update_ab.sh  (the whole step against stock:
# scripts/gpu_e2e.sh, trees, rows and stock verl through main_ppo)
# Knobs (environment): SHAPE (0.5b | 1.5b | tiny), CASES (e.g. share_0 share_50 share_100 low_share: the break-even),
# VARIANTS (traj traj_tree traj_auto), REPEATS, ROWS_ATTENTION (skip the choice), PROFILE=1 (one more
# update per variant under torch's profiler: $OUT/profile/<case>_<variant>.txt, the tree stages' seconds in the JSON:
# where the tree update loses against its token ratio), DEVICE (cuda | cpu:
# the CPU dry run, with PYTHON, WHL and SITE pointing at a CPU interpreter and its wheels), DEADLINE.
set -u -o pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = "--download" ]; then # the wheels (one list for every GPU script: scripts/gpu_bundle.py)
  grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >>.git/info/exclude
  exec "${PYTHON:-python3}" scripts/gpu_bundle.py download --set update --dest .whl
fi

OUT="${OUT:-gpu_out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
PY="${PYTHON:-$(command -v python3 || command -v python)}"
WHL="${WHL:-.whl}"
SITE="${SITE:-/tmp/site}"
DEVICE="${DEVICE:-cuda}"
SHAPE="${SHAPE:-0.5b}"
CASES="${CASES:-gspo shared_prompt}"
CASE_LIMIT="${CASE_LIMIT:-170}" # seconds for each case but the last (the last gets all that is left)
REPEATS="${REPEATS:-3}"
DEADLINE="${DEADLINE:-390}"
WORK="${WORK:-/tmp/gpu_update_ab}"
export PYTHONPATH="$SITE:$PWD"
SUMMARY="$OUT/summary.txt"
LOG="$OUT/bench_update.log"
: >"$SUMMARY"
: >"$LOG"
mkdir -p "$WORK"
rm -f "$WORK"/case_*.json # a warm machine keeps $WORK: only this call's cases are reported
exec 3>&1 # stage messages: to the console, never into a result file

# shellcheck source=scripts/gpu_stages.sh
. scripts/gpu_stages.sh  # stage, left
cap() { local l; l=$(left); [ "$l" -lt 1 ] && l=1; [ "$1" -lt "$l" ] && echo "$1" || echo "$l"; } # min(own, left), >= 1

write_ray_stub() { # DIR: DIR/ray/__init__.py (see its docstring)
  mkdir -p "$1/ray"
  cat >"$1/ray/__init__.py" <<'EOF'
"""A stand-in for Ray, for a machine without it (written by scripts/gpu_update_ab.sh; never part of the package).

verl imports ray at module level (verl/protocol.py, the single controller, the trainers, TransferQueue) but the actor
update that scripts/bench_update.py drives builds verl's engine worker in-process, without Ray. Every name resolves
(ray.X, ray.a.b.C, `from ray.x import Y`) to a stub class: usable as a base class, in annotations (`ray.ObjectRef |
None`) and in isinstance checks (never true). ray.remote / ray.method decorate to the object itself (a class gets
``__ray_actor_class__`` = itself); ray.is_initialized() is False. Calling anything else raises RuntimeError naming
it, so no code path runs on a fake Ray unnoticed.
"""
import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+stub"
STUB = True
_DECORATORS = {"remote", "method"}
_CACHE = {}


def _actor(obj):
    if isinstance(obj, type) and "__ray_actor_class__" not in obj.__dict__:
        obj.__ray_actor_class__ = obj
    return obj


class _StubMeta(type):
    def __getattr__(cls, name):
        if name.startswith("__") or "_ray_stub_name" not in cls.__dict__:
            raise AttributeError(name)
        return _stub(f"{cls._ray_stub_name}.{name}")

    def __call__(cls, *args, **kwargs):
        if "_ray_stub_name" not in cls.__dict__:  # a class deriving from a stub: an ordinary class
            return super().__call__(*args, **kwargs)
        leaf = cls._ray_stub_name.rsplit(".", 1)[-1]
        if leaf in _DECORATORS:
            return _actor(args[0]) if len(args) == 1 and not kwargs and callable(args[0]) else _actor
        if leaf == "is_initialized":
            return False
        raise RuntimeError(f"{cls._ray_stub_name}() called, but ray here is a stub (no Ray on this machine)")


def _stub(name):
    if name not in _CACHE:
        _CACHE[name] = _StubMeta(name.rsplit(".", 1)[-1], (), {"_ray_stub_name": name, "__module__": "ray"})
    return _CACHE[name]


class _Module(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _stub(f"{self.__name__}.{name}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True) if fullname.startswith("ray.") else None

    def create_module(self, spec):
        return _Module(spec.name)

    def exec_module(self, module):
        module.__path__ = []


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return _stub(f"ray.{name}")


sys.meta_path.append(_Finder())
EOF
}

# 1. facts, install, imports
{
  date -u
  [ "$DEVICE" = cuda ] && { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || echo "nvidia-smi failed"; }
  echo "wheels: $(ls "$WHL" | tr '\n' ' ')"
} >"$OUT/env.txt" 2>&1
stage install 90 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
  "$WHL"/*.whl >>"$OUT/env.txt" 2>&1
rm -rf "$SITE/tests" "$SITE/scripts" # verl's wheel ships top-level tests/ and scripts/ packages
"$PY" -c "import ray" 2>/dev/null || { write_ray_stub "$SITE" && echo "ray: stub written to $SITE/ray" >>"$OUT/env.txt"; }
stage imports "$(cap 90)" "$PY" - >>"$OUT/env.txt" 2>&1 <<'EOF'
import importlib, sys, time
t0 = time.time()
import torch, transformers, tensordict, ray
import verl, verl_traj
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "transformers",
      transformers.__version__, "tensordict", tensordict.__version__, "verl", verl.__version__,
      "ray", "stub" if getattr(ray, "STUB", False) else ray.__version__)
print("cuda available", torch.cuda.is_available(), torch.cuda.get_device_name() if torch.cuda.is_available() else "")
try:
    import flash_attn
    print("flash_attn", flash_attn.__version__)
except Exception as e:
    print("flash_attn: not importable:", type(e).__name__)
for m in ("verl.workers.engine_workers", "verl.workers.engine.fsdp.transformer_impl", "verl.workers.utils.losses",
          "verl.utils.seqlen_balancing", "verl.workers.utils.padding", "verl_traj.testing.engine",
          "verl_traj.testing.trainers", "verl_traj.integration.workers.engine_workers", "verl_traj.integration.workers.losses",
          "verl_traj.integration.tree.tree_forward", "verl_traj.core.kernels.tree_flex"):
    importlib.import_module(m)
print(f"import verl, verl_traj and the update's modules: ok ({time.time() - t0:.1f}s)")
EOF
cat "$OUT/env.txt"

# 2. the model and the rows attention
cat >"$WORK/model_check.py" <<'EOF'
"""A randomly initialised Qwen2 of a real model's shape (no hub: built from its config, saved bf16, with the tiny
byte-level tokenizer of verl_traj.cpu.build_tiny); then each rows-attention candidate on verl's remove-padding layout
(rows packed into one sequence, position ids restarting per row, no attention mask) against each row forwarded alone
(sdpa, unpadded: the exact reference): max |log-prob error| in fp32 and bf16, with a backward through the packed
forward (a candidate must train). The choice: the first candidate within tolerance in both."""
import argparse, json, time
from pathlib import Path

import torch

SHAPES = {"0.5b": (896, 4864, 24, 14, 2, 151936), "1.5b": (1536, 8960, 28, 12, 2, 151936),  # Qwen2.5's shapes
          "tiny": (128, 384, 2, 4, 2, 2048)}  # (hidden, intermediate, layers, heads, kv heads, vocab); tiny: CPU
TOL = {"float32": 2e-3, "bfloat16": 0.25}


def build(out, shape, device):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from verl_traj.cpu.build_tiny import build_tokenizer

    hidden, inter, layers, heads, kv, vocab = SHAPES[shape]
    tok = build_tokenizer(out, 512, 0)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=32768, rope_theta=1e6,
                      rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=tok.pad_token_id,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(cfg)
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    return {"shape": shape, "parameters": sum(p.numel() for p in model.parameters()), "hidden": hidden,
            "intermediate": inter, "layers": layers, "heads": heads, "kv_heads": kv, "vocab": vocab}


def logprobs(model, ids, pos):
    logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits.float()
    return torch.log_softmax(logits[0, :-1], -1).gather(-1, ids[0, 1:, None])[:, 0]


def check(out, device, impl, rows, dtype, ref):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out, dtype=dtype, attn_implementation=impl).to(device)
    ids = torch.cat(rows)[None].to(device)
    pos = torch.cat([torch.arange(len(r)) for r in rows])[None].to(device)
    lp = logprobs(model, ids, pos)
    lp.sum().backward()
    offs = [0, *torch.tensor([len(r) for r in rows]).cumsum(0).tolist()]
    return max(float((lp[o:o + len(r) - 1].detach() - x).abs().max()) for o, r, x in zip(offs, rows, ref))


def main():
    from transformers import AutoModelForCausalLM

    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--shape", default="0.5b", choices=list(SHAPES))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--impls", nargs="+", default=["sdpa", "flex_attention"])
    ap.add_argument("--lengths", nargs="+", type=int, default=[300, 517, 129, 1000])
    ap.add_argument("--report", type=Path, required=True)
    ap.add_argument("--choice", type=Path, required=True)
    a = ap.parse_args()
    t0 = time.perf_counter()
    report = {"model": build(a.out, a.shape, a.device), "build_s": round(time.perf_counter() - t0, 1), "checks": {}}
    print(json.dumps(report), flush=True)
    vocab = report["model"]["vocab"]
    rows = [torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(n)) for n in a.lengths]
    for dtype in (torch.float32, torch.bfloat16):
        ref_model = AutoModelForCausalLM.from_pretrained(a.out, dtype=dtype, attn_implementation="sdpa").to(a.device)
        with torch.no_grad():
            ref = [logprobs(ref_model, r[None].to(a.device), torch.arange(len(r), device=a.device)[None]) for r in rows]
        del ref_model
        res = report["checks"][str(dtype).split(".")[-1]] = {}
        for impl in a.impls:
            t1 = time.perf_counter()
            try:
                err = check(a.out, a.device, impl, rows, dtype, ref)
                res[impl] = {"max_abs_err": err, "ok": err <= TOL[str(dtype).split(".")[-1]]}
            except Exception as e:  # a candidate that cannot run (or train) here is reported, not fatal
                res[impl] = {"error": f"{type(e).__name__}: {e}"[:400], "ok": False}
            res[impl]["seconds"] = round(time.perf_counter() - t1, 1)
            print(dtype, impl, json.dumps(res[impl]), flush=True)
    ok = [i for i in a.impls if all(c[i]["ok"] for c in report["checks"].values())]
    report["chosen"] = ok[0] if ok else "sdpa"
    a.report.write_text(json.dumps(report, indent=2))
    a.choice.write_text(report["chosen"])
    print("rows attention:", report["chosen"], flush=True)


if __name__ == "__main__":
    main()
EOF
echo "=== model_check" >>"$LOG"
# the rows' attention is what stock verl runs here: flash-attn's kernel (verl's default) where it is installed, else
# sdpa (what a stock user sets without flash-attn); flex_attention only where neither is exact on the packed layout
IMPLS="sdpa flex_attention"
"$PY" -c "import flash_attn" 2>/dev/null && IMPLS="flash_attention_2 $IMPLS"
stage model "$(cap 120)" "$PY" "$WORK/model_check.py" "$WORK/model" --shape "$SHAPE" --device "$DEVICE" \
  --impls $IMPLS --report "$OUT/model_check.json" --choice "$WORK/rows_attention" >>"$LOG" 2>&1
grep -E '^(\{|torch\.|rows attention)' "$LOG"
ROWS="${ROWS_ATTENTION:-$(cat "$WORK/rows_attention" 2>/dev/null || echo sdpa)}"
echo "rows attention: $ROWS" | tee -a "$SUMMARY"

# 3. the update A/B, one process per case (a failed case leaves the others' results)
report() { # merge the per-case JSONs -> bench_update.json, the table + ratios -> bench_update.txt
  "$PY" - "$WORK" "$OUT" "$DEVICE" "$SHAPE" <<'EOF'
import glob, json, os, sys
sys.path.insert(0, "scripts")
import bench_update as b

work, out, device, shape = sys.argv[1:5]
merged = {"config": None, "results": {}, "model": None, "rows_attention_by_case": {}}
for f in sorted(glob.glob(os.path.join(work, "case_*.json"))):
    text = open(f).read()  # verl prints to stdout too: the report is the JSON at the end
    try:
        r = json.loads(text[text.rfind('{\n  "config"'):])
    except ValueError:
        continue
    cases = (merged["config"] or {}).get("cases", {})
    merged["config"] = {**r["config"], "cases": {**cases, **r["config"]["cases"]}}
    merged["results"].update(r["results"])
    merged["rows_attention_by_case"].update({k: r["config"].get("rows_attention") for k in r["results"]})
if os.path.exists(os.path.join(out, "model_check.json")):
    merged["model"] = json.load(open(os.path.join(out, "model_check.json")))["model"]
json.dump(merged, open(os.path.join(out, "bench_update.json"), "w"), indent=2)
if not merged["results"]:
    sys.exit("no case finished")
c, m = merged["config"], merged["model"] or {}
precision = ("bf16 mixed precision (verl's FSDP2 defaults, gradient checkpointing)" if device == "cuda" else
             "fp32 (the CPU platform)")
kernel = "compiled flex" if device == "cuda" else "the blocked tree kernel"
lines = [f"actor update on {device} ({c.get('gpu')}), torch {c.get('torch')}, dp=1, remove-padding, {precision}; "
         f"log-probs: {c.get('logprobs')}; model: random Qwen2 {shape} (hidden "
         f"{m.get('hidden')}, {m.get('layers')} layers, heads {m.get('heads')}/{m.get('kv_heads')}, vocab {m.get('vocab')}); "
         f"rows attention {c.get('rows_attention')} (stock, stock_v0, traj), tree attention {c.get('tree_attention')} "
         f"-> {kernel} (traj_tree); median of {c['repeats']} (alternating, after one warm-up each)", "",
         b._table(merged), ""]
for case, res in merged["results"].items():
    if "traj_tree" in res and "traj" in res:
        t, r, s = res["traj_tree"], res["traj"], res["stock"]
        lines.append(f"{case} (rows attention {merged['rows_attention_by_case'].get(case)}): traj_tree / traj {b._paired(t['seconds_all'], r['seconds_all']):.2f}x, traj_tree / stock "
                     f"{b._paired(t['seconds_all'], s['seconds_all']):.2f}x, traj / stock "
                     f"{b._paired(r['seconds_all'], s['seconds_all']):.2f}x (s/update, median of per-repeat ratios); tokens "
                     f"forwarded: tree {t.get('tree_tokens') or 0:,.0f} vs rows {r['row_tokens']:,} "
                     f"({(t.get('tree_tokens') or 0) / max(r['row_tokens'], 1):.2f}x)")
open(os.path.join(out, "bench_update.txt"), "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
EOF
}
set -- $CASES
while [ $# -gt 0 ]; do
  name=$1
  shift
  limit=$(left)
  [ $# -gt 0 ] && limit=$(cap "$CASE_LIMIT")
  if [ "$limit" -lt 60 ]; then
    echo "bench_$name skipped: ${limit}s left" | tee -a "$SUMMARY"
    continue
  fi
  echo "=== bench $name (rows attention $ROWS)" >>"$LOG"
  stage "bench_$name" "$limit" "$PY" scripts/bench_update.py --device "$DEVICE" --dp 1 --model "$WORK/model" \
    --remove-padding --tree --rows-attention "$ROWS" --cases "$name" --variants ${VARIANTS:-traj traj_tree traj_auto} --repeats "$REPEATS" \
    --home "$WORK/home" ${PROFILE:+--profile "$OUT/profile"} --json >"$WORK/case_$name.json" 2>>"$LOG"
  rc=$?
  if [ "$rc" -ne 0 ]; then
    tail -n 25 "$LOG"
    # a timeout (124 / 137: compile time, not a flex failure) keeps the rows' attention
    if [ "$rc" -ne 124 ] && [ "$rc" -ne 137 ] && [ "$ROWS" = flex_attention ] && [ -z "${ROWS_ATTENTION:-}" ]; then
      ROWS=sdpa # flex rows failed in the engine: the remaining cases on sdpa, then this one again (in the summary)
      echo "rows attention -> sdpa (flex_attention failed in bench_$name; it runs again last)" | tee -a "$SUMMARY"
      set -- "$@" "$name"
    fi
  fi
  report >/dev/null 2>>"$LOG"
done
report 2>&1 | tail -n 30

echo "total ${SECONDS}s" >>"$SUMMARY"
echo "=== summary ($OUT/summary.txt)"
cat "$SUMMARY"
! grep -q -E 'rc=[1-9]' "$SUMMARY"
