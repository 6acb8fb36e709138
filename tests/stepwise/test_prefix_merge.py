"""Prefix merging: full, partial and no merge; re-tokenised boundaries; loss tokens preserved exactly."""

import pytest
import torch

from verl_traj.stepwise.prefix_merge import PrefixMergeError, can_merge_boundaries, merge_trajectory_steps

T = lambda *x: torch.tensor(x, dtype=torch.long)  # noqa: E731


def _chain():
    # system/user 1 2 3 | resp 10 11 | obs 20 | resp 12 13 14 | obs 21 22 | resp 15
    p0 = T(1, 2, 3)
    r0 = T(10, 11)
    p1 = torch.cat([p0, r0, T(20)])
    r1 = T(12, 13, 14)
    p2 = torch.cat([p1, r1, T(21, 22)])
    r2 = T(15)
    lp = [torch.tensor([-0.1, -0.2]), torch.tensor([-0.3, -0.4, -0.5]), torch.tensor([-0.6])]
    return [p0, p1, p2], [r0, r1, r2], lp


def test_full_merge():
    prompts, responses, lp = _chain()
    rows, st = merge_trajectory_steps(prompts, responses, per_token={"rollout_log_probs": lp})
    assert len(rows) == 1
    row = rows[0]
    assert torch.equal(row.prompt_ids, prompts[0])
    assert row.response_ids.tolist() == [10, 11, 20, 12, 13, 14, 21, 22, 15]
    assert row.response_mask.tolist() == [1, 1, 0, 1, 1, 1, 0, 0, 1]
    assert torch.allclose(row.per_token["rollout_log_probs"], torch.tensor([-0.1, -0.2, 0, -0.3, -0.4, -0.5, 0, 0, -0.6]))
    assert row.source_steps == [0, 1, 2] and row.step_index == 0 and row.is_last_step
    # the merged row is exactly the last step's full context
    assert torch.equal(torch.cat([row.prompt_ids, row.response_ids]), torch.cat([prompts[2], responses[2]]))
    assert (st.rows_before, st.rows_after) == (3, 1)
    assert st.tokens_before == 5 + 9 + 12 and st.tokens_after == 12
    assert st.loss_tokens_before == st.loss_tokens_after == 6


def test_partial_merge_when_context_rewritten():
    prompts, responses, lp = _chain()
    p3 = T(1, 2, 3, 99)  # context rewritten (e.g. summarised): chain breaks before step 3
    r3 = T(16, 17)
    p4 = torch.cat([p3, r3, T(23)])
    r4 = T(18)
    prompts += [p3, p4]
    responses += [r3, r4]
    lp += [torch.tensor([-0.7, -0.8]), torch.tensor([-0.9])]
    assert can_merge_boundaries(prompts, responses) == [True, True, False, True]
    rows, st = merge_trajectory_steps(prompts, responses, per_token={"lp": lp})
    assert [r.source_steps for r in rows] == [[0, 1, 2], [3, 4]]
    assert [r.step_index for r in rows] == [0, 1]
    assert [r.is_last_step for r in rows] == [False, True]
    assert rows[1].response_ids.tolist() == [16, 17, 23, 18]
    assert rows[1].response_mask.tolist() == [1, 1, 0, 1]
    assert st.loss_tokens_before == st.loss_tokens_after == 9
    assert st.rows_after == 2


def test_no_merge_and_disabled():
    prompts = [T(1, 2), T(5, 6), T(7)]
    responses = [T(3), T(4), T(8)]
    rows, st = merge_trajectory_steps(prompts, responses)
    assert len(rows) == 3 and [r.source_steps for r in rows] == [[0], [1], [2]]
    assert [r.is_last_step for r in rows] == [False, False, True]
    assert st.tokens_before == st.tokens_after
    prompts, responses, lp = _chain()
    rows, st = merge_trajectory_steps(prompts, responses, enable=False)
    assert len(rows) == 3 and st.rows_after == 3 and st.tokens_after == st.tokens_before


def test_retokenised_boundary_does_not_merge():
    # step 0 responded with tokens [10, 11] ("foo" + "bar"); the next prompt re-tokenises that text as [12] ("foobar")
    p0, r0 = T(1, 2, 3), T(10, 11)
    p1 = T(1, 2, 3, 12, 20)
    r1 = T(13)
    assert can_merge_boundaries([p0, p1], [r0, r1]) == [False]
    rows, st = merge_trajectory_steps([p0, p1], [r0, r1])
    assert len(rows) == 2 and st.loss_tokens_after == 3
    # a differing token in the MIDDLE of the response also breaks it
    p1b = T(1, 2, 3, 10, 99, 20)
    assert can_merge_boundaries([p0, p1b], [r0, r1]) == [False]
    # a prompt that is shorter than the previous full context cannot be a continuation
    assert can_merge_boundaries([p0, T(1, 2, 3, 10)], [r0, r1]) == [False]


def test_empty_observation_and_empty_response():
    p0, r0 = T(1, 2), T(3, 4)
    p1, r1 = T(1, 2, 3, 4), T()  # no observation tokens, empty response
    p2, r2 = T(1, 2, 3, 4, 9), T(5)
    rows, st = merge_trajectory_steps([p0, p1, p2], [r0, r1, r2])
    assert len(rows) == 1 and rows[0].response_ids.tolist() == [3, 4, 9, 5]
    assert rows[0].response_mask.tolist() == [1, 1, 0, 1]
    assert st.loss_tokens_before == st.loss_tokens_after == 3


def test_existing_zero_mask_inside_a_response_is_kept():
    prompts, responses, _ = _chain()
    masks = [torch.tensor([1, 0]), torch.ones(3, dtype=torch.long), torch.ones(1, dtype=torch.long)]
    rows, st = merge_trajectory_steps(prompts, responses, masks)
    assert rows[0].response_mask.tolist() == [1, 0, 0, 1, 1, 1, 0, 0, 1]
    assert st.loss_tokens_before == st.loss_tokens_after == 5


def test_empty_trajectory_and_stats_sum():
    rows, st = merge_trajectory_steps([], [])
    assert rows == [] and st.rows_before == 0
    prompts, responses, _ = _chain()
    _, a = merge_trajectory_steps(prompts, responses)
    tot = a + a
    assert tot.rows_before == 6 and tot.tokens_after == 24 and tot.token_ratio == a.token_ratio
    assert set(tot.metrics()) >= {"traj_merge/rows_before", "traj_merge/token_ratio"}


def test_shape_errors():
    with pytest.raises(PrefixMergeError, match="responses"):
        merge_trajectory_steps([T(1)], [])
    with pytest.raises(PrefixMergeError, match="response_mask"):
        merge_trajectory_steps([T(1)], [T(2, 3)], [torch.ones(1)])
    with pytest.raises(PrefixMergeError, match="lp"):
        merge_trajectory_steps([T(1)], [T(2, 3)], per_token={"lp": [torch.zeros(3)]})
    with pytest.raises(PrefixMergeError, match="1-D"):
        merge_trajectory_steps([T(1).reshape(1, 1)], [T(2)])
