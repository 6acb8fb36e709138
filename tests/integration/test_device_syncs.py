"""Device-to-host syncs of a planned update through verl's real FSDP2 engine on CPU (issue 40, items 3-4), counted
with the torch profiler (``aten::_local_scalar_dense`` is recorded for every ``.item()`` / ``int()`` / ``bool()`` of
a tensor, CPU tensors included), beside stock verl's worker and loss on the same rows:

* per micro-batch (everything inside verl's ``micro_batch<i>`` range: the inputs, the forward, the loss, the backward)
  verl_traj's update reads the device no more often than stock verl's, for (a) rows, (b) prefix trees and (c) GSPO at
  trajectory scope (on trees, the ratio taken in the loss; on rows, the training micro-batches beside the pre-pass);
  over the whole update no more often either;
* the prefix-tree passes build each tree from the plan's facts: a marked pass without them, or with facts that do not
  reproduce the rows, raises naming the field;
* inference passes on trees (a reference worker never updates; a Ulysses rank returns no output) leave a log of
  constant size, which an update resets on every rank.

Both updates see the same rows in mini-batches of the same size, one micro-batch each (a cap above every
mini-batch's tokens), so verl's own per-row reads (``no_padding_2_padding``) are the same on both sides.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from unittest import mock

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from verl_traj.testing.engine import free_port

pytestmark = pytest.mark.dist

GROUPS, N, MINI_BATCHES = 4, 3, 2
_MICRO = re.compile(r"micro_batch\d+$")
SINK_METRICS = ("actor/loss_weight_mass", "actor/traj_seq_ratio_shift_abs_max")


def _batch(vocab: int, seed: int):
    """GRPO: ``GROUPS`` groups of ``N`` rows behind one prompt each (responses of 6-20 tokens, an observation span
    masked out of the loss), in verl's left/right-padded layout."""
    from verl_traj.testing import as_dataproto

    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(GROUPS):
        prompt = torch.randint(3, vocab, (int(torch.randint(12, 24, (1,), generator=g)),), generator=g)
        for _ in range(N):
            resp = torch.randint(3, vocab, (int(torch.randint(6, 20, (1,), generator=g)),), generator=g)
            mask = torch.ones(resp.numel())
            mask[2:4] = 0
            rows.append((prompt, resp, mask))
    P, R, B = max(len(r[0]) for r in rows), max(len(r[1]) for r in rows), len(rows)
    ids, attn = torch.zeros(B, P + R, dtype=torch.long), torch.zeros(B, P + R, dtype=torch.long)
    mask = torch.zeros(B, R)
    for i, (p, r, m) in enumerate(rows):
        ids[i, P - len(p):P], ids[i, P:P + len(r)] = p, r
        attn[i, P - len(p):P + len(r)] = 1
        mask[i, :len(m)] = m
    tensors = {"input_ids": ids, "prompts": ids[:, :P].clone(), "responses": ids[:, P:].clone(),
               "attention_mask": attn, "position_ids": torch.clamp(torch.cumsum(attn, -1) - 1, min=0),
               "response_mask": mask.long(), "old_log_probs": -torch.rand(B, R, generator=g) * mask,
               "advantages": (torch.randn(B, 1, generator=g) * mask).contiguous()}
    return as_dataproto(tensors, {"uid": np.array([f"u{i // N}" for i in range(B)], dtype=object)})


def _config(gspo: bool):
    from verl_traj.testing.engine import cpu_config

    return cpu_config([
        f"actor_rollout_ref.actor.ppo_mini_batch_size={GROUPS // MINI_BATCHES}", f"actor_rollout_ref.rollout.n={N}",
        f"data.train_batch_size={GROUPS}", "actor_rollout_ref.actor.use_dynamic_bsz=true",
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=4096", "actor_rollout_ref.model.use_remove_padding=true",
        "actor_rollout_ref.model.override_config.attn_implementation=cpu_varlen",
        *(["actor_rollout_ref.actor.policy_loss.loss_mode=gspo",
           "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean"] if gspo else [])])


def _scope(event) -> tuple:
    """(the ``micro_batch<i>`` range an event runs in, or None; whether it runs inside GSPO's pre-pass)."""
    micro, node = None, event.cpu_parent
    while node is not None:
        if node.name == "traj_gspo_prepass":
            return micro, True
        if micro is None and _MICRO.match(node.name):
            micro = node.id
        node = node.cpu_parent
    return micro, False


def _syncs(update) -> dict:
    """Run ``update()`` under the profiler: syncs per training micro-batch (verl's ``micro_batch<i>`` ranges outside
    GSPO's pre-pass, in order) and in all; and the metrics verl_traj's loss leaves in its sink, as reported."""
    from torch.profiler import ProfilerActivity, profile
    from verl.utils import tensordict_utils as tu

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        output = update()
    metrics = tu.get(output, "metrics")
    events = prof.events()
    ranges = [e.id for e in sorted(events, key=lambda e: e.time_range.start)
              if _MICRO.match(e.name) and not _scope(e)[1]]
    reads = [e for e in events if e.name == "aten::_local_scalar_dense"]
    per = Counter(_scope(e)[0] for e in reads)
    return {"per_micro_batch": [per[r] for r in ranges], "total": len(reads),
            "sink": {k: [float(x) for x in metrics.get(k, [])] for k in SINK_METRICS}}


def _planned(cfg, seed: int, vocab: int, tree: bool = False, ratio: str = ""):
    """A batch planned as the trainer plans it (``ratio``: GSPO at trajectory scope, each group's rows one
    trajectory; ``in_loss`` on an all-atomic tree plan, ``prepass`` else)."""
    from verl_traj.core.keys import IS_PADDING, OLD_LOG_PROBS_AT_START, RATIO_GROUP, RATIO_IN_LOSS
    from verl_traj.testing.engine import plan_for_update

    batch = _batch(vocab, seed)
    plan = plan_for_update(batch, cfg, 1, mode="seq-mean-token-mean" if ratio else "token-mean",
                           ratio_groups=bool(ratio), **({"prefix_tree": True} if tree else {}))
    assert int(plan.stats.micro_batches.sum()) == MINI_BATCHES  # one micro-batch per mini-batch, as stock's
    if ratio:
        group = torch.as_tensor(np.unique(batch.non_tensor_batch["uid"].astype(str), return_inverse=True)[1])
        batch.batch[RATIO_GROUP] = torch.where(batch.batch[IS_PADDING], -1, group.reshape(-1))
        batch.meta_info[RATIO_IN_LOSS] = ratio == "in_loss" and plan.all_trajectories_atomic
        batch.meta_info[OLD_LOG_PROBS_AT_START] = False  # the synthetic old log-probs: the pre-pass runs every step
    return batch


def _update(worker, batch):
    from verl_traj.testing.engine import rank_tensordict

    return lambda: worker.train_mini_batch(rank_tensordict(batch, 0, 1, GROUPS // MINI_BATCHES * N))


def _counts(cfg, variants: dict) -> dict:
    """Syncs of stock verl's update and of each of verl_traj's ``variants`` (name -> (tree, ratio)), each after one
    warm-up update of its worker."""
    from verl_traj.testing.engine import actor_worker

    stock, traj = actor_worker(cfg, planned=False), actor_worker(cfg, planned=True)
    vocab = int(traj.model_config.hf_config.vocab_size)
    _update(stock, _batch(vocab, 0))()
    _update(traj, _planned(cfg, 0, vocab))()
    out = {"stock": _syncs(_update(stock, _batch(vocab, 1)))}
    for name, (tree, ratio) in variants.items():
        out[name] = _syncs(_update(traj, _planned(cfg, 1, vocab, tree, ratio)))
    return out, traj, vocab


def _held(obj) -> int:
    """Entries held by ``obj``'s containers (lists, tuples, dicts, sets: their lengths) and tensors (their elements),
    recursively through its attributes: what a log that grows would add to."""
    if isinstance(obj, torch.Tensor):
        return obj.numel()
    if isinstance(obj, dict):
        return len(obj) + sum(_held(v) for v in obj.values())
    if isinstance(obj, (list, tuple, set)):
        return len(obj) + sum(_held(v) for v in obj)
    return _held(vars(obj)) if hasattr(obj, "__dict__") else 0


def _infer_log(worker, cfg, vocab: int) -> dict:
    """Inference passes on trees (as a reference worker runs them), then an update on a rank without output."""
    from verl.utils import tensordict_utils as tu

    from verl_traj.core.keys import TREE_SEGMENT
    from verl_traj.testing.engine import rank_tensordict

    batch = _planned(cfg, 2, vocab, tree=True)

    def infer(**changes):
        td = rank_tensordict(batch, 0, 1, len(batch))
        tu.assign_non_tensor(td, compute_loss=False)  # verl's log-prob pass
        for key, value in changes.items():
            td.pop(key) if value is None else td.set(key, value)
        return worker.infer_batch(td)

    sizes = []
    for _ in range(3):
        infer()
        sizes.append(_held(worker._infer_trees))
    counted = worker._infer_trees.micro_batches
    raised = {}
    for name, changes in (("missing", {TREE_SEGMENT: None}),
                          ("corrupt", {TREE_SEGMENT: torch.roll(batch.batch[TREE_SEGMENT], 1, 0)})):
        try:
            infer(**changes)
        except Exception as e:  # noqa: BLE001 -- the test reports what was raised
            raised[name] = [type(e).__name__, getattr(e, "field", None), str(e)[:300]]
    with mock.patch.object(type(worker.engine), "is_mp_src_rank_with_outputs", return_value=False):
        output = _update(worker, batch)()
    return {"sizes": sizes, "counted": counted, "raised": raised, "no_output": output is None,
            "after_update": worker._infer_trees.micro_batches}


def _proc(rank, world, port, home, out_path, gspo):
    from verl_traj.testing.engine import init_rank

    init_rank(rank, world, port, home)
    import torch.distributed as dist

    try:
        cfg = _config(gspo)
        variants = ({"tree_in_loss": (True, "in_loss"), "rows_prepass": (False, "prepass")} if gspo
                    else {"rows": (False, ""), "tree": (True, "")})
        res, worker, vocab = _counts(cfg, variants)
        if not gspo:
            res["infer_log"] = _infer_log(worker, cfg, vocab)
        with open(out_path, "w") as f:
            json.dump(res, f)
    finally:
        dist.destroy_process_group()


def _run(home, tmp_path, gspo: bool) -> dict:
    out = str(tmp_path / f"syncs_{gspo}.json")
    mp.spawn(_proc, args=(1, free_port(), home, out, gspo), nprocs=1, join=True)
    with open(out) as f:
        return json.load(f)


def _no_more_than_stock(res: dict, name: str) -> None:
    stock, ours = res["stock"], res[name]
    assert len(ours["per_micro_batch"]) == len(stock["per_micro_batch"]) == MINI_BATCHES, res
    assert max(ours["per_micro_batch"]) <= min(stock["per_micro_batch"]), (name, res)
    assert ours["total"] <= stock["total"], (name, res)


def test_rows_and_trees_read_the_device_no_more_than_stock_and_tree_logs_stay_bounded(tiny_home, tmp_path):
    from verl_traj.core.keys import TREE_SEGMENT

    res = _run(tiny_home.parent, tmp_path, gspo=False)
    print(json.dumps(res))
    _no_more_than_stock(res, "rows")  # (a)
    _no_more_than_stock(res, "tree")  # (b)
    for name in ("rows", "tree"):  # what the loss left in the update's sink, reported per optimizer step
        assert res[name]["sink"]["actor/loss_weight_mass"] == pytest.approx([1.0] * MINI_BATCHES, rel=1e-5), res
    log = res["infer_log"]
    assert log["counted"] == 3 * MINI_BATCHES and len(set(log["sizes"])) == 1, log  # three passes, constant size
    assert log["no_output"] and log["after_update"] == 0, log  # reset on a rank that returns nothing
    assert log["raised"]["missing"][:2] == ["TrajInputError", TREE_SEGMENT], log
    assert log["raised"]["corrupt"][:2] == ["TrajInputError", TREE_SEGMENT], log


def test_gspo_at_trajectory_scope_reads_the_device_no_more_than_stock_gspo(tiny_home, tmp_path):
    res = _run(tiny_home.parent, tmp_path, gspo=True)
    print(json.dumps(res))
    _no_more_than_stock(res, "tree_in_loss")  # (c): the trajectory's ratio from the loss, no pre-pass
    for name in ("tree_in_loss", "rows_prepass"):  # the synthetic old log-probs: each row's ratio is not its group's
        assert len(res[name]["sink"]["actor/traj_seq_ratio_shift_abs_max"]) == MINI_BATCHES, res
        assert min(res[name]["sink"]["actor/traj_seq_ratio_shift_abs_max"]) > 1e-3, res
    stock, prepass = res["stock"], res["rows_prepass"]  # the pre-pass is an extra forward: its training micro-batches
    assert max(prepass["per_micro_batch"]) <= min(stock["per_micro_batch"]), res
