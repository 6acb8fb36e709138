"""The agent's hard length budget read from verl's config (``v1_metrics.length_budget``) and the v1 step's
``traj_bias/*`` bracket it gives a lower end (``length_bias_metrics``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import verl
from omegaconf import OmegaConf
from transfer_queue import KVBatchMeta

from verl_traj.config import TrajConfigError
from verl_traj.core.rollout.length_bias import LengthBudget, Lengths
from verl_traj.core.rollout.session_ledger import LENGTH_TAG
from verl_traj.integration.trainers.v1_metrics import length_bias_metrics, length_budget

ROLLOUT_YAML = Path(verl.__file__).parent / "trainer" / "config" / "rollout" / "rollout.yaml"


def _config(max_response_length: int = 64, **multi_turn):
    """verl's own rollout section (its defaults: ``response_length`` from ``data.max_response_length``,
    ``multi_turn.max_assistant_turns: null``), with ``multi_turn`` overrides."""
    rollout = OmegaConf.load(ROLLOUT_YAML)
    rollout.multi_turn.update(multi_turn)
    return OmegaConf.create({"data": {"max_response_length": max_response_length},
                             "actor_rollout_ref": {"rollout": rollout}})


def test_the_budget_is_turns_times_each_calls_response_length_and_unknown_without_a_turn_limit():
    assert length_budget(_config(64, max_assistant_turns=5)) == LengthBudget(tokens=320.0, turns=5.0)
    assert length_budget(_config(64)) == LengthBudget()  # verl's default: no turn limit, nothing bounds a trajectory
    assert length_budget(_config(64, max_assistant_turns=0)) == LengthBudget()  # 0: verl's "no limit" too
    assert length_budget(OmegaConf.create({})) == LengthBudget()
    with pytest.raises(TrajConfigError, match="actor_rollout_ref.rollout.multi_turn.max_assistant_turns"):
        length_budget(_config(64, max_assistant_turns=-1))


def test_a_v1_step_logs_the_bracket_with_the_budget_and_only_the_upper_end_without():
    """Trained 100, 60 and 20 tokens; a timeout cut one at 150 (past every finished length): the lower end puts it at
    the budget, 5 calls x 64 tokens = 320; the upper end counts it at 150."""
    keys = ["u1_0_0", "u1_0_1", "u1_1_0", "u2_0_0", "pad_0_0"]
    tags = [{}, {LENGTH_TAG: [100, 4]}, {LENGTH_TAG: [60, 2]}, {LENGTH_TAG: [20, 1]}, {"is_padding": True}]
    meta = KVBatchMeta(keys=keys, tags=tags, partition_id="train")
    cut = {"timeout": Lengths.of([150], [3])}
    out = length_bias_metrics(meta, cut, length_budget(_config(64, max_assistant_turns=5)))
    assert out["traj_bias/tokens_mean_ratio"] == pytest.approx(60 / (330 / 4))
    assert out["traj_bias/tokens_mean_ratio_lower"] == pytest.approx(60 / (500 / 4))
    assert out["traj_bias/turns_mean_ratio_lower"] == pytest.approx((7 / 3) / (12 / 4))
    assert out["traj_bias/timeout_censored_share"] == 0.25 and out["traj_bias/upper_bound_only"] == 1.0
    plain = length_bias_metrics(meta, cut)
    assert "traj_bias/tokens_mean_ratio_lower" not in plain
    assert plain["traj_bias/tokens_mean_ratio"] == out["traj_bias/tokens_mean_ratio"]
