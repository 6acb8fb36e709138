"""compute_loss_weights: formulas vs a brute-force loop, padding weighs 0, permutation invariance."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verl_traj.core import compute_loss_weights, loss_weight_modes, register_loss_weight
from verl_traj.core.plan.loss_weights import LOSS_WEIGHT_FNS

MODES = list(loss_weight_modes())


@st.composite
def batches(draw):
    B = draw(st.integers(1, 12))
    R = draw(st.integers(1, 6))
    lengths = draw(st.lists(st.integers(0, R), min_size=B, max_size=B))
    mask = torch.zeros(B, R, dtype=torch.int64)
    for i, n in enumerate(lengths):
        # arbitrary (not necessarily contiguous) loss tokens
        cols = draw(st.permutations(list(range(R))))[:n]
        mask[i, cols] = 1
    # the plan's invariant: a trajectory lives in one mini-batch (traj -> mini-batch is a function)
    traj = torch.tensor(draw(st.lists(st.integers(0, 4), min_size=B, max_size=B)), dtype=torch.long)
    traj_mb = torch.tensor(draw(st.lists(st.integers(0, 3), min_size=5, max_size=5)), dtype=torch.long)
    mb = traj_mb[traj]
    pad = torch.tensor(draw(st.lists(st.booleans(), min_size=B, max_size=B)), dtype=torch.bool)
    scale = draw(st.one_of(st.none(), st.floats(0.5, 100.0)))
    return mask, mb, traj, pad, scale


def brute_force(mode, mask, mb, traj, pad, scale):
    B, R = mask.shape
    S = scale if scale is not None else R
    out = []
    for i in range(B):
        if pad[i]:
            out.append(0.0)
            continue
        m = int(mb[i])
        real_m = [j for j in range(B) if int(mb[j]) == m and not pad[j]]
        l_i = int(mask[i].sum())
        N = len(real_m)
        L = sum(int(mask[j].sum()) for j in real_m)
        if mode == "token-mean":
            w = 1.0 / L if L > 0 else 0.0
        elif mode == "seq-mean-token-sum":
            w = 1.0 / N
        elif mode == "seq-mean-token-mean":
            w = 1.0 / (N * l_i) if l_i > 0 else 0.0
        elif mode == "seq-mean-token-sum-norm":
            w = 1.0 / (N * S)
        else:
            T = len({int(traj[j]) for j in real_m})
            Lk = sum(int(mask[j].sum()) for j in real_m if int(traj[j]) == int(traj[i]))
            w = 1.0 / (T * Lk) if Lk > 0 else 0.0
        out.append(w)
    return torch.tensor(out, dtype=torch.float64)


@settings(max_examples=150, deadline=None)
@given(batches(), st.sampled_from(MODES))
def test_matches_brute_force(batch, mode):
    mask, mb, traj, pad, scale = batch
    w = compute_loss_weights(mode, mask, mb, traj, pad, loss_scale_factor=scale)
    assert w.dtype == torch.float32 and w.shape == (mask.shape[0],)
    torch.testing.assert_close(w.double(), brute_force(mode, mask, mb, traj, pad, scale), rtol=1e-6, atol=1e-9)


@settings(max_examples=100, deadline=None)
@given(batches(), st.sampled_from(MODES))
def test_padding_rows_weigh_zero_and_change_nothing(batch, mode):
    mask, mb, traj, pad, scale = batch
    w = compute_loss_weights(mode, mask, mb, traj, pad, loss_scale_factor=scale)
    assert torch.all(w[pad] == 0)
    # Appending extra padding rows (any mask, any ids) leaves the real rows' weights unchanged.
    extra = 3
    mask2 = torch.cat([mask, torch.ones(extra, mask.shape[1], dtype=mask.dtype)])
    mb2 = torch.cat([mb, torch.tensor([0, 1, 7])])
    traj2 = torch.cat([traj, torch.tensor([-1, -1, -1])])
    pad2 = torch.cat([pad, torch.ones(extra, dtype=torch.bool)])
    w2 = compute_loss_weights(mode, mask2, mb2, traj2, pad2, loss_scale_factor=scale)
    torch.testing.assert_close(w2[: len(w)], w)
    assert torch.all(w2[len(w):] == 0)


@settings(max_examples=100, deadline=None)
@given(batches(), st.sampled_from(MODES), st.randoms(use_true_random=False))
def test_row_permutation_invariance(batch, mode, rnd):
    mask, mb, traj, pad, scale = batch
    perm = list(range(mask.shape[0]))
    rnd.shuffle(perm)
    perm = torch.tensor(perm)
    w = compute_loss_weights(mode, mask, mb, traj, pad, loss_scale_factor=scale)
    wp = compute_loss_weights(mode, mask[perm], mb[perm], traj[perm], pad[perm], loss_scale_factor=scale)
    torch.testing.assert_close(wp, w[perm])


@settings(max_examples=100, deadline=None)
@given(batches())
def test_normalisation(batch):
    """token-mean: weights x tokens sum to 1 per mini-batch with tokens; seq modes: rows sum to 1;
    traj-mean: every trajectory with tokens has total weight-tokens 1/T_m."""
    mask, mb, traj, pad, scale = batch
    tokens = mask.sum(-1).double()
    w = compute_loss_weights("token-mean", mask, mb, traj, pad).double()
    for m in mb.unique():
        sel = (mb == m) & ~pad
        if tokens[sel].sum() > 0:
            assert math.isclose(float((w[sel] * tokens[sel]).sum()), 1.0, rel_tol=1e-6)
    w = compute_loss_weights("seq-mean-token-sum", mask, mb, traj, pad).double()
    for m in mb.unique():
        sel = (mb == m) & ~pad
        if sel.any():
            assert math.isclose(float(w[sel].sum()), 1.0, rel_tol=1e-6)
    w = compute_loss_weights("traj-mean", mask, mb, traj, pad).double()
    for m in mb.unique():
        sel = (mb == m) & ~pad
        trajs = traj[sel].unique()
        for k in trajs:
            tsel = sel & (traj == k)
            if tokens[tsel].sum() > 0:
                assert math.isclose(float((w[tsel] * tokens[tsel]).sum()), 1.0 / len(trajs), rel_tol=1e-6)


def test_traj_mean_equal_weight_per_trajectory():
    # trajectory 0: 3 step rows (2+2+2 tokens); trajectory 1: 1 row with 2 tokens -> each weighs 1/2.
    mask = torch.tensor([[1, 1, 0], [1, 1, 0], [1, 1, 0], [1, 1, 0]])
    w = compute_loss_weights(
        "traj-mean", mask, torch.zeros(4, dtype=torch.long), torch.tensor([0, 0, 0, 1]), torch.zeros(4, dtype=torch.bool)
    )
    torch.testing.assert_close(w, torch.tensor([1 / 12, 1 / 12, 1 / 12, 1 / 4]))
    # token-mean would weigh trajectory 0 three times as much
    w_tok = compute_loss_weights(
        "token-mean", mask, torch.zeros(4, dtype=torch.long), torch.tensor([0, 0, 0, 1]), torch.zeros(4, dtype=torch.bool)
    )
    torch.testing.assert_close(w_tok, torch.full((4,), 1 / 8))


def test_errors_name_the_problem():
    mask = torch.ones(2, 3)
    z = torch.zeros(2, dtype=torch.long)
    with pytest.raises(ValueError, match="not one of"):
        compute_loss_weights("sum", mask, z, z, z.bool())
    with pytest.raises(ValueError, match="mini_batch_id"):
        compute_loss_weights("token-mean", mask, torch.zeros(3, dtype=torch.long), z, z.bool())


def test_registry_adds_a_mode_with_one_function():
    @register_loss_weight("unit-test-rows")
    def _rows(s):
        return s.real  # every real row weighs 1

    try:
        assert "unit-test-rows" in loss_weight_modes()
        mask = torch.ones(3, 2)
        w = compute_loss_weights("unit-test-rows", mask, torch.zeros(3, dtype=torch.long), torch.arange(3),
                                 torch.tensor([False, True, False]))
        assert w.tolist() == [1.0, 0.0, 1.0]
    finally:
        LOSS_WEIGHT_FNS.pop("unit-test-rows")
