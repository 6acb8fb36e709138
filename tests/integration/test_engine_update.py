"""verl's real FSDP2 engine worker on CPU (gloo): a planned update through ``TrajTrainingWorker`` +
``traj_ppo_loss`` runs exactly one optimizer step per mini-batch and exactly the plan's micro-batches,
and the per-mini-batch gradient norms at dp=2 (padding rows, a small token cap -> several micro-batches)
equal those at dp=1 with one micro-batch per mini-batch. A planned update missing any planned field raises, naming it.
GSPO at trajectory scope (its pre-pass) gives every row its trajectory's ratio of the training forward, dropout on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from verl_traj.testing.engine import free_port

pytestmark = pytest.mark.dist

GROUPS, N, MINI_BATCHES, P, R = 6, 3, 2, 32, 96


def _config(cap: int, mini_batches: int, extra=()):
    from verl_traj.testing.engine import cpu_config

    return cpu_config([
        f"actor_rollout_ref.actor.ppo_mini_batch_size={GROUPS // mini_batches}", f"actor_rollout_ref.rollout.n={N}",
        f"data.train_batch_size={GROUPS}", "actor_rollout_ref.actor.use_dynamic_bsz=true",
        f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={cap}", *extra,
    ])


def _batch(vocab: int):
    from verl_traj.testing import as_dataproto, rl_batch

    return as_dataproto(*rl_batch(GROUPS, N, prompt_len=P, response_len=R, seed=3, long_tail=True, obs_spans=2,
                                  vocab=vocab))


def _ratio_groups(batch) -> None:
    """GSPO at trajectory scope: each GRPO group's rows share one sequence ratio (a "trajectory" of 3 rows that the
    plan spreads over both ranks), padding rows none."""
    import numpy as np
    import torch

    from verl_traj.core.keys import IS_PADDING, RATIO_GROUP

    group = torch.as_tensor(np.unique(batch.non_tensor_batch["uid"].astype(str), return_inverse=True)[1].reshape(-1))
    batch.batch[RATIO_GROUP] = torch.where(batch.batch[IS_PADDING], -1, group)


def _recording_loss(inner, records: list):
    """``inner`` (traj_ppo_loss), recording per row what GSPO's sequence ratio sees: (mini-batch, trajectory, the
    live log-ratio sum, loss tokens, the row's mean log-ratio after the shift)."""
    from verl.workers.utils.padding import no_padding_2_padding

    from verl_traj.core.keys import MINI_BATCH_ID, RATIO_GROUP, SEQ_RATIO_SHIFT

    def loss(config, model_output, data, dp_group=None):
        log_prob = no_padding_2_padding(model_output["log_probs"], data).detach()
        padded = data.select("old_log_probs", "response_mask").to_padded_tensor()
        mask = padded["response_mask"].float()
        live = ((log_prob - padded["old_log_probs"]) * mask).sum(-1)
        tokens = mask.sum(-1)
        shift = data[SEQ_RATIO_SHIFT] if SEQ_RATIO_SHIFT in data.keys() else live * 0
        seen = live / tokens.clamp(min=1) - shift
        records.extend(zip(data[MINI_BATCH_ID].tolist(), data[RATIO_GROUP].tolist(), live.tolist(), tokens.tolist(),
                           seen.tolist()))
        return inner(config, model_output, data, dp_group)

    return loss


def _trajectory_gaps(records: list) -> list[float]:
    """Per optimizer step (a run of records with one mini-batch id), the largest gap between a row's sequence
    log-ratio and its trajectory's mean log-ratio over the live log-probs of all its rows."""
    import itertools

    gaps = []
    for _, step in itertools.groupby(records, key=lambda r: r[0]):
        step = [r for r in step if r[1] >= 0 and r[3] > 0]
        sums, toks = {}, {}
        for _, g, live, n, _ in step:
            sums[g], toks[g] = sums.get(g, 0.0) + live, toks.get(g, 0.0) + n
        gaps.append(max(abs(seen - sums[g] / toks[g]) for _, g, _, _, seen in step))
    return gaps


def _proc(rank, world, port, home, cap, out_path, planned, mini_batches, gspo=None):
    from functools import partial

    from verl_traj.testing.engine import actor_worker, init_rank, plan_for_update, rank_tensordict

    init_rank(rank, world, port, home)
    import torch.distributed as dist
    from verl.utils import tensordict_utils as tu

    try:
        extra = ("actor_rollout_ref.actor.policy_loss.loss_mode=gspo", "actor_rollout_ref.actor.ppo_epochs=2") if gspo else ()
        if gspo == "dropout":  # Qwen2's attention dropout, applied in training mode only
            extra += ("+actor_rollout_ref.model.override_config.attention_dropout=0.2",)
        cfg = _config(cap, mini_batches, extra)
        worker = actor_worker(cfg, planned)
        records = []
        if gspo == "dropout":
            worker.set_loss_fn(partial(_recording_loss(worker.loss_fn.func, records), **worker.loss_fn.keywords))
        batch = _batch(int(worker.model_config.hf_config.vocab_size))
        trajectory = gspo in ("trajectory", "dropout")
        plan = plan_for_update(batch, cfg, world, ratio_groups=trajectory) if planned else None
        if trajectory:
            _ratio_groups(batch)
        out = worker.train_mini_batch(rank_tensordict(batch, rank, world, GROUPS // mini_batches * N,
                                                      epochs=2 if gspo else 1))
        if rank == 0:
            metrics = tu.get(out, "metrics")
            res = {"grad_norm": [float(x) for x in metrics["grad_norm"]],
                   "trajectory_gaps": _trajectory_gaps(records),
                   "prepass_micro_batches": metrics.get("prepass_micro_batches_per_epoch"),
                   "prepass_skipped": metrics.get("prepass_skipped_steps"),
                   "shift": [float(x) for x in metrics.get("actor/traj_seq_ratio_shift_abs_max", [])],
                   "pg_loss": [float(x) for x in metrics["actor/pg_loss"]],
                   "num_optimizer_steps": metrics.get("num_optimizer_steps"),
                   "micro_batches_run": metrics.get("micro_batches_per_epoch"),
                   "lr": [float(x) for x in metrics.get("lr", [])],
                   "padding_rows": int(plan.stats.padding_rows.sum()) if plan else 0,
                   "planned_micro_batches": int(plan.stats.micro_batches.sum()) if plan else None}
            with open(out_path, "w") as f:
                json.dump(res, f)
    finally:
        dist.destroy_process_group()


def _run(home, world, cap, planned, tmp_path, mini_batches=MINI_BATCHES, gspo=None):
    out = str(tmp_path / f"w{world}_{cap}_{planned}_{mini_batches}_{gspo}.json")
    mp.spawn(_proc, args=(world, free_port(), home, cap, out, planned, mini_batches, gspo), nprocs=world, join=True)
    with open(out) as f:
        return json.load(f)


def test_real_engine_update_dp2_capped_equals_dp1(tiny_home, tmp_path):
    ref = _run(tiny_home.parent, 1, 4096, True, tmp_path)
    got = _run(tiny_home.parent, 2, 140, True, tmp_path)
    # 6 groups x 3 rows, 2 mini-batches of 3 groups = 9 rows each -> 1 padding row each at dp=2
    assert got["padding_rows"] == 2 and ref["padding_rows"] == 0
    assert ref["num_optimizer_steps"] == [2] and got["num_optimizer_steps"] == [2]
    # the workers ran exactly the planned micro-batches (several per mini-batch under the small cap)
    assert got["micro_batches_run"] == [float(got["planned_micro_batches"])] and got["planned_micro_batches"] > 2
    assert ref["micro_batches_run"] == [float(ref["planned_micro_batches"])]
    assert len(ref["lr"]) == len(got["lr"]) == 1  # the LR schedule stepped once per update
    assert len(ref["grad_norm"]) == len(got["grad_norm"]) == 2
    for a, b in zip(ref["grad_norm"], got["grad_norm"]):
        assert b == pytest.approx(a, rel=1e-4), (ref, got)


def test_real_engine_stock_worker_runs_verls_fixed_slices(tiny_home, tmp_path):
    res = _run(tiny_home.parent, 1, 4096, False, tmp_path)
    assert len(res["grad_norm"]) == 2 and res["num_optimizer_steps"] is None


def test_real_engine_traj_update_equals_stock_on_the_same_rows(tiny_home, tmp_path):
    """One mini-batch holding every row: verl_traj's weighted token-sum loss (token-mean weights) and
    verl's own token-mean loss give the same loss and the same gradient, so any training difference
    between the two comes from which rows share a mini-batch, never from the loss."""
    traj = _run(tiny_home.parent, 1, 4096, True, tmp_path, mini_batches=1)
    stock = _run(tiny_home.parent, 1, 4096, False, tmp_path, mini_batches=1)
    assert traj["padding_rows"] == 0 and len(traj["grad_norm"]) == len(stock["grad_norm"]) == 1
    assert traj["grad_norm"][0] == pytest.approx(stock["grad_norm"][0], rel=1e-4), (traj, stock)
    assert sum(traj["pg_loss"]) == pytest.approx(sum(stock["pg_loss"]), rel=1e-4, abs=1e-6), (traj, stock)
    assert traj["lr"] == stock["lr"]


def test_real_engine_gspo_over_trajectories_split_across_ranks(tiny_home, tmp_path):
    """GSPO at trajectory scope on verl's real engine: each trajectory (here a group's 3 rows) gets one sequence ratio
    from the current policy, its rows on both ranks and in several micro-batches. Before each optimizer step the
    actor sums the trajectory's log-ratios over all of them (a no-grad pass and one all-reduce), so the 4 optimizer
    steps (2 mini-batches x 2 epochs) at dp=2 under a small cap equal dp=1's. The synthetic old log-probs are not the
    model's, so the rows' own mean log-ratios differ from their trajectory's from the first step (the shift is not 0)
    and per-row ratios (row scope) train differently."""
    ref = _run(tiny_home.parent, 1, 4096, True, tmp_path, gspo="trajectory")
    got = _run(tiny_home.parent, 2, 140, True, tmp_path, gspo="trajectory")
    rows = _run(tiny_home.parent, 1, 4096, True, tmp_path, gspo="row")
    assert len(ref["grad_norm"]) == len(got["grad_norm"]) == 4 and got["planned_micro_batches"] > 2  # several a step
    for a, b in zip(ref["grad_norm"], got["grad_norm"]):
        assert b == pytest.approx(a, rel=1e-4), (ref, got)
    assert min(ref["shift"]) > 1e-3 and got["shift"] == pytest.approx(ref["shift"], rel=1e-4), (ref, got)
    assert rows["shift"] == [] and rows["grad_norm"] != pytest.approx(ref["grad_norm"], rel=1e-3)
    # the pre-pass ran on every step (the synthetic old log-probs are not the start parameters'), counted apart
    assert ref["prepass_skipped"] == [0] and ref["prepass_micro_batches"] == [ref["micro_batches_run"][0]], ref
    assert ref["micro_batches_run"] == [float(ref["planned_micro_batches"])], ref  # run = planned, GSPO too


def test_gspo_prepass_with_dropout_gives_each_row_its_trajectorys_ratio(tiny_home, tmp_path):
    """Attention dropout on (training mode draws random masks): the pre-pass runs in the training forward's mode
    with its random numbers replayed, so the sequence log-ratio every row's GSPO loss computes equals its
    trajectory's mean log-ratio over the log-probs of the training forward itself (an eval-mode pre-pass, or one
    with fresh dropout masks, would be off by the dropout noise, ~1e-2 here), on each of the 4 optimizer steps."""
    res = _run(tiny_home.parent, 1, 140, True, tmp_path, gspo="dropout")
    assert len(res["trajectory_gaps"]) == 4 and res["prepass_skipped"] == [0], res
    assert max(res["trajectory_gaps"]) < 1e-5, res


def _contract_proc(rank, world, port, home, out_path):
    """A planned update without its planned-fields list, or missing each planned field in turn, raises naming it."""
    from verl_traj.testing.engine import actor_worker, init_rank, plan_for_update, rank_tensordict

    init_rank(rank, world, port, home)
    import torch.distributed as dist

    from verl_traj.core.errors import TrajInputError
    from verl_traj.core.keys import PLANNED_FIELDS, planned_update_fields

    try:
        cfg = _config(4096, MINI_BATCHES, ("actor_rollout_ref.actor.policy_loss.loss_mode=gspo",))
        worker = actor_worker(cfg, True)
        batch = _batch(int(worker.model_config.hf_config.vocab_size))
        plan_for_update(batch, cfg, world, ratio_groups=True)
        _ratio_groups(batch)
        raised = {}
        for missing in (PLANNED_FIELDS, *planned_update_fields(ratio_groups=True)):
            td = rank_tensordict(batch, rank, world, GROUPS // MINI_BATCHES * N)
            td.pop(missing)
            try:
                worker.train_mini_batch(td)
                raised[missing] = None
            except TrajInputError as e:
                raised[missing] = [e.field, str(e)]
        with open(out_path, "w") as f:
            json.dump(raised, f)
    finally:
        dist.destroy_process_group()


def test_planned_update_missing_a_field_raises_naming_it(tiny_home, tmp_path):
    from verl_traj.core.keys import PLANNED_FIELDS, planned_update_fields

    out = str(tmp_path / "contract.json")
    mp.spawn(_contract_proc, args=(1, free_port(), tiny_home.parent, out), nprocs=1, join=True)
    with open(out) as f:
        raised = json.load(f)
    assert set(raised) == {PLANNED_FIELDS, *planned_update_fields(ratio_groups=True)}
    for missing, error in raised.items():
        assert error is not None, f"removing {missing!r} trained anyway"
        assert error[0] == missing and missing in error[1], error


# ---- critic: TrajCriticWorker + traj_value_loss on verl's value-model engine ----------------------


def _critic_proc(rank, world, port, home, critic_path, cap, out_path, repeats=1):
    from verl_traj.testing.engine import critic_worker, init_rank, plan_for_update, rank_tensordict

    init_rank(rank, world, port, home)
    import torch
    import torch.distributed as dist
    from verl.utils import tensordict_utils as tu

    try:
        cfg = _config(cap, MINI_BATCHES, [
            "critic.enable=true", f"critic.model.path={critic_path}", "critic.optim.lr=1e-5",
            "critic.use_dynamic_bsz=true", f"critic.ppo_max_token_len_per_gpu={cap}",
        ])
        worker = critic_worker(cfg)
        batch = _batch(100)
        g = torch.Generator().manual_seed(11)
        B, R_ = batch.batch["response_mask"].shape
        batch.batch["values"] = torch.randn(B, R_, generator=g) * 0.1
        batch.batch["returns"] = torch.randn(B, R_, generator=g)
        plan = plan_for_update(batch, cfg, world, mode="seq-mean-token-mean")
        losses = []
        for _ in range(repeats):  # the same batch again: the value loss must fall
            out = worker.train_mini_batch(rank_tensordict(batch, rank, world, GROUPS // MINI_BATCHES * N))
            if rank == 0:
                metrics = tu.get(out, "metrics")
                losses.append(sum(float(x) for x in metrics["critic/vf_loss"]))
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump({"grad_norm": [float(x) for x in metrics["grad_norm"]], "vf_loss": losses,
                           "num_optimizer_steps": metrics["num_optimizer_steps"],
                           "padding_rows": int(plan.stats.padding_rows.sum())}, f)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def critic_path(tiny_home, tmp_path_factory):
    """The tiny model with a seeded value head saved, so every run starts from the same weights."""
    import shutil

    import torch
    from transformers import AutoModelForTokenClassification

    src = Path(tiny_home) / "model"
    dst = tmp_path_factory.mktemp("critic") / "model"
    shutil.copytree(src, dst)
    torch.manual_seed(0)
    model = AutoModelForTokenClassification.from_pretrained(str(src), num_labels=1)
    model.save_pretrained(str(dst))
    return str(dst)


def test_real_engine_critic_dp2_capped_equals_dp1(tiny_home, critic_path, tmp_path):
    res = {}
    for world, cap in ((1, 4096), (2, 140)):
        out = str(tmp_path / f"critic_{world}.json")
        mp.spawn(_critic_proc, args=(world, free_port(), tiny_home.parent, critic_path, cap, out), nprocs=world, join=True)
        with open(out) as f:
            res[world] = json.load(f)
    assert res[2]["padding_rows"] == 2
    assert res[1]["num_optimizer_steps"] == res[2]["num_optimizer_steps"] == [2]
    # first mini-batch: same weights -> same gradient. The second starts after one Adam step, which
    # turns fp32 rounding differences of near-zero gradient entries into +-lr parameter differences;
    # the value head's gradient is sensitive to them, so the later mini-batch is compared loosely.
    (a0, a1), (b0, b1) = res[1]["grad_norm"], res[2]["grad_norm"]
    assert b0 == pytest.approx(a0, rel=1e-4), res
    assert b1 == pytest.approx(a1, rel=1e-3), res


def test_real_engine_critic_value_loss_falls_on_a_fixed_batch(tiny_home, critic_path, tmp_path):
    out = str(tmp_path / "critic_fixed.json")
    mp.spawn(_critic_proc, args=(2, free_port(), tiny_home.parent, critic_path, 140, out, 6), nprocs=2, join=True)
    with open(out) as f:
        losses = json.load(f)["vf_loss"]
    # (lr 1e-5, verl's critic default: a steady fall, every pass lower than the one before)
    assert len(losses) == 6 and all(b < a for a, b in zip(losses, losses[1:])), losses
