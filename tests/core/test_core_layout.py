"""build_layout: dense indices vs brute force, and every documented error."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verl_traj.testing import random_batch, verl_tensors as to_verl_tensors
from verl_traj.core import BatchLayoutError, build_layout, build_layout_from_counts


def _layout(b, **kw):
    args = dict(uid=b.uid, traj_id=b.traj_id, step_index=b.step_index, is_last_step=b.is_last_step, is_padding=b.is_padding)
    args.update(kw)
    return build_layout_from_counts(b.num_tokens, b.loss_len, **args)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    groups=st.integers(1, 8),
    tpg=st.integers(1, 5),
    steps=st.integers(1, 50),
    pad_rows=st.integers(0, 3),
)
def test_layout_matches_brute_force(seed, groups, tpg, steps, pad_rows):
    b = random_batch(seed, groups, tpg, steps, pad_rows=pad_rows)
    lay = _layout(b)
    real = ~b.is_padding
    # first-appearance dense codes, brute force
    seen_t, seen_g = {}, {}
    for i in np.flatnonzero(real):
        seen_t.setdefault(b.traj_id[i], len(seen_t))
        seen_g.setdefault(b.uid[i], len(seen_g))
    exp_t = np.array([seen_t[b.traj_id[i]] if real[i] else -1 for i in range(b.num_rows)])
    exp_g = np.array([seen_g[b.uid[i]] if real[i] else -1 for i in range(b.num_rows)])
    assert lay.traj_index.tolist() == exp_t.tolist()
    assert lay.group_index.tolist() == exp_g.tolist()
    assert lay.num_trajectories == len(seen_t) and lay.num_groups == len(seen_g)
    assert lay.is_last_step[torch.from_numpy(real)].tolist() == b.is_last_step[real].tolist()
    assert not lay.is_last_step[torch.from_numpy(b.is_padding)].any()
    assert lay.traj_num_steps.sum().item() == int(real.sum())
    for t, uid_code in enumerate(lay.traj_group.tolist()):
        rows = lay.traj_index == t
        assert (lay.group_index[rows] == uid_code).all()
        assert sorted(lay.step_index[rows].tolist()) == list(range(int(rows.sum())))
    assert lay.num_tokens.tolist() == b.num_tokens.tolist()
    assert lay.num_loss_tokens.tolist() == b.loss_len.tolist()
    # is_last_step derived when absent
    lay2 = _layout(b, is_last_step=None)
    assert torch.equal(lay2.is_last_step, lay.is_last_step)


def test_masks_and_counts_agree():
    b = random_batch(3, 4, 3, 6)
    t = to_verl_tensors(b)
    lay = build_layout(t["attention_mask"], t["response_mask"], b.uid, b.traj_id, b.step_index)
    assert lay.num_tokens.tolist() == b.num_tokens.tolist()
    assert lay.num_loss_tokens.tolist() == b.loss_len.tolist()


def test_without_traj_ids_each_row_is_a_trajectory():
    uid = np.array(["a", "b", "a", "c"], dtype=object)
    lay = build_layout_from_counts(torch.tensor([3, 4, 5, 6]), torch.tensor([1, 1, 1, 0]), uid)
    assert lay.traj_index.tolist() == [0, 1, 2, 3]
    assert lay.group_index.tolist() == [0, 1, 0, 2]
    assert lay.step_index.tolist() == [0, 0, 0, 0]
    assert lay.is_last_step.all()
    assert lay.traj_group.tolist() == [0, 1, 0, 2]


def test_integer_ids_are_accepted():
    lay = build_layout_from_counts(
        [5, 5, 5], [1, 1, 1], np.array([7, 7, 9]), traj_id=np.array([10, 10, 3]), step_index=np.array([1, 0, 0])
    )
    assert lay.traj_index.tolist() == [0, 0, 1] and lay.is_last_step.tolist() == [True, False, True]


def _base():
    uid = np.array(["u0", "u0", "u0", "u1"], dtype=object)
    tid = np.array(["t0", "t0", "t1", "t2"], dtype=object)
    step = np.array([0, 1, 0, 0])
    return uid, tid, step


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda u, t, s: dict(uid=u[:3]), "uid has 3 entries but the batch has 4 rows"),
        (lambda u, t, s: dict(traj_id=t[:2]), "traj_id has 2 entries"),
        (lambda u, t, s: dict(step_index=None), "traj_id was given without step_index"),
        (lambda u, t, s: dict(traj_id=None), "step_index was given without traj_id"),
        (lambda u, t, s: dict(uid=None), "uid is missing"),
        (lambda u, t, s: dict(uid=np.array(["u0", "u9", "u0", "u1"], dtype=object)), "different uids"),
        (lambda u, t, s: dict(step_index=np.array([0, 0, 0, 0])), r"duplicate steps \[0\]"),
        (lambda u, t, s: dict(step_index=np.array([0, 2, 0, 0])), r"missing steps \[1\]"),
        (lambda u, t, s: dict(step_index=np.array([-1, 0, 0, 0])), "negative"),
        (lambda u, t, s: dict(is_last_step=np.array([False, False, True, True])), "0 rows with is_last_step=True"),
        (lambda u, t, s: dict(is_last_step=np.array([True, True, True, True])), "2 rows with is_last_step=True"),
        (lambda u, t, s: dict(is_last_step=np.array([True, False, True, True])), "max step is 1"),
        (lambda u, t, s: dict(is_padding=np.ones(4, dtype=bool)), "no real row"),
        (lambda u, t, s: dict(uid=np.array([["u0"] * 4])), "must be 1-D"),
    ],
)
def test_errors_name_field_value_and_fix(mutate, match):
    uid, tid, step = _base()
    kw = dict(uid=uid, traj_id=tid, step_index=step)
    kw.update(mutate(uid, tid, step))
    with pytest.raises(BatchLayoutError, match=match) as exc:
        build_layout_from_counts(torch.full((4,), 10), torch.full((4,), 2), **kw)
    assert "Fix" in str(exc.value) or "fix" in str(exc.value)


def test_error_names_the_trajectory():
    uid, tid, step = _base()
    with pytest.raises(BatchLayoutError, match="traj_id='t0'"):
        build_layout_from_counts(torch.full((4,), 10), torch.full((4,), 2), uid, tid, np.array([0, 3, 0, 0]))


def test_empty_batch_fails_fast():
    with pytest.raises(BatchLayoutError, match="no real row"):
        build_layout(torch.zeros(0, 4), torch.zeros(0, 2), np.array([], dtype=object))


def test_mask_row_mismatch():
    with pytest.raises(BatchLayoutError, match="response_mask has 3 rows"):
        build_layout(torch.ones(4, 6), torch.ones(3, 2), np.array(["a"] * 4, dtype=object))


def test_padding_rows_are_ignored_by_checks():
    uid, tid, step = _base()
    pad = np.array([False, False, False, True])
    # the padding row carries garbage ids: no error
    lay = build_layout_from_counts(
        torch.full((4,), 10), torch.tensor([2, 2, 2, 0]), uid, np.array(["t0", "t0", "t1", "t0"], dtype=object),
        np.array([0, 1, 0, 0]), is_padding=pad,
    )
    assert lay.traj_index.tolist() == [0, 0, 1, -1]
    assert lay.num_real_rows == 3
