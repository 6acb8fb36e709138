"""The CPU end-to-end tests' building blocks: verl's two trainers as overrides, shared override sets, one training
run launched as a subprocess (:func:`launch`: whole-process-tree peak memory, verl's file-logger metrics), and
helpers to read and stop runs. The fixtures built on them are in ``conftest.py``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import pytest

REPO = Path(__file__).resolve().parents[2]

# verl's two trainers: v1 (``verl/trainer/ppo/v1``, verl 0.9's default) and the deprecated v0 ``RayPPOTrainer``
TRAINERS = {"v1": ["trainer.use_v1=true"], "v0": ["trainer.use_v1=false"]}
# Every e2e check runs on v1; the core checks (two ranks with padding and a token cap, step-wise rows) also on v0.
# The remaining v0 variants repeat a v1 run on the deprecated trainer (~1-4 min each): opt in with
# VERL_TRAJ_TEST_V0=1 so the default suite stays under 30 minutes on 2 cores.
V0_OPT_IN = pytest.mark.skipif(os.environ.get("VERL_TRAJ_TEST_V0") != "1",
                               reason="v0 repeat of a v1 e2e run: set VERL_TRAJ_TEST_V0=1")
TRAINERS_V0_OPT_IN = ["v1", pytest.param("v0", marks=V0_OPT_IN)]
# One rank, PPO on cpu_tiny_ppo (GAE, a critic, a reference model with KL loss): train_batch_size 8 / actor
# ppo_mini_batch_size 4 = 2 mini-batches, 2 actor epochs; the critic's mini-batch of 8 prompts (1 step: the union
# of the actor's two); the trained actor exported as HF weights at the end. Shared by the plan checks
# (test_traj_training), the PPO checks (test_ppo_training) and the real-work checks (test_cpu_training).
ONE_RANK_CONFIG = "cpu_tiny_ppo"


def one_rank_ppo(trainer: str, steps: int = 2) -> list[str]:
    return [*TRAINERS[trainer], f"trainer.total_training_steps={steps}", "actor_rollout_ref.actor.ppo_epochs=2",
            "critic.ppo_mini_batch_size=8", f"trainer.save_freq={steps}",
            "actor_rollout_ref.actor.checkpoint.save_contents=[model,hf_model]"]


# Two ranks, two mini-batches of 3 prompt groups x 3 rows: 9 rows per mini-batch, so each needs a padding row.
DP2_PADDED = ["trainer.n_gpus_per_node=2", "data.train_batch_size=6", "actor_rollout_ref.actor.ppo_mini_batch_size=3",
              "actor_rollout_ref.rollout.n=3"]
# ... under a token cap that cuts several micro-batches per rank
DP2_CAP = 160
# ... as PPO (GAE, a critic, KL loss), the critic's mini-batch of 6 prompts the union of the actor's two
DP2_CONFIG = "cpu_tiny_ppo"


# verl's remove-padding path (the GPU users' mode: flash-attn varlen there; on CPU transformers' sdpa with the
# block-diagonal mask of packed position ids, or cpu_varlen under the prefix tree) for actor, reference and critic:
# the CPU presets' default since issue 41 (so traj.prefix_tree=auto takes trees), spelled out where a test relies on it
REMOVE_PADDING = ["actor_rollout_ref.model.use_remove_padding=true", "critic.model.use_remove_padding=true"]
# verl's padded path (rows of one length, sdpa on CPU), and so rows, not prefix trees
PADDED = ["actor_rollout_ref.model.use_remove_padding=false", "critic.model.use_remove_padding=false"]


# Ulysses sequence parallelism over the two ranks (one data-parallel rank), actor and critic, as a user types it (no
# attention override): verl's Ulysses code (the all-to-all around flash-attention's varlen call) on the CPU platform's
# torch varlen attention, which start-up selects for Ulysses (verl_traj/integration/startup/cpu_settings.py)
ULYSSES_2 = ["trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
             "critic.ulysses_sequence_parallel_size=2", "critic.fsdp.ulysses_sequence_parallel_size=2", *REMOVE_PADDING]


# bf16 compute, fp32 parameters and reductions (verl's GPU default mixed precision) for actor, reference and critic
BF16 = ["actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=bf16",
        "actor_rollout_ref.ref.fsdp_config.mixed_precision.param_dtype=bf16", "critic.fsdp.mixed_precision.param_dtype=bf16"]


def dp2_reference(trainer: str, dp: int = 2) -> list[str]:
    """Overrides of :data:`DP2_CONFIG` for the 3-step two-rank PPO run with padding rows and a token cap, on verl's
    remove-padding path, that the plan checks (test_traj_training), the PPO checks (test_ppo_training), the
    reproducibility test (its uninterrupted run) and the dp1-vs-dp2 gradient test all read (one launch per trainer
    through the ``shared_run`` fixture). ``dp=1``: the same run on one rank, on the padded path (so the gradient test
    compares both the layout and the attention path)."""
    layout = [*DP2_PADDED, *REMOVE_PADDING] if dp == 2 else [
        *(o for o in DP2_PADDED if not o.startswith("trainer.n_gpus_per_node")), *PADDED]
    # rows: the plan checks read the row planner's micro-batches (traj.prefix_tree=auto would take trees here)
    return [*TRAINERS[trainer], *layout, f"traj.micro_batch_max_tokens={DP2_CAP}", "critic.ppo_mini_batch_size=6",
            "traj.prefix_tree=false", "trainer.total_training_steps=3"]


def tree_rss(root_pids: list[int], exclude: set[int] = frozenset(), names: dict = None) -> dict[int, int]:
    """RSS in bytes of every process in the trees under ``root_pids`` (pids in ``exclude`` left out); ``names``, if
    given, gets each pid's command line, as of this sample (Ray names its workers' processes ``ray::<Actor>``)."""
    import psutil

    rss: dict[int, int] = {}
    for pid in root_pids:
        try:
            procs = [psutil.Process(pid)]
            procs += procs[0].children(recursive=True)
        except psutil.Error:
            continue
        for p in procs:
            if p.pid in rss or p.pid in exclude:
                continue
            try:
                rss[p.pid] = p.memory_info().rss
                if names is not None:  # re-read: Ray retitles a worker (ray::<Actor>) once it has started
                    names[p.pid] = " ".join(p.cmdline())[:160] or p.name()
            except psutil.Error:
                pass
    return rss


def tree_rss_bytes(root_pids: list[int], exclude: set[int] = frozenset()) -> int:
    return sum(tree_rss(root_pids, exclude).values())


def steps_logged(metrics_path: Path) -> int:
    """Training steps verl's file logger has written so far (one line a step)."""
    try:
        with open(metrics_path, "rb") as f:
            return sum(1 for line in f if line.strip())
    except OSError:
        return 0


@dataclass
class RssSample:
    seconds: float
    steps_done: int
    rss: dict  # pid -> bytes


class MemorySampler:
    """Samples the RSS of every process in the trees under ``root_pids`` every ``interval`` seconds: the peak of their
    sum, and (with ``metrics_path``) every sample with the number of steps logged by then (:attr:`samples`)."""

    def __init__(self, root_pids: list[int], interval: float = 0.5, exclude: set[int] = frozenset(),
                 metrics_path: Path = None):
        self.root_pids = list(root_pids)
        self.interval = interval
        self.exclude = set(exclude)
        self.metrics_path = metrics_path
        self.peak = 0
        self.samples: list[RssSample] = []
        self.names: dict[int, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        t0 = time.time()
        while not self._stop.is_set():
            rss = tree_rss(self.root_pids, self.exclude, self.names)
            self.peak = max(self.peak, sum(rss.values()))
            if self.metrics_path is not None:
                self.samples.append(RssSample(time.time() - t0, steps_logged(self.metrics_path), rss))
            self._stop.wait(self.interval)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(timeout=5)


@dataclass
class TrainingRun:
    returncode: int
    output: str
    metrics: list[dict] = field(default_factory=list)  # one dict per step
    peak_rss_bytes: int = 0
    wall_seconds: float = 0.0
    workdir: Path = None  # metrics.jsonl, train.log, ckpt/ (and dump/ for shared runs)
    rss_samples: list = field(default_factory=list)  # RssSample: every process's RSS with the steps logged by then
    process_names: dict = field(default_factory=dict)  # pid -> its command (ray::<Actor> for Ray's workers)

    def tail(self, n: int = 80) -> str:
        return "\n".join(self.output.splitlines()[-n:])

    def series(self, key: str) -> list[float]:
        return [m[key] for m in self.metrics if key in m]


def read_metrics(path: Path) -> list[dict]:
    rows = []
    if not path.exists():
        return rows
    for line in path.read_text().splitlines():
        line = line.strip()
        if line:
            rec = json.loads(line)
            rows.append({"step": rec.get("step"), **rec.get("data", {})})
    return rows


def skip_on_accelerator() -> None:
    from verl_traj.cpu.detect import accelerator_present

    if accelerator_present():
        pytest.skip("the CPU e2e tests target machines without an accelerator")


def launch(home: Path, workdir: Path, overrides: list[str], timeout: float = 300, extra_roots: list[int] = (),
           extra_env: dict = None, config_name: str = "cpu_tiny") -> TrainingRun:
    """``python -m verl_traj.main_ppo --config-name <config_name> <overrides>`` in ``workdir``, with verl's file logger
    writing ``workdir/metrics.jsonl``; killed (whole process tree) after ``timeout`` seconds."""
    metrics_path = workdir / "metrics.jsonl"
    env = dict(os.environ)
    env.update({
        "VERL_TRAJ_HOME": str(Path(home).parent),  # the presets read $VERL_TRAJ_HOME/tiny
        "VERL_FILE_LOGGER_PATH": str(metrics_path),
        "VERL_TRAJ_CKPT_DIR": str(workdir / "ckpt"),
        "PYTHONUNBUFFERED": "1",
        "RAY_DEDUP_LOGS": "0",
    })
    env.update(extra_env or {})
    cmd = [sys.executable, "-m", "verl_traj.main_ppo", "--config-name", config_name,
           "trainer.logger=[console,file]", *overrides]
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=str(workdir), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    with MemorySampler([proc.pid, *extra_roots], exclude={os.getpid()}, metrics_path=metrics_path) as sampler:
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_tree(proc.pid)
            out, _ = proc.communicate()
            out += f"\n[test] TIMEOUT after {timeout}s"
    (workdir / "train.log").write_text(out)
    return TrainingRun(proc.returncode, out, read_metrics(metrics_path), sampler.peak, time.time() - t0, workdir,
                       sampler.samples, sampler.names)


def kill_tree(pid: int) -> None:
    import psutil

    try:
        parent = psutil.Process(pid)
        procs = parent.children(recursive=True) + [parent]
    except psutil.Error:
        return
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass


def tail(text: str, n: int = 60) -> str:
    return "\n".join(text.splitlines()[-n:])


def start_run(home: Path, workdir: Path, metrics: Path, ckpt: Path, overrides: list[str], config_name: str,
              extra_env: dict = None) -> subprocess.Popen:
    """``python -m verl_traj.main_ppo`` started in its own session (so ``os.killpg`` reaches everything it starts),
    metrics to ``metrics``, checkpoints under ``ckpt``; finish it with :func:`finish_run`."""
    env = dict(os.environ, VERL_TRAJ_HOME=str(home.parent), VERL_FILE_LOGGER_PATH=str(metrics), VERL_TRAJ_CKPT_DIR=str(ckpt),
               PYTHONUNBUFFERED="1", RAY_DEDUP_LOGS="0", **(extra_env or {}))
    cmd = [sys.executable, "-m", "verl_traj.main_ppo", "--config-name", config_name, "trainer.logger=[console,file]",
           *overrides]
    workdir.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(cmd, cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def finish_run(proc: subprocess.Popen, timeout: float = 420) -> str:
    """Wait for a :func:`start_run` process; asserts it succeeded; returns its output."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        out, _ = proc.communicate()
    assert proc.returncode == 0, tail(out, 80)
    return out


def logged_steps(path: Path) -> list[int]:
    """Steps in a metrics file being written: a line still half-written counts as not logged yet."""
    try:
        return [m["step"] for m in read_metrics(path)]
    except json.JSONDecodeError:
        return []


def kill_after_checkpoint(proc: subprocess.Popen, ckpt: Path, metrics: Path, step: int, timeout: float = 400,
                          when: Optional[Callable[[dict], bool]] = None) -> str:
    """SIGKILL the run's whole process group once step ``step`` (with ``when``: the first step from ``step`` on whose
    logged metrics satisfy it) is both checkpointed (completion marker) and logged (verl saves before it logs:
    regression, CI once killed between the two); asserts it got there. Returns the run's output."""
    done = False
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        try:
            logged = read_metrics(metrics)
        except json.JSONDecodeError:  # a line still half-written: not logged yet
            logged = []
        wanted = [m["step"] for m in logged if (m["step"] >= step and when(m) if when else m["step"] == step)]
        done = any(any(ckpt.rglob(f"global_step_{s}/verl_traj_complete")) for s in wanted[:1])
        if done:
            break
        time.sleep(0.05)
    assert done, f"the run never completed its step-{step} checkpoint and metrics" + (" as asked" if when else "")
    os.killpg(proc.pid, signal.SIGKILL)
    kill_tree(proc.pid)
    return proc.communicate()[0]


def rss_slopes(samples: list, after_step: int) -> dict[int, float]:
    """Per process: the least-squares slope of its RSS against the steps logged, in MiB per step, over the samples
    taken once ``after_step`` steps were logged (warm-up excluded); processes seen in fewer than 10 such samples
    (short-lived helpers) are left out."""
    import numpy as np

    by_pid: dict[int, list[tuple[int, int]]] = {}
    for s in samples:
        if s.steps_done >= after_step:
            for pid, rss in s.rss.items():
                by_pid.setdefault(pid, []).append((s.steps_done, rss))
    slopes = {}
    for pid, points in by_pid.items():
        steps, rss = np.array(points, dtype=np.float64).T
        if len(points) >= 10 and steps.max() > steps.min():
            slopes[pid] = float(np.polyfit(steps, rss / 2**20, 1)[0])
    return slopes


RECORDING_LOOP = "verl_traj.integration.agent_loops.stepwise_agent_loop.StepwiseToolAgentLoop"


def run_stepwise(tiny, tmp_path, trainer: str, merge: bool, *, config_name: str = "cpu_tiny", steps: int = 2,
                 extra: tuple = (), loop: str = RECORDING_LOOP) -> tuple[list[dict], str]:
    """A step-wise run (``traj.step_wise=true``) on the tiny tool-calling model, verl's tool agent loop re-pointed to
    ``loop`` (a recording loop), v0 on two ranks; returns the per-step metrics and the log."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    yaml_path = tmp_path / "agent_loops.yaml"
    # verl's tool_agent name re-pointed to the step-recording loop (the dataset routes rows to "tool_agent")
    yaml_path.write_text(f"- name: tool_agent\n  _target_: {loop}\n")
    metrics_path = tmp_path / "metrics.jsonl"
    env = dict(os.environ, VERL_TRAJ_HOME=str(tiny.parent), VERL_FILE_LOGGER_PATH=str(metrics_path),
               VERL_TRAJ_CKPT_DIR=str(tmp_path / "ckpt"), PYTHONUNBUFFERED="1", RAY_DEDUP_LOGS="0")
    cmd = [
        sys.executable, "-m", "verl_traj.main_ppo", "--config-name", config_name,
        f"actor_rollout_ref.rollout.agent.agent_loop_config_path={yaml_path}",
        f"trainer.total_training_steps={steps}", "trainer.logger=[console,file]",
        f"actor_rollout_ref.model.path={tiny}/model_tool",
        f"data.train_files={tiny}/data/tool_train.parquet", f"data.val_files={tiny}/data/tool_test.parquet",
        "data.max_prompt_length=192", "data.max_response_length=64",
        "actor_rollout_ref.rollout.multi_turn.enable=true",
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=3",
        "actor_rollout_ref.rollout.multi_turn.format=hermes",
        f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tiny}/tool_config.yaml",
        "traj.step_wise=true", f"traj.merge_prefix={str(merge).lower()}", *TRAINERS[trainer], *extra,
        # v0 on two ranks: its _balance_batch expands, plans and pads for dp=2 (v0's two-rank plan test is opt-in)
        *(["trainer.n_gpus_per_node=2"] if trainer == "v0" else []),
    ]
    run = subprocess.run(cmd, cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=900)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-6000:]
    metrics = [json.loads(line)["data"] for line in metrics_path.read_text().splitlines() if line.strip()]
    assert len(metrics) == steps, out[-3000:]
    return metrics, out
