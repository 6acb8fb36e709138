"""``scripts/bench_async_bias.py`` on a short calculator-shaped run (issue 43): verl's replay buffer with verl_traj's
policies, on the simulated clock, ranks the staleness policies as docs/trainers.md reports: a bound that drops trains
a shorter sample than the agent's, one that defers is unbiased and slower, ``correct`` bounds every token's lag,
trains what no bound trains, and hands over to its fallback where the weights' health says so. The simulation swaps the buffer's TransferQueue for a dict only while it
samples (the real module is back afterwards)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(SCRIPTS))
    try:
        spec = importlib.util.spec_from_file_location("bench_async_bias", SCRIPTS / "bench_async_bias.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # its dataclasses look their module up
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(SCRIPTS))
        sys.modules.pop("bench_async_bias", None)
        sys.modules.pop("async_sim", None)


def test_the_policies_rank_as_documented(bench):
    """Issue 53, item 5: ``correct`` is a bound. Its oldest trained token is at most ``traj.max_lag`` behind where no
    bound passes it; on every steady step its weights are healthy by the gate's statistics or the batch was sampled in
    fallback; with ``defer`` it trains at least 99% of the tokens no bound trains on the same sampling, where a
    dropping bound loses more. At a drift no weight survives (0.1 per version and token: M2 0.1 at lag 1) the gate
    opens and the fallback governs the steps."""
    from verl.trainer.ppo.v1 import replay_buffer

    real_tq = replay_buffer.tq
    args = type("Args", (), {"steps": 16, "batch": 16, "n": 4, "seed": 0, "caps": [1]})
    workload = bench.calc()
    names = ("none", "traj drop (1.0)", "traj correct (1.0, lag 1, defer)")
    runs = {name: bench.run(workload, "separate_async", name, "drop", args, drift=1e-3) for name in names}
    assert replay_buffer.tq is real_tq
    none, correct = runs["none"], runs["traj correct (1.0, lag 1, defer)"]
    assert runs["traj drop (1.0)"]["tokens trained"] < 0.99 * none["tokens trained"]
    assert none["lag max"] > 1 >= correct["lag max"]
    assert correct["healthy or fallback"] >= 0.95 and correct["fallback"] == 0  # healthy: no needless fallback
    assert correct["tokens trained"] >= 0.99 * none["tokens trained"]
    assert correct["bias lower"] <= correct["bias upper"]
    wild = bench.run(workload, "separate_async", "traj correct (1.0, lag 1, defer)", "drop", args, drift=0.1)
    assert wild["fallback"] > 0.5 and wild["healthy or fallback"] >= 0.95 and wild["lag max"] <= 1
    assert wild["tokens trained"] >= 0.99 * none["tokens trained"]  # defer waits, never discards


def test_timeouts_cut_the_long_trajectories_and_the_logged_bracket_sees_it(bench):
    """``--timeout-s``: the sessions still running at the deadline fail as ``timeout`` (censored in traj_bias): the
    pooled bracket's lower end sits below the true ratio's neighbourhood, its upper end below 1."""
    args = type("Args", (), {"steps": 12, "batch": 16, "n": 4, "seed": 0, "timeout_s": 20.0, "caps": [4]})
    run = bench.run(bench.calc(), "separate_async", "none", "keep_survivors", args, 1e-9)
    assert run["dropped"] > 0 and run["tokens ratio"] < 0.95 and run["bias upper"] < 0.97
    assert run["bias lower"] <= run["tokens ratio"] + 0.02


def test_json_output_carries_every_run(bench, capsys):
    assert bench.main(["--workload", "calc", "--modes", "sync", "--steps", "6", "--batch", "4", "--drifts", "1e-3",
                       "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {(r["mode"], r["staleness"], r["failures"].split(" ")[0]) for r in out["results"]} == {
        ("sync", "none", "-"), ("sync", "none", "drop"), ("sync", "none", "keep_survivors")}
