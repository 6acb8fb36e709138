"""The planned update's contract, built once for both trainers (issue 42, item 2): every flag derived in
:func:`~verl_traj.integration.trainers.update_contract.update_contract`, from the update spec and the plan's facts;
the trainers only move it into their batch types (their paths: test_traj_trainer_unit, test_v1_transfer_queue)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from verl_traj.config import TrajConfig
from verl_traj.core.keys import (CRITIC_UNION_KEY, LOSS_WEIGHT, OLD_LOG_PROBS_AT_START, PLANNED_FIELDS, RATIO_GROUP,
                                 RATIO_IN_LOSS, TREE_KEY, planned_update_fields)
from verl_traj.integration.config.update_spec import LossSpec, UpdateSpec
from verl_traj.integration.trainers.update_contract import ACTOR, CRITIC, loss_of, pass_markers, update_contract

SPEC = UpdateSpec(traj_config=TrajConfig(), plan=None, prompts_per_update=4, num_mini_batches=2, epochs=1,
                  parameter_sync_step=1, actor_loss=LossSpec("token-mean", 16.0),
                  critic_loss=LossSpec("token-mean", 16.0, union=2))
GSPO = dataclasses.replace(SPEC, trajectory_ratios=True, ratio_groups=True)
ONE_ROW_EACH = torch.tensor([0, 1, 2, -1]), torch.tensor([False, False, False, True])
TWO_ROWS = torch.tensor([0, 0, 1, -1]), torch.tensor([False, False, False, True])


def _contract(spec, role, rows, **kw):
    return update_contract(spec, role, torch.ones(4), *rows, **{"all_atomic": False, **kw})


def test_the_actor_carries_ratio_groups_only_for_gspo_with_a_trajectory_of_several_rows():
    assert RATIO_GROUP not in _contract(SPEC, ACTOR, TWO_ROWS).fields
    assert RATIO_GROUP not in _contract(GSPO, ACTOR, ONE_ROW_EACH).fields  # one row: its ratio is its trajectory's
    contract = _contract(GSPO, ACTOR, TWO_ROWS)
    assert torch.equal(contract.fields[RATIO_GROUP], TWO_ROWS[0]) and contract.fields[RATIO_GROUP] is not TWO_ROWS[0]
    assert contract.planned == planned_update_fields(ratio_groups=True)
    assert RATIO_GROUP not in _contract(GSPO, CRITIC, TWO_ROWS).fields  # the critic has no ratio


def test_gspo_takes_its_ratio_from_the_loss_only_where_the_plan_kept_every_trajectory_whole():
    assert _contract(GSPO, ACTOR, TWO_ROWS, all_atomic=True).markers[RATIO_IN_LOSS] is True
    assert RATIO_IN_LOSS not in _contract(GSPO, ACTOR, TWO_ROWS).markers  # the pre-pass runs
    assert RATIO_IN_LOSS not in _contract(SPEC, ACTOR, TWO_ROWS, all_atomic=True).markers  # no ratio groups


def test_the_critic_says_its_union_and_every_update_its_planned_fields_and_old_log_probs():
    critic, actor = _contract(SPEC, CRITIC, ONE_ROW_EACH), _contract(SPEC, ACTOR, ONE_ROW_EACH)
    assert critic.markers[CRITIC_UNION_KEY] == 2 and CRITIC_UNION_KEY not in actor.markers
    for contract in (critic, actor):
        assert contract.markers[PLANNED_FIELDS] == ",".join(planned_update_fields())
        assert contract.markers[OLD_LOG_PROBS_AT_START] is True and set(contract.fields) == {LOSS_WEIGHT}


def test_roles_and_pass_markers():
    assert loss_of(SPEC, CRITIC).union == 2 and loss_of(SPEC, ACTOR).union == 1
    with pytest.raises(ValueError, match="critic"):
        loss_of(dataclasses.replace(SPEC, critic_loss=None), CRITIC)
    with pytest.raises(ValueError, match="role='ref'"):
        _contract(SPEC, "ref", ONE_ROW_EACH)
    assert pass_markers(SPEC) == {}
    trees = dataclasses.replace(SPEC, traj_config=TrajConfig(prefix_tree=True))
    assert pass_markers(trees) == {TREE_KEY: True}
