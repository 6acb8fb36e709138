"""``verl_traj.core.rollout.failures``: which failed groups leave the batch, and the counts logged about them."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given
from hypothesis import strategies as st

from verl_traj.core.rollout.failures import (FAILURE_TAG_PREFIX, failed_groups_to_evict, failure_metrics, failure_reason,
                                     failure_tag, min_survivors)

UIDS = st.sets(st.sampled_from([f"u{i}" for i in range(12)]))


@given(failed=UIDS, survivors=st.dictionaries(st.sampled_from([f"u{i}" for i in range(12)]), st.integers(1, 8)),
       group_size=st.integers(1, 8))
def test_drop_evicts_every_failed_group_and_keep_survivors_those_without_a_baseline(failed, survivors, group_size):
    least = min_survivors(group_size)
    dropped = failed_groups_to_evict(failed, survivors, "drop", least)
    kept_policy = failed_groups_to_evict(failed, survivors, "keep_survivors", least)
    assert dropped == failed  # never a group that lost a member in the baseline
    # a group with no finished session cannot train; with one of n > 1, its baseline would be itself
    assert kept_policy == {u for u in failed if survivors.get(u, 0) < (2 if group_size > 1 else 1)}
    assert kept_policy <= dropped


def test_an_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="keep_survivors"):
        failed_groups_to_evict({"u"}, {}, "retry")


@given(st.dictionaries(st.sampled_from(["g0", "g1", "g2", "g3"]),
                       st.lists(st.sampled_from(["timeout", "RuntimeError", "KeyError"]), max_size=4)),
       st.sets(st.sampled_from(["g0", "g1", "g2", "g3"])))
def test_failure_metrics_count_each_failed_session_once_with_its_reason(sessions, dropped):
    tags = {uid: {"is_prompt": True, "status": "failure",
                  **{k: v for s, r in enumerate(reasons) for k, v in failure_tag(s, _error(r)).items()}}
            for uid, reasons in sessions.items()}
    kept = set(sessions) - dropped
    out = failure_metrics(tags, dropped, kept)
    failed = sum(len(sessions.get(uid, [])) for uid in dropped | kept)
    assert out["traj_failure/groups_dropped_total"] == len(dropped) and out["traj_failure/groups_kept_total"] == len(kept)
    assert out["traj_failure/trajectories_failed_total"] == failed
    assert sum(v for k, v in out.items() if k.startswith("traj_failure/reason_total/")) == failed


def _error(reason: str) -> BaseException:
    return asyncio.TimeoutError() if reason == "timeout" else {"RuntimeError": RuntimeError, "KeyError": KeyError}[reason]()


def test_reasons_and_tags():
    assert failure_reason(asyncio.TimeoutError()) == "timeout" and failure_reason(TimeoutError()) == "timeout"
    assert failure_reason(KeyError("x")) == "KeyError"
    assert failure_tag(3, ValueError()) == {f"{FAILURE_TAG_PREFIX}3": "ValueError"}
    assert failure_metrics({}, (), ()) == {"traj_failure/groups_dropped_total": 0.0,
                                           "traj_failure/groups_kept_total": 0.0,
                                           "traj_failure/trajectories_failed_total": 0.0}


def test_a_refusal_of_the_loops_contract_is_tagged_fatal_and_raised_and_a_refusal_of_one_rollouts_data_is_not():
    from verl_traj.core.errors import TrajInputError
    from verl_traj.core.rollout.failures import FATAL_TAG, fatal_failure

    contract = failure_tag(2, TrajInputError("step_rewards returned 2 rewards for 3 LLM calls", field="step_rewards",
                                             every_rollout=True))
    data = failure_tag(1, TrajInputError("response_logprobs holds NaN", field="response_logprobs"))
    crash = failure_tag(0, RuntimeError("sandbox died"))
    assert FATAL_TAG in contract and FATAL_TAG not in data and FATAL_TAG not in crash
    assert failure_metrics({"g": contract}, {"g"}, ())["traj_failure/trajectories_failed_total"] == 1.0  # one session
    fatal_failure({"g": crash, "h": data})  # ordinary failures: the group policy handles them
    with pytest.raises(TrajInputError, match=r"group 'g'.*TrajInputError: step_rewards returned 2 rewards"):
        fatal_failure({"h": crash, "g": contract})
