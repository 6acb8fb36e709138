"""The gradient of one mini-batch does not depend on the DP layout, the micro-batch token cap, who cuts
the micro-batches (verl's ``prepare_micro_batches`` or the planner's packing, token or padded cost, run
through the worker's micro-batch hook) or padding rows: dp=2 (gloo, 2 spawned processes) x several caps x
with/without padding rows equals the dp=1 single-micro-batch gradient, for policy+entropy+KL loss and for
value loss, in every loss mode.

Runs verl_traj's real loss functions (``traj_ppo_loss`` / ``traj_value_loss``: verl's policy loss fn,
``agg_loss``, ``kl_penalty``, ``compute_value_loss``) inside an emulation of verl's FSDP engine step
(verl's ``left_right_2_no_padding`` + ``prepare_micro_batches`` with the token cap and the DP-synced
micro-batch count, one ``backward`` per micro-batch, DP gradient all-reduce average)."""

from __future__ import annotations

import os
import socket
import tempfile

import pytest
import torch
import torch.multiprocessing as mp

from tests.integration import grad_harness as H
from verl_traj.core import loss_weight_modes

LOSS_WEIGHT_MODES = loss_weight_modes()

N_REAL = 8
CAPS = (14, 25, 60)  # tokens per micro-batch per rank (14 = the longest row: ~one row per micro-batch)
KINDS = ("policy", "value")
SCALE = 5.0  # loss_scale_factor for seq-mean-token-sum-norm


# verl's cut, the planner's packings: token sums, least padded area under a token cap, padded area under an area cap
PLANNED = ("", "tokens", "padded", "padded_area")


def _cases():
    for mode in LOSS_WEIGHT_MODES:
        for kind in KINDS:
            for padded in (False, True):
                for cap in CAPS:
                    for planned in PLANNED:
                        yield mode, kind, padded, cap, planned


def _batch(padded: bool):
    return H.make_rows(N_REAL, 2 if padded else 0, seed=1)


def _split_for_rank(rows, rank: int, world: int):
    """Scatter rows over ranks in an arbitrary (interleaved, reversed) order; padding lands on rank 0."""
    B = rows["input_ids"].shape[0]
    order = list(reversed(range(B)))
    per = B // world
    return H.select_rows(rows, order[rank * per:(rank + 1) * per])


def _loss_fn(kind):
    from verl_traj.integration.workers.losses import traj_ppo_loss, traj_value_loss

    return traj_ppo_loss if kind == "policy" else traj_value_loss


def _config(kind):
    return H.actor_config() if kind == "policy" else H.critic_config()


def _worker(rank: int, world: int, port: int, out_path: str):
    import torch.distributed as dist

    H.patch_verl_device()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        results = {}
        for mode, kind, padded, cap, planned in _cases():
            rows = H.with_loss_weight(_batch(padded), mode, SCALE)
            local = _split_for_rank(rows, rank, world)
            model = H.TinyLM()
            n_micro = H.engine_step(
                model, local, kind, _loss_fn(kind), _config(kind), max_token_len=cap * (3 if planned == "padded_area" else 1),
                dp_size=world, dp_group=dist.group.WORLD, planned=planned,
            )
            results[(mode, kind, padded, cap, planned)] = (H.flat_grad(model), n_micro)
        if rank == 0:
            torch.save(results, out_path)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def dp2_results():
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "grads.pt")
        mp.spawn(_worker, args=(2, _free_port(), out), nprocs=2, join=True)
        return torch.load(out)


def _reference(mode: str, kind: str) -> torch.Tensor:
    """dp=1, one micro-batch holding every real row, no padding rows."""
    H.patch_verl_device()
    rows = H.with_loss_weight(_batch(False), mode, SCALE)
    model = H.TinyLM()
    n_micro = H.engine_step(model, rows, kind, _loss_fn(kind), _config(kind), max_token_len=10**6, dp_size=1)
    assert n_micro == 1
    return H.flat_grad(model)


@pytest.mark.dist
@pytest.mark.parametrize("mode", LOSS_WEIGHT_MODES)
@pytest.mark.parametrize("kind", KINDS)
def test_dp2_microbatched_padded_equals_dp1(dp2_results, mode, kind):
    ref = _reference(mode, kind)
    assert ref.norm() > 0
    seen_micro = set()
    for padded in (False, True):
        for cap in CAPS:
            for planned in PLANNED:
                grad, n_micro = dp2_results[(mode, kind, padded, cap, planned)]
                seen_micro.add(n_micro)
                rel = float((grad - ref).norm() / ref.norm())
                assert rel < 1e-5, f"{mode=} {kind=} {padded=} {cap=} {planned=} micro-batches={n_micro}: rel err {rel:.2e}"
    assert len(seen_micro) > 1  # the caps really cut the shard differently


@pytest.mark.parametrize("kind", KINDS)
def test_dp1_micro_batch_cap_invariance(kind):
    """Single process: any token cap gives the single-micro-batch gradient (every mode)."""
    for mode in LOSS_WEIGHT_MODES:
        ref = _reference(mode, kind)
        for cap in CAPS:
            rows = H.with_loss_weight(H.make_rows(N_REAL, 3, seed=1), mode, SCALE)
            model = H.TinyLM()
            H.engine_step(model, rows, kind, _loss_fn(kind), _config(kind), max_token_len=cap, dp_size=1)
            rel = float((H.flat_grad(model) - ref).norm() / ref.norm())
            assert rel < 1e-5, f"{mode=} {kind=} {cap=}: rel err {rel:.2e}"


def test_stock_verl_token_mean_depends_on_layout():
    """Sanity check of the harness: verl's own seq-mean-token-mean with a local (micro-batch) row count
    is NOT layout-invariant, so the test above is not vacuous."""
    from verl.workers.utils.losses import ppo_loss

    H.patch_verl_device()
    cfg = H.actor_config(loss_agg_mode="seq-mean-token-mean")
    rows = _batch(False)
    grads = []
    for cap in (10**6, 14):
        model = H.TinyLM()
        H.engine_step(model, rows, "policy", ppo_loss, cfg, max_token_len=cap, dp_size=1)
        grads.append(H.flat_grad(model))
    assert float((grads[0] - grads[1]).norm() / grads[0].norm()) > 1e-3
