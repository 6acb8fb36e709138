"""``scripts/gpu_e2e.sh``'s dry run (issue 41, item 4): the whole GRPO run a GPU machine without a package index gets,
checked here without one. The bundle of wheels fits one device call (and its Ray is Ray without the parts it drops);
every stage's command line is the run the docs describe; and the same stages run on CPU with 2 steps on the calculator
recipe (``DEVICE=cpu``: the CPU presets, Ray linked as the bundle carries it), the tree default against rows.

The CPU run is also the suite's calculator-recipe run, as CI runs the recipe: offline preparation (the
``recipe_home`` fixture), then real GRPO steps through ``verl_traj.main_ppo --config-name calc_agent_cpu``: verl's
tool_agent loop calling the calculator, the recipe's reward, verl_traj's planner and workers. The quick start (the same
task with step-wise rows) runs from the installed wheel: ``test_packaging.py``."""

from __future__ import annotations

import json
import os
import subprocess
import zipfile

import pytest

from tests.e2e.runs import REPO, read_metrics, skip_on_accelerator

pytestmark = pytest.mark.e2e
SCRIPT = ["bash", str(REPO / "scripts" / "gpu_e2e.sh")]
STEPS = 2


def test_the_bundle_fits_one_device_call(tmp_path):
    """``--download`` (PyPI): verl, its import-time needs, Ray without its Java jars and unused libraries, and
    verl_traj's own wheel; under 64 MiB with the working tree."""
    whl = tmp_path / "whl"
    run = subprocess.run([*SCRIPT, "--download"], env={**os.environ, "WHL": str(whl)}, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    manifest = json.loads(run.stdout[run.stdout.index("{"):])
    assert manifest["fits"] and manifest["total_mib"] <= 58, manifest["total_mib"]
    names = set(manifest["wheels"])
    for dist in ("ray-2.60.0-cp312", "verl-0.9.1", "verl_traj-", "jsonschema-", "transferqueue-", "tensordict-"):
        assert any(n.startswith(dist) for n in names), (dist, sorted(names))
    ray = zipfile.ZipFile(next(whl.glob("ray-*.whl")))
    files = ray.namelist()
    assert not any(f.startswith(("ray/jars/", "ray/rllib/", "ray/data/", "ray/dashboard/client/")) for f in files)
    assert "ray/_raylet.so" in files and any(f.startswith("ray/core/src/ray/gcs/") for f in files)
    record = next(f for f in files if f.count("/") == 1 and f.endswith(".dist-info/RECORD"))
    assert {line.split(",")[0] for line in ray.read(record).decode().splitlines()} == set(files)


def _lines(*args: str, **env: str) -> dict[str, str]:
    run = subprocess.run([*SCRIPT, "--dry-run", *args], env={**os.environ, **env}, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    return {line.split("]")[0].lstrip("["): line for line in run.stdout.splitlines()}


def test_the_gpu_command_lines():
    """On the GPU: the wheels installed offline into a site directory, the recipe's data, a random Qwen2 of
    Qwen2.5-0.5B's shape, and three runs of the GPU recipe: trees and rows, which differ only in the prefix tree (and,
    without flash-attn, in the attention: the flash-attention path in torch for trees, sdpa for rows), and stock verl
    (traj.enable=false) with the attention a stock user runs there (sdpa without flash-attn)."""
    lines = _lines()
    assert list(lines) == ["install", "imports", "data", "model", "run_tree", "run_rows", "run_stock"]
    assert "--no-index --no-deps" in lines["install"] and ".whl_e2e" in lines["install"]
    assert "--data-only" in lines["data"] and "[896, 4864, 24, 14, 2]" in lines["model"]
    tree, rows = lines["run_tree"], lines["run_rows"]
    for line in (tree, rows):
        assert "--config-name calc_agent_gpu" in line and "trainer.total_training_steps=10" in line
        assert "actor_rollout_ref.rollout.name=cpu" in line and "rollout.dtype=bfloat16" in line
    assert "traj.prefix_tree" not in tree and "traj.prefix_tree=false" in rows
    assert "attn_implementation=torch_varlen" in tree and "attn_implementation=sdpa" in rows  # no flash-attn here
    stock = lines["run_stock"]  # stock verl with the attention a stock user runs without flash-attn
    assert "traj.enable=false" in stock and "attn_implementation=sdpa" in stock and "traj.prefix_tree" not in stock
    def overrides(line: str) -> set:  # the run's hydra overrides but the attention
        return {t for t in line.split("verl_traj.main_ppo")[1].split() if "attn_implementation" not in t}

    assert overrides(stock) == overrides(tree) | {"traj.enable=false"}


@pytest.fixture(scope="module")
def cpu_dry_run(recipe_home, tmp_path_factory):
    skip_on_accelerator()
    work = tmp_path_factory.mktemp("gpu_e2e")
    home = recipe_home / "calc_agent"
    run = subprocess.run([*SCRIPT, "--model", str(home / "model"), "--calc-home", str(home)],
                         env={**os.environ, "DEVICE": "cpu", "STEPS": str(STEPS), "OUT": str(work / "out"),
                              "WORK": str(work / "work"), "SITE": str(work / "site"), "DEADLINE": "900"},
                         capture_output=True, text=True, timeout=960)
    return run, work / "out"


def test_the_dry_run_trains_the_tree_default_and_rows_on_cpu(cpu_dry_run):
    """Both runs finish their 2 steps through the stripped Ray; the default took trees, rows none; the same first
    gradient; fewer tokens a pass on trees; the actor's log-probs are the rollout's."""
    run, out = cpu_dry_run
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    assert f"ray from {out.parent / 'site' / 'ray' / '__init__.py'}" in run.stdout  # the bundle's Ray, not the venv's
    result = json.loads((out / "gpu_e2e.json").read_text())
    tree, rows = result["runs"]["tree"], result["runs"]["rows"]
    assert tree["steps"] == rows["steps"] == STEPS
    assert tree["tree_share"] == 1.0 and rows["tree_share"] == 0.0
    assert result["tree_over_rows"]["grad_norm_step1_rel_diff"] < 1e-5
    assert tree["tokens_per_pass"] < rows["tokens_per_pass"]
    assert max(tree["rollout_probs_diff_max"], rows["rollout_probs_diff_max"]) < 1e-4
    assert (out / "gpu_e2e.txt").read_text().startswith("run ")
    assert all(line.split()[1] == "rc=0" for line in (out / "summary.txt").read_text().splitlines()[:-1])


def test_calc_agent_recipe_trains_on_cpu(cpu_dry_run):
    """The recipe's own checks, on the default path (the tree run)."""
    run, out = cpu_dry_run
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    metrics = read_metrics(out / "metrics_tree.jsonl")
    assert len(metrics) == STEPS
    for m in metrics:
        # the tool loop really ran: assistant + tool turns beyond a single reply (user + assistant = 2)
        assert m["num_turns/mean"] > 2.0 and m["num_turns/max"] >= 4, m
        # the recipe's reward is bounded: 1.0 correct, else 0.1 * answer tag + 0.5 * call progress
        assert 0.0 <= m["critic/score/min"] and m["critic/score/max"] <= 1.0
        # verl_traj: groups whole, the configured optimizer steps (train_batch_size 8 / mini 4, 2 epochs)
        assert m["traj_plan/split_groups"] == 0 and m["traj_plan/split_trajectories"] == 0
        assert m["actor/num_optimizer_steps"] == 4
        assert m["actor/grad_norm"] > 0
