"""One whole GRPO training run through ``python -m verl_traj.main_ppo`` on one GPU: the default path (prefix trees,
``traj.prefix_tree: auto``) side by side with rows (``traj.prefix_tree=false``) and with stock verl
(``traj.enable=false``, the attention stock verl runs on the machine: :func:`stock_attention`), for a GPU machine
without a package index. Called by ``scripts/gpu_e2e.sh`` (usage there); the standard library only, until the bundle is installed.

What runs: the calculator recipe's data (``verl_traj.recipes.calc_agent.prepare --data-only``), a randomly initialised
Qwen2 made on the spot (:data:`SHAPES`; the recipe's tokenizer), the project's torch rollout server (rollout name
``cpu``, generating on the GPU where the CPU platform is off: ``verl_traj/cpu/rollout.py``), verl's FSDP2 engine with
NCCL on one GPU and verl's bf16 mixed precision (``configs/calc_agent_gpu.yaml``); without flash-attn the actor's
attention is ``torch_varlen`` for the tree run (the flash-attention path in torch: ``cpu/torch_flash.py``)
and sdpa for the rows and stock runs; with it, flash-attn's for all three. ``DEVICE=cpu``: the same stages on the CPU presets (``calc_agent_cpu``; Ray as the bundle
carries it, linked from this interpreter's: ``gpu_bundle.py strip-installed``), the suite's dry run.

Per run it reports the step time (after the first step), the actor update's time, the tokens one pass forwards, the
rollout-vs-actor log-prob gap, step 1's gradient norm, the largest |ppo_kl| and the reward per step; and the tree run
against the rows run and against stock (whole step and update). Results in ``$OUT``: ``gpu_e2e.json``, ``gpu_e2e.txt``, each run's ``metrics_<run>.jsonl`` and
the last 400 lines of its log, ``summary.txt`` (each stage's exit code and seconds).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the default (traj.prefix_tree: auto -> trees), rows, and stock verl (traj.enable=false) with the attention stock
# verl runs on the machine (flash_attention_2, verl's default, where flash-attn is installed, else sdpa)
RUNS = ("tree", "rows", "stock")
# (hidden, intermediate, layers, heads, kv heads): Qwen2.5-0.5B's shape; tiny for the CPU dry run
SHAPES = {"0.5b": (896, 4864, 24, 14, 2), "tiny": (64, 128, 2, 4, 2)}
GPU_BATCH = ["data.train_batch_size=16", "actor_rollout_ref.actor.ppo_mini_batch_size=8", "actor_rollout_ref.rollout.n=4",
             "data.max_prompt_length=256", "data.max_response_length=256",
             "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=3",
             "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=8192", "traj.micro_batch_max_tokens=8192"]
# the suite's calculator-recipe run (tests/e2e/test_gpu_e2e_dry_run.py): half the recipe's batch, its mini-batches
CPU_BATCH = ["data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
             "actor_rollout_ref.rollout.temperature=0.7"]

IMPORTS = r"""
import importlib.util, sys, time
t0 = time.time()
import torch, transformers, ray, verl, verl_traj
from verl_traj.cpu.plugin import register
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "transformers",
      transformers.__version__, "ray", ray.__version__, "verl", verl.__version__, "ray from", ray.__file__)
print("cuda available", torch.cuda.is_available(), torch.cuda.get_device_name() if torch.cuda.is_available() else "")
print("flash_attn", importlib.util.find_spec("flash_attn") is not None, "cpu platform", register())
print(f"imports ok ({time.time() - t0:.1f}s)")
"""

MODEL = r"""
import json, sys
from pathlib import Path
import torch
from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM
from verl_traj.recipes.calc_agent.prepare import recipe_tokenizer

out, (hidden, inter, layers, heads, kv) = Path(sys.argv[1]), json.loads(sys.argv[2])
out.mkdir(parents=True, exist_ok=True)
tok = recipe_tokenizer(out, seed=0)
cfg = Qwen2Config(vocab_size=(len(tok) + 63) // 64 * 64, hidden_size=hidden, intermediate_size=inter,
                  num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                  max_position_embeddings=4096, rope_theta=1e6, tie_word_embeddings=True, use_sliding_window=False,
                  bos_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
torch.manual_seed(0)
model = Qwen2ForCausalLM(cfg)
model.generation_config = GenerationConfig(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, do_sample=True)
model.save_pretrained(out, safe_serialization=True)
print(json.dumps({"model": str(out), "parameters": sum(p.numel() for p in model.parameters())}))
"""


@dataclass
class Settings:
    device: str = "cuda"
    steps: int = 10
    shape: str = "0.5b"
    out: Path = Path("gpu_out")
    work: Path = Path("/tmp/gpu_e2e")
    site: Path = Path("/tmp/site_e2e")
    whl: Path = ROOT / ".whl_e2e"
    deadline: int = 560  # seconds: nothing starts after it, nothing runs past it
    model: Path | None = None  # an existing model instead of a random one
    calc_home: Path | None = None  # an existing prepared recipe home instead of --data-only
    python: str = sys.executable
    overrides: list = field(default_factory=list)  # appended to every run
    runs: tuple = RUNS  # which of RUNS (the CPU dry run: tree and rows)

    @property
    def home(self) -> Path:
        return self.calc_home or self.work / "calc_agent"

    @property
    def model_path(self) -> Path:
        return self.model or self.work / "model"


@dataclass
class Stage:
    name: str
    argv: list
    env: dict = field(default_factory=dict)
    share: float = 0.0  # of the time left when it starts (0: a fixed cap of 180 s)
    log: str = ""  # file under work for its output ("" -> the summary's console)


def stock_attention(run: str) -> str:
    """A GPU run's ``attn_implementation``: flash-attn's kernel wherever it is installed (verl's default); without it
    stock verl gets sdpa (what a stock user sets), verl_traj's rows sdpa and its trees the flash-attention path in torch
    (``torch_varlen``, where the tree kernel sits)."""
    if importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    return "torch_varlen" if run == "tree" else "sdpa"


def run_overrides(s: Settings, run: str) -> list[str]:
    """The hydra overrides of one run (``tree``: the default path; ``rows``: traj.prefix_tree=false; ``stock``:
    traj.enable=false, stock verl)."""
    common = [f"actor_rollout_ref.model.path={s.model_path}", f"data.train_files={s.home}/data/train.parquet",
              f"data.val_files={s.home}/data/test.parquet", f"trainer.total_training_steps={s.steps}",
              "trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.save_freq=-1",
              "trainer.logger=[console,file]", "trainer.n_gpus_per_node=1"]
    if s.device == "cpu":
        device = CPU_BATCH
    else:
        attention = stock_attention(run)
        device = [*GPU_BATCH, "actor_rollout_ref.rollout.name=cpu", "actor_rollout_ref.rollout.dtype=bfloat16",
                  "actor_rollout_ref.rollout.checkpoint_engine.backend=naive",
                  f"+actor_rollout_ref.model.override_config.attn_implementation={attention}"]
    own = {"tree": [], "rows": ["traj.prefix_tree=false"], "stock": ["traj.enable=false"]}[run]
    return [*common, *device, *own, *s.overrides]


def _env(s: Settings, **extra: str) -> dict:
    return {"PYTHONPATH": f"{s.site}:{ROOT}", "PYTHONUNBUFFERED": "1", "RAY_DEDUP_LOGS": "0",
            "VERL_TRAJ_HOME": str(s.home.parent), **extra}


def stages(s: Settings) -> list[Stage]:
    py = s.python
    if s.device == "cpu":
        install = Stage("install", [py, str(ROOT / "scripts/gpu_bundle.py"), "strip-installed", str(s.site)])
    else:
        wheels = sorted(str(p) for p in s.whl.glob("*.whl")) or [f"{s.whl}/*.whl (none: bash scripts/gpu_e2e.sh --download)"]
        install = Stage("install", [py, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                                    "--upgrade", "--target", str(s.site), *wheels])
    out = [install, Stage("imports", [py, "-c", IMPORTS], _env(s))]
    if s.calc_home is None:
        out.append(Stage("data", [py, "-m", "verl_traj.recipes.calc_agent.prepare", "--home", str(s.home), "--data-only",
                                  "--n-train", "512", "--n-test", "16"], _env(s)))
    if s.model is None:
        out.append(Stage("model", [py, "-c", MODEL, str(s.model_path), json.dumps(SHAPES[s.shape])], _env(s)))
    config = "calc_agent_cpu" if s.device == "cpu" else "calc_agent_gpu"
    for i, run in enumerate(s.runs):
        run_dir = s.work / run
        env = _env(s, VERL_FILE_LOGGER_PATH=str(run_dir / "metrics.jsonl"), VERL_TRAJ_CKPT_DIR=str(run_dir / "ckpt"))
        out.append(Stage(f"run_{run}", [py, "-m", "verl_traj.main_ppo", "--config-name", config,
                                        *run_overrides(s, run)], env, share=1.0 / (len(s.runs) - i), log=f"{run}.log"))
    return out


def _execute(stage: Stage, s: Settings, limit: float) -> int:
    """Run one stage in its own process group, killed (group and Ray) after ``limit`` seconds."""
    log = open(s.work / stage.log, "w") if stage.log else None
    if stage.log:
        (s.work / stage.name.removeprefix("run_")).mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(stage.argv, cwd=ROOT, env={**os.environ, **stage.env}, stdout=log, stderr=subprocess.STDOUT
                            if log else None, start_new_session=True)
    try:
        return proc.wait(timeout=max(limit, 1))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        subprocess.run([s.python, "-m", "ray.scripts.scripts", "stop", "--force"], env={**os.environ, **stage.env},
                       capture_output=True, timeout=60)
        return 124
    finally:
        if log:
            log.close()


def _metrics(path: Path) -> list[dict]:
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [{"step": r.get("step"), **r.get("data", {})} for r in rows]


def _mean(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def summarise(metrics: list[dict]) -> dict:
    """One run's figures (module doc); the first step's time is left out of the step and update times."""
    later = metrics[1:] or metrics

    def col(key: str, rows: list = metrics) -> list:
        return [m.get(key) for m in rows]

    tree = [m for m in metrics if m.get("actor/tree_share")]
    tokens = (_mean(col("actor/tree_infer_tokens", tree)) if tree else
              _mean([(m.get("traj_plan/tokens") or 0) + (m.get("traj_plan/padding_tokens") or 0) for m in metrics]))
    return {"steps": len(metrics), "step_s": _mean(col("timing_s/step", later)),
            "update_actor_s": _mean(col("timing_s/update_actor", later)), "tree_share": _mean(col("actor/tree_share")),
            "tokens_per_pass": tokens, "row_tokens_per_pass": _mean(col("traj_plan/tokens")),
            "rollout_probs_diff_max": max([v for v in col("training/rollout_probs_diff_max") if v is not None],
                                          default=None),
            "rollout_probs_diff_mean": _mean(col("training/rollout_probs_diff_mean")),
            "grad_norm_step1": metrics[0].get("actor/grad_norm") if metrics else None,
            "ppo_kl_abs_max": max([abs(v) for v in col("actor/ppo_kl") if v is not None], default=None),
            "reward_per_step": col("critic/score/mean"), "turns_mean": _mean(col("num_turns/mean"))}


def _ratio(a, b) -> float | None:
    return a / b if a is not None and b else None


def _over(t: dict, r: dict) -> dict:
    """The tree run against another: step, update and tokens per pass as ratios, step 1's gradient norm's gap."""
    gap = (abs(t["grad_norm_step1"] - r["grad_norm_step1"]) / max(abs(r["grad_norm_step1"]), 1e-12)
           if t["grad_norm_step1"] is not None and r["grad_norm_step1"] is not None else None)
    return {"step_s": _ratio(t["step_s"], r["step_s"]), "update_actor_s": _ratio(t["update_actor_s"], r["update_actor_s"]),
            "tokens_per_pass": _ratio(t["tokens_per_pass"], r["tokens_per_pass"]), "grad_norm_step1_rel_diff": gap}


def report(s: Settings) -> dict:
    runs = {run: summarise(_metrics(s.work / run / "metrics.jsonl")) for run in s.runs}
    out = {"device": s.device, "steps": s.steps, "shape": s.shape if s.model is None else str(s.model), "runs": runs,
           **{f"tree_over_{base}": _over(runs["tree"], runs[base]) for base in ("rows", "stock") if base in runs}}
    lines = [f"{'run':6} {'steps':>5} {'step s':>8} {'update s':>9} {'tree':>5} {'tokens/pass':>12} {'lp gap max':>11} "
             f"{'grad1':>10} {'|ppo_kl|':>9}  reward per step"]
    for run, f in runs.items():
        fmt = lambda v, spec: format(v, spec) if v is not None else "-"  # noqa: E731
        lines.append(f"{run:6} {f['steps']:>5} {fmt(f['step_s'], '8.2f')} {fmt(f['update_actor_s'], '9.2f')} "
                     f"{fmt(f['tree_share'], '5.2f')} {fmt(f['tokens_per_pass'], '12,.0f')} "
                     f"{fmt(f['rollout_probs_diff_max'], '11.2e')} {fmt(f['grad_norm_step1'], '10.4g')} "
                     f"{fmt(f['ppo_kl_abs_max'], '9.1e')}  {' '.join(fmt(v, '.3f') for v in f['reward_per_step'])}")
    for base in ("rows", "stock"):
        ratios = out.get(f"tree_over_{base}") or {}
        lines.append(f"tree / {base}: " + ", ".join(f"{k} {v:.3g}" for k, v in ratios.items() if v is not None))
    out["table"] = "\n".join(lines)
    return out


def settings(argv=None) -> tuple[Settings, bool]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    env = os.environ
    ap.add_argument("--dry-run", action="store_true", help="print every stage's command line and exit")
    ap.add_argument("--device", default=env.get("DEVICE", "cuda"), choices=("cuda", "cpu"))
    ap.add_argument("--steps", type=int, default=int(env.get("STEPS", 10)))
    ap.add_argument("--shape", default=env.get("SHAPE"), choices=sorted(SHAPES), help="default: 0.5b, tiny on CPU")
    ap.add_argument("--out", type=Path, default=Path(env.get("OUT", "gpu_out")))
    ap.add_argument("--work", type=Path, default=Path(env.get("WORK", "/tmp/gpu_e2e")))
    ap.add_argument("--site", type=Path, default=Path(env.get("SITE", "/tmp/site_e2e")))
    ap.add_argument("--whl", type=Path, default=Path(env.get("WHL", ROOT / ".whl_e2e")))
    ap.add_argument("--deadline", type=int, default=int(env.get("DEADLINE", 560)))
    ap.add_argument("--model", type=Path, help="an existing model directory instead of a random one")
    ap.add_argument("--calc-home", type=Path, help="an existing prepared calculator-recipe home (data/ in it)")
    ap.add_argument("--runs", nargs="+", choices=RUNS, default=env.get("RUNS", "").split() or None,
                    help="which runs (default: all three on cuda, tree and rows on cpu); env RUNS")
    ap.add_argument("overrides", nargs="*", help="hydra overrides appended to every run")
    a = ap.parse_args(argv)
    shape = a.shape or ("tiny" if a.device == "cpu" else "0.5b")
    runs = tuple(a.runs or (RUNS if a.device == "cuda" else ("tree", "rows")))
    if "tree" not in runs:
        ap.error(f"--runs {' '.join(runs)}: the tree run is what the others are compared with; add tree")
    return Settings(a.device, a.steps, shape, a.out, a.work, a.site, a.whl, a.deadline, a.model, a.calc_home,
                    os.environ.get("PYTHON", sys.executable), a.overrides, runs), a.dry_run


def main(argv=None) -> int:
    s, dry = settings(argv)
    plan = stages(s)
    if dry:
        for stage in plan:
            env = " ".join(f"{k}={shlex.quote(v)}" for k, v in stage.env.items())
            argv = [a if "\n" not in a else "<script>" for a in stage.argv]
            print(f"[{stage.name}] {env} {shlex.join(argv)}".replace("  ", " "))
        return 0
    for path in (s.out, s.work, s.site):
        path.mkdir(parents=True, exist_ok=True)
    t0, failed, summary = time.time(), [], []
    for stage in plan:
        left = s.deadline - (time.time() - t0)
        limit = left * stage.share if stage.share else min(180.0, left)
        if left < 30 or (stage.share and limit < 60):
            summary.append(f"{stage.name} skipped: {left:.0f}s left")
            failed.append(stage.name)
            continue
        print(f"=== [{stage.name}] (limit {limit:.0f}s, t={time.time() - t0:.0f}s)", flush=True)
        t1 = time.time()
        rc = _execute(stage, s, limit)
        summary.append(f"{stage.name} rc={rc} seconds={time.time() - t1:.0f}{' (TIMED OUT)' if rc == 124 else ''}")
        print(f"=== [{stage.name}] rc={rc} in {time.time() - t1:.0f}s", flush=True)
        if rc:
            failed.append(stage.name)
            if not stage.name.startswith("run_"):
                break  # nothing after a failed install, import, data or model stage can run
    for run in s.runs:
        for src, dest in ((s.work / run / "metrics.jsonl", s.out / f"metrics_{run}.jsonl"), (s.work / f"{run}.log", s.out / f"{run}.log")):
            if src.exists():
                lines = src.read_text(errors="replace").splitlines()
                dest.write_text("\n".join(lines if src.suffix == ".jsonl" else lines[-400:]) + "\n")
    result = report(s)
    (s.out / "gpu_e2e.json").write_text(json.dumps(result, indent=1))
    (s.out / "gpu_e2e.txt").write_text(result["table"] + "\n")
    (s.out / "summary.txt").write_text("\n".join([*summary, f"total {time.time() - t0:.0f}s"]) + "\n")
    print(result["table"], "\n" + "\n".join(summary), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
