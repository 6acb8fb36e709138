"""expand_step_rows: one row per trajectory (+ step records) -> padded step rows (optionally merged)."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from verl.trainer.ppo.core_algos import get_adv_estimator_fn

from tests.stepwise.helpers import trajectory_advantages
from verl_traj.stepwise.expand import (
    StepExpansionError,
    expand_step_rows,
    steps_from_row,
)

from verl_traj.testing import step_record_batch as make_batch, token_trajectory as make_trajectory

PAD = 0


def unpadded(out, i):
    t = out.tensors
    P = t["prompts"].shape[1]
    a = t["attention_mask"][i]
    pl, rl = int(a[:P].sum()), int(a[P:].sum())
    return t["prompts"][i, P - pl:], t["responses"][i, :rl], t["response_mask"][i, :rl], t["rollout_log_probs"][i, :rl]


def test_expand_without_merge_one_row_per_step():
    rng = np.random.default_rng(0)
    trajs = [make_trajectory(rng, 3), make_trajectory(rng, 1), make_trajectory(rng, 4)]
    tensors, non = make_batch(trajs, ["g0", "g0", "g1"], [1.0, 0.0, 0.5])
    out = expand_step_rows(tensors, non)
    assert out.source_row.tolist() == [0, 0, 0, 1, 2, 2, 2, 2]
    assert out.non_tensors["step_index"].tolist() == [0, 1, 2, 0, 0, 1, 2, 3]
    assert out.non_tensors["is_last_step"].tolist() == [False, False, True, True, False, False, False, True]
    assert out.non_tensors["traj_id"].tolist() == ["T0"] * 3 + ["T1"] + ["T2"] * 4
    assert out.non_tensors["uid"].tolist() == ["g0"] * 4 + ["g1"] * 4
    assert "traj_steps" not in out.non_tensors
    i = 0
    for b, t in enumerate(trajs):
        for rec in t[0]:
            p, r, m, lp = unpadded(out, i)
            assert p.tolist() == rec["prompt_ids"] and r.tolist() == rec["response_ids"]
            assert m.tolist() == [1] * len(rec["response_ids"])
            assert torch.allclose(lp, torch.tensor(rec["response_logprobs"]))
            i += 1
    t = out.tensors
    assert torch.equal(t["input_ids"], torch.cat([t["prompts"], t["responses"]], 1))
    assert torch.equal(t["position_ids"], torch.clip(t["attention_mask"].cumsum(-1) - 1, min=0))
    # padding: prompts left, responses right
    P = t["prompts"].shape[1]
    assert bool((t["attention_mask"][:, P - 1] == 1).all())  # last prompt position always attended
    # reward once per trajectory, on its last step row's last response token
    rm = t["rm_scores"]
    assert rm.sum(-1).tolist() == [0, 0, 1.0, 0.0, 0, 0, 0, 0.5]
    r_len = t["attention_mask"][:, P:].sum(-1)
    assert rm[2, r_len[2] - 1] == 1.0
    assert out.stats.rows_before == out.stats.rows_after == 8


def test_expand_with_merge_reproduces_the_concatenated_row():
    rng = np.random.default_rng(1)
    trajs = [make_trajectory(rng, 3), make_trajectory(rng, 2)]
    tensors, non = make_batch(trajs, ["g0", "g0"], [1.0, 0.0])
    out = expand_step_rows(tensors, non, merge_prefix=True)
    assert out.source_row.tolist() == [0, 1] and out.source_steps == [[0, 1, 2], [0, 1]]
    assert out.non_tensors["is_last_step"].tolist() == [True, True]
    for b, (_, p, r, m, lp) in enumerate(trajs):
        pp, rr, mm, ll = unpadded(out, b)
        assert torch.equal(pp, p) and torch.equal(rr, r) and torch.equal(mm, m) and torch.allclose(ll, lp)
    assert out.stats.rows_before == 5 and out.stats.rows_after == 2
    assert out.stats.loss_tokens_before == out.stats.loss_tokens_after == int(sum(t[3].sum() for t in trajs))


def test_partial_merge_when_context_is_rewritten():
    rng = np.random.default_rng(2)
    trajs = [make_trajectory(rng, 4, break_at=2)]
    tensors, non = make_batch(trajs, ["g0"], [1.0], P=12, R=60)
    out = expand_step_rows(tensors, non, merge_prefix=True)
    assert out.source_steps == [[0, 1], [2, 3]]
    assert out.non_tensors["step_index"].tolist() == [0, 1]
    assert out.tensors["rm_scores"].sum(-1).tolist() == [0.0, 1.0]


def test_fallback_without_records_matches_records():
    rng = np.random.default_rng(3)
    # the fallback cuts at observation tokens: adjacent turns without an observation would be one step
    trajs = [make_trajectory(rng, 3, min_obs=1), make_trajectory(rng, 2, min_obs=1)]
    t1, n1 = make_batch(trajs, ["g0", "g0"], [1.0, 0.0])
    t2, n2 = make_batch(trajs, ["g0", "g0"], [1.0, 0.0], with_records=False, traj_ids=False)
    a = expand_step_rows(t1, n1)
    b = expand_step_rows(t2, n2)
    for k in a.tensors:
        assert torch.equal(a.tensors[k], b.tensors[k]), k
    assert b.non_tensors["traj_id"].tolist() == ["__row0"] * 3 + ["__row1"] * 2
    n2.pop("traj_steps")  # no records column at all
    c = expand_step_rows(t2, n2)
    assert torch.equal(c.tensors["responses"], a.tensors["responses"])


def test_steps_from_row_cuts_runs():
    p = torch.tensor([1, 2])
    r = torch.tensor([5, 6, 7, 8, 9, 10])
    m = torch.tensor([1, 1, 0, 0, 1, 0])
    steps = steps_from_row(p, r, m)
    assert [s["prompt_ids"].tolist() for s in steps] == [[1, 2], [1, 2, 5, 6, 7, 8]]
    assert [s["response_ids"].tolist() for s in steps] == [[5, 6], [9]]
    assert len(steps_from_row(p, r[:0], m[:0])) == 1


def test_stepwise_advantages_end_to_end_merged_equals_unmerged_per_loss_token():
    rng = np.random.default_rng(4)
    trajs = [make_trajectory(rng, 3), make_trajectory(rng, 2), make_trajectory(rng, 4), make_trajectory(rng, 1)]
    tensors, non = make_batch(trajs, ["g0", "g0", "g1", "g1"], [1.0, 0.0, 0.2, 0.7])
    fn = get_adv_estimator_fn("grpo")
    res = {}
    for merge in (False, True):
        out = expand_step_rows(tensors, non, merge_prefix=merge)
        t, nt = out.tensors, out.non_tensors
        adv, *_ = trajectory_advantages(
            t["rm_scores"], t["response_mask"], nt["uid"], nt["traj_id"], nt["is_last_step"], estimator_fn=fn
        )
        assert torch.count_nonzero(adv * (1 - t["response_mask"])) == 0
        # loss-token advantages in trajectory order
        res[merge] = torch.cat([adv[i][t["response_mask"][i] != 0] for i in range(adv.shape[0])])
        # every step row of a rewarded trajectory carries its advantage on each of its own loss tokens
        for i in range(adv.shape[0]):
            vals = adv[i][t["response_mask"][i] != 0]
            assert vals.numel() == 0 or torch.allclose(vals, vals[0].expand_as(vals))
    assert torch.allclose(res[False], res[True])


def test_errors():
    rng = np.random.default_rng(5)
    trajs = [make_trajectory(rng, 2)]
    tensors, non = make_batch(trajs, ["g0"], [1.0])
    with pytest.raises(StepExpansionError, match="routed_experts"):
        expand_step_rows({**tensors, "routed_experts": torch.zeros(1, 52, 2, 2)}, non)
    out = expand_step_rows({**tensors, "routed_experts": torch.zeros(1, 52, 2, 2)}, non, drop_keys=["routed_experts"])
    assert "routed_experts" not in out.tensors
    with pytest.raises(StepExpansionError, match="M-RoPE"):
        expand_step_rows({**tensors, "position_ids": torch.zeros(1, 4, 52, dtype=torch.long)}, non)
    recs = np.empty(1, dtype=object)
    recs[0] = [{"prompt_ids": [1], "response_ids": [2]}]
    with pytest.raises(StepExpansionError, match="response_logprobs"):
        expand_step_rows(tensors, {**non, "traj_steps": recs})
    with pytest.raises(StepExpansionError, match="response_width"):
        expand_step_rows(tensors, non, response_width=1)
    with pytest.raises(StepExpansionError, match="prompts"):
        expand_step_rows({k: v for k, v in tensors.items() if k != "prompts"}, non)
    # per-row tensors are repeated, unknown per-token ones rejected
    out = expand_step_rows({**tensors, "score": torch.tensor([3.0])}, non)
    assert out.tensors["score"].tolist() == [3.0, 3.0]
    with pytest.raises(StepExpansionError, match="per-token"):
        expand_step_rows({**tensors, "weird": torch.zeros(1, 40)}, non)


def test_widths_and_multiple():
    rng = np.random.default_rng(6)
    tensors, non = make_batch([make_trajectory(rng, 2)], ["g0"], [1.0])
    out = expand_step_rows(tensors, non, pad_to_multiple_of=16)
    assert out.tensors["prompts"].shape[1] % 16 == 0 and out.tensors["responses"].shape[1] % 16 == 0
    out = expand_step_rows(tensors, non, prompt_width=64, response_width=48)
    assert out.tensors["input_ids"].shape == (2, 112)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 5), min_size=1, max_size=5), st.booleans(), st.integers(0, 10_000))
def test_property_loss_tokens_and_logprobs_preserved(steps_per_traj, merge, seed):
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    trajs = [make_trajectory(rng, n, break_at=(1 if n > 2 and rng.random() < 0.3 else None)) for n in steps_per_traj]
    R = max(int(t[2].numel()) for t in trajs) + 1
    tensors, non = make_batch(trajs, [f"g{i // 2}" for i in range(len(trajs))], list(rng.random(len(trajs))), R=R)
    out = expand_step_rows(tensors, non, merge_prefix=merge)
    t = out.tensors
    for b, tr in enumerate(trajs):
        rows = (out.source_row == b).nonzero().reshape(-1).tolist()
        ids = torch.cat([t["responses"][i][t["response_mask"][i] != 0] for i in rows])
        lps = torch.cat([t["rollout_log_probs"][i][t["response_mask"][i] != 0] for i in rows])
        exp_ids = torch.cat([torch.tensor(r["response_ids"]) for r in tr[0]])
        exp_lps = torch.cat([torch.tensor(r["response_logprobs"]) for r in tr[0]])
        assert torch.equal(ids, exp_ids) and torch.allclose(lps, exp_lps)
        assert float(t["rm_scores"][rows].sum()) == pytest.approx(float(tensors["rm_scores"][b].sum()))
        assert out.non_tensors["is_last_step"][rows].tolist() == [False] * (len(rows) - 1) + [True]
        # observation / padding positions carry no log-prob
        assert torch.count_nonzero(t["rollout_log_probs"][rows] * (1 - t["response_mask"][rows])) == 0
    assert out.stats.loss_tokens_before == out.stats.loss_tokens_after


def test_encoded_records_roundtrip_and_expand_identically():
    from verl_traj.stepwise.expand import decode_step_records, encode_step_records

    rng = np.random.default_rng(7)
    trajs = [make_trajectory(rng, 4, break_at=2), make_trajectory(rng, 3)]
    t1, n1 = make_batch(trajs, ["g0", "g0"], [1.0, 0.0], R=60)
    enc = np.empty(2, dtype=object)
    enc[:] = [encode_step_records(t[0]) for t in trajs]
    # compact: the chained steps store only their new tokens
    assert enc[1]["steps"][1]["prompt_tail_ids"].size < len(trajs[1][0][1]["prompt_ids"])
    for t, e in zip(trajs, enc):
        dec = decode_step_records(e)
        assert [d["prompt_ids"].tolist() for d in dec] == [r["prompt_ids"] for r in t[0]]
    n2 = {**n1, "traj_steps": enc}
    for merge in (False, True):
        a = expand_step_rows(t1, n1, merge_prefix=merge)
        b = expand_step_rows(t1, n2, merge_prefix=merge)
        for k in a.tensors:
            assert torch.equal(a.tensors[k], b.tensors[k]), k
    with pytest.raises(StepExpansionError, match="prompt_prefix_len"):
        decode_step_records([{"prompt_prefix_len": 5, "prompt_tail_ids": [1], "response_ids": [2]}])


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 6), min_size=1, max_size=4), st.integers(0, 10_000))
def test_property_delta_encoded_fast_path_equals_decode_then_merge(steps_per_traj, seed):
    from verl_traj.stepwise.expand import encode_step_records

    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    trajs = []
    for n in steps_per_traj:
        brk = int(rng.integers(1, n)) if n > 1 and rng.random() < 0.5 else None
        trajs.append(make_trajectory(rng, n, break_at=brk))
    R = max(int(t[2].numel()) for t in trajs) + 1
    tensors, non = make_batch(trajs, ["g"] * len(trajs), list(rng.random(len(trajs))), R=R)
    enc = np.empty(len(trajs), dtype=object)
    enc[:] = [encode_step_records(t[0]) for t in trajs]
    slow = expand_step_rows(tensors, non, merge_prefix=True)  # full records: generic path
    fast = expand_step_rows(tensors, {**non, "traj_steps": enc}, merge_prefix=True)
    assert slow.source_steps == fast.source_steps
    for k in slow.tensors:
        assert torch.equal(slow.tensors[k], fast.tensors[k]), k
    for k in ("step_index", "is_last_step", "traj_id", "uid"):
        assert list(slow.non_tensors[k]) == list(fast.non_tensors[k])
    assert slow.stats == fast.stats
