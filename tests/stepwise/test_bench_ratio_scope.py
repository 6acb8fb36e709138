"""scripts/bench_ratio_scope.py (row vs trajectory vs length-normalised trajectory IS weights, through verl's and
verl_traj's real correction) and verl_traj.stepwise.ratio_scope_advice (the closed form behind a start-up warning)."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask as verl_correction

from verl_traj.stepwise.ratio_scope_advice import (CRITICAL_LOG_WEIGHT_VARIANCE, degenerates, expected_ess,
                                                   expected_trajectory_ess, max_loss_tokens, spread_from_chi2_token,
                                                   truncated_weight_moments)
from verl_traj.stepwise.ratios import trajectory_rollout_correction
from verl_traj.stepwise.timeline import Timeline
from verl_traj.testing.swebench import DATA_FILE

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_ratio_scope.py"
needs_data = pytest.mark.skipif(not DATA_FILE.exists(), reason="shared benchmark data not present")


@pytest.fixture(scope="module")
def bench():
    """The script as a module (scripts/ is not a package); one torch thread, as the script runs (a shared CPU)."""
    spec = importlib.util.spec_from_file_location("bench_ratio_scope", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_ratio_scope"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield module
    torch.set_num_threads(threads)
    sys.modules.pop("bench_ratio_scope", None)


@pytest.fixture(scope="module")
def quick(bench):
    """``--quick --json`` on 4- and 100-turn synthetic agents and 32 real trajectories, three spreads."""
    return bench.run(["--quick", "--json", "--turns", "4", "100", "--spreads", "0.005", "0.02", "0.05"])


@needs_data
def test_json_has_every_workload_spread_and_scope(bench, quick, capsys):
    records = quick["records"]
    assert {r["workload"] for r in records} == {"4-turn", "100-turn", "swebench"}
    keys = {(r["workload"], r["spread"], r["scope"]) for r in records}
    assert len(keys) == len(records) == 3 * 3 * 3
    for r in records:
        assert {"ess", "ess_model", "w_min", "w_median", "w_max_raw", "truncated_share", "rejected_seq_is_rs",
                "rejected_geo_rs", "loss_tokens_per_trajectory_median", "trajectories", "rows"} <= r.keys()
        assert 0 < r["ess"] <= 1 + 1e-9 and 0 <= r["truncated_share"] <= 1
        assert 0 <= r["rejected_seq_is_rs"] <= 1 and 0 <= r["rejected_geo_rs"] <= 1
        assert math.exp(-20) * 0.99 <= r["w_min"] <= r["w_median"] <= 2.0  # verl's clamp and truncation
    assert bench.main(["--quick", "--turns", "4", "--spreads", "0.01", "--real-limit", "4", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["config"]["rollout_is_threshold"] == 2.0 and len(printed["records"]) == 2 * 3


@needs_data
def test_trajectory_scope_spreads_more_than_row_scope_on_long_agents(quick):
    """On 100-turn and real agents the trajectory weight (the product of its rows') has a lower ESS than the rows'
    own at every spread, and falls with the spread; the length-normalised weight stays within the truncation bound
    with an ESS of ~1 and rejects nothing at [0.5, 2]."""
    by = {(r["workload"], r["spread"], r["scope"]): r for r in quick["records"]}
    for workload in ("100-turn", "swebench"):
        ess = [by[(workload, s, "trajectory")]["ess"] for s in (0.005, 0.02, 0.05)]
        assert ess == sorted(ess, reverse=True)
        for s in (0.005, 0.02, 0.05):
            assert by[(workload, s, "trajectory")]["ess"] < by[(workload, s, "row")]["ess"]
    for (workload, s, scope), r in by.items():
        if scope == "trajectory-geo":
            assert r["w_max_raw"] <= 2.0 and r["ess"] > 0.99 and r["rejected_seq_is_rs"] == 0
            assert r["rejected_geo_rs"] == by[(workload, s, "trajectory")]["rejected_geo_rs"]


def _fixed_batch(bench, trajectories: int, turns: int, tokens: int, spread: float, seed: int = 0):
    """Equal trajectories as step rows: ``(lengths, traj [B], step [B], mask [B, R], old_log_prob [B, R])``, the
    log-ratios i.i.d. ``N(-s^2/2, s^2)`` against a zero rollout log-prob."""
    lengths = [np.full(turns, tokens) for _ in range(trajectories)]
    traj, step, mask = bench.row_batch(lengths)
    old = bench.place(mask, torch.randn(int(mask.sum()), generator=torch.Generator().manual_seed(seed)) * spread
                      - 0.5 * spread * spread)
    return lengths, traj, step, mask, old


def test_the_scopes_statistics_are_verls_own(bench):
    """One chunk: the script's token-weighted ESS equals verl's ``rollout_is_eff_sample_size`` at both scopes (row:
    verl on the rows; trajectory: verl on the timeline), and the geometric weight's [0.5, 2] rejection equals verl's
    ``seq_mean_k1`` at ``0.5_2.0`` run on the timeline."""
    _, traj, step, mask, old = _fixed_batch(bench, 40, 3, 4, spread=1.2)
    zeros = torch.zeros_like(old)
    row = bench.summarise(bench.row_scope(old, mask))
    _, _, metrics = verl_correction(old, zeros, mask, **bench.CORRECTION)
    assert row["ess"] == pytest.approx(metrics["rollout_corr/rollout_is_eff_sample_size"], rel=1e-4)
    whole, geo = bench.trajectory_scopes(old, mask, traj, step)
    timeline = Timeline.build(traj, step, mask)
    got = trajectory_rollout_correction(verl_correction, timeline, old, zeros, mask, **bench.CORRECTION)
    assert bench.summarise(whole)["ess"] == pytest.approx(got.metrics["rollout_corr/rollout_is_eff_sample_size"],
                                                          rel=1e-4)
    geo_rs = trajectory_rollout_correction(verl_correction, timeline, old, zeros, mask, rollout_is=None,
                                           rollout_rs="seq_mean_k1", rollout_rs_threshold="0.5_2.0")
    want = 1 - float(geo_rs.response_mask.sum() / mask.sum())
    assert 0 < want < 1 and bench.summarise(geo)["rejected_seq_is_rs"] == pytest.approx(want, abs=1e-6)


@pytest.mark.parametrize("variance", [0.3, 1.0, 3.0])
def test_measured_trajectory_ess_matches_the_closed_form(bench, variance):
    """2,000 equal trajectories of 4 x 25 loss tokens through the real path: the trajectory-scope ESS is
    ``expected_trajectory_ess(100, s)``; the rows' (25 tokens each) is ``expected_ess`` of the rows."""
    s = math.sqrt(variance / 100)
    lengths = [np.full(4, 25) for _ in range(2000)]
    units = bench.run_workload(lengths, s, torch.Generator().manual_seed(1))
    assert bench.summarise(units["trajectory"])["ess"] == pytest.approx(expected_trajectory_ess(100, s), abs=0.03)
    assert bench.summarise(units["row"])["ess"] == pytest.approx(expected_ess([25] * 8000, s), abs=0.02)


# ---- verl_traj.stepwise.ratio_scope_advice ----------------------------------------------------------------------


@pytest.mark.parametrize("variance", [0.05, 1.0, 4.0])
def test_truncated_moments_match_monte_carlo(variance):
    x = np.random.default_rng(0).normal(-variance / 2, math.sqrt(variance), 1_000_000)
    w = np.minimum(np.exp(x), 2.0)
    m1, m2 = truncated_weight_moments(variance, 2.0)
    assert m1 == pytest.approx(w.mean(), rel=5e-3) and m2 == pytest.approx((w * w).mean(), rel=1e-2)
    assert truncated_weight_moments(variance, 1e12) == pytest.approx((1.0, math.exp(variance)), rel=1e-9)


def test_expected_ess_limits_and_mixtures():
    assert expected_trajectory_ess(10_000, 0.0) == 1.0 and expected_ess([], 0.1) == 1.0
    ess = [expected_trajectory_ess(n, 0.01) for n in (10, 1_000, 10_000, 100_000, 10**7)]
    assert ess == sorted(ess, reverse=True) and ess[-1] < 1e-50  # no overflow far into the tail
    assert expected_ess([500, 500, 500], 0.02) == pytest.approx(expected_trajectory_ess(500, 0.02), rel=1e-12)
    assert expected_trajectory_ess(1.0, 1.0, threshold=1e12) == pytest.approx(math.exp(-1.0), rel=1e-9)


def test_degeneration_threshold():
    """ESS 0.5 at tokens x s^2 = v* ~ 1.95 (c = 2); ``degenerates`` flips there; 36-turn SWE-bench agents (median
    7,866 loss tokens) cross it between s = 0.01 and 0.02."""
    assert CRITICAL_LOG_WEIGHT_VARIANCE == pytest.approx(1.95, abs=0.01)
    assert expected_trajectory_ess(CRITICAL_LOG_WEIGHT_VARIANCE, 1.0) == pytest.approx(0.5, abs=1e-9)
    for s in (0.005, 0.01, 0.02, 0.05):
        n = max_loss_tokens(s)
        assert n * s * s == pytest.approx(CRITICAL_LOG_WEIGHT_VARIANCE)
        assert degenerates(1.01 * n, s) and not degenerates(0.99 * n, s)
    assert max_loss_tokens(0.0) == math.inf and max_loss_tokens(0.01, min_ess=0.8) < max_loss_tokens(0.01)
    assert not degenerates(7866, 0.01) and degenerates(7866, 0.02) and degenerates(22_000, 0.01)


def test_spread_from_chi2_token():
    for s in (0.0, 0.01, 0.3):
        assert spread_from_chi2_token(math.expm1(s * s)) == pytest.approx(s, abs=1e-12)
    assert spread_from_chi2_token(-1e-9) == 0.0


@pytest.mark.parametrize("step_wise, rollout_is, says", [
    (False, None, "has no effect without traj.step_wise=true"),  # one row a trajectory: nothing to widen
    (True, "sequence", "expected ESS"),  # a product over 8,192 loss tokens degenerates
    (True, "token", ""),  # token ratios do not compound
])
def test_the_start_up_warning_names_what_traj_ratio_scope_trajectory_does_here(step_wise, rollout_is, says):
    from omegaconf import OmegaConf

    from verl_traj.config import TrajConfig
    from verl_traj.integration.startup.checks import ratio_scope_warning

    config = OmegaConf.create({"data": {"max_response_length": 8192},
                               "algorithm": {"rollout_correction": {"rollout_is": rollout_is}}})
    warning = ratio_scope_warning(TrajConfig(step_wise=step_wise, ratio_scope="trajectory"), config)
    assert (says in warning) if says else warning == ""
    assert ratio_scope_warning(TrajConfig(step_wise=step_wise, ratio_scope="row"), config) == ""
