"""Validation at the boundaries (issue 20, item 10).

What enters from verl, an agent loop or the user is checked where it enters: every refusal is a
:class:`~verl_traj.core.TrajInputError` whose ``field`` names the input and appears in the message
(with the value and the fix). A property test drives random, partly malformed inputs through the
public functions: each call either refuses with such an error or returns a result that satisfies the
plan's invariants. Then one worked example per refused input.
"""

from __future__ import annotations

import math
import pickle
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.core.plan_checks import check_plan
from verl_traj.config import TrajConfig, TrajConfigError
from verl_traj.core import (
    BatchLayoutError,
    TrajInputError,
    apply_plan,
    build_layout,
    build_layout_from_counts,
    check_binary_mask,
    check_finite,
    compute_loss_weights,
    loss_weight_modes,
    plan_mini_batches,
    register_loss_weight,
    resolve_pad_token_id,
)
from verl_traj.core.plan.loss_weights import LOSS_WEIGHT_FNS
from verl_traj.stepwise.advantages import StepwiseAdvantageError, trajectory_scores
from verl_traj.stepwise.expand import StepExpansionError, decode_step_records, encode_step_records, expand_step_rows
from verl_traj.testing import random_batch, verl_tensors

NAN, INF = float("nan"), float("inf")


def assert_names_its_field(err: BaseException) -> None:
    assert isinstance(err, TrajInputError), f"{type(err).__name__}: {err}"
    assert err.field, f"no field on: {err}"
    assert err.field in str(err), (err.field, str(err))


def refuses(fn, *args, **kwargs) -> TrajInputError:
    with pytest.raises(TrajInputError) as exc:
        fn(*args, **kwargs)
    assert_names_its_field(exc.value)
    return exc.value


# ---------------------------------------------------------------------------------------------------------------------
# Property test: random, partly malformed batches through layout -> plan -> loss weights
# ---------------------------------------------------------------------------------------------------------------------

BAD_COUNTS = [0, -1, -7, 2.5, NAN, INF, -INF]
CORRUPTIONS = ["none", "none", "none", "count", "loss_gt", "uid_none", "uid_nan", "uid_mixed", "traj_none",
               "traj_nan", "traj_mixed", "step_dup", "step_frac", "mask_value"]


@st.composite
def batches(draw):
    """Rows of 1..4 groups of trajectories with valid steps and counts, then at most one corruption."""
    n = draw(st.integers(1, 10))
    num_traj = draw(st.integers(1, n))
    row_traj = np.array(draw(st.lists(st.integers(0, num_traj - 1), min_size=n, max_size=n)))
    row_traj[:num_traj] = np.arange(num_traj)  # every trajectory has a row
    row_traj = row_traj[np.array(draw(st.permutations(list(range(n)))))]
    traj_group = np.array(draw(st.lists(st.integers(0, 3), min_size=num_traj, max_size=num_traj)))
    pad = np.array(draw(st.lists(st.booleans(), min_size=n, max_size=n))) if draw(st.booleans()) else None
    steps = np.zeros(n, dtype=np.int64)  # 0..n_t-1 over the real rows of each trajectory
    for t in range(num_traj):
        rows = (row_traj == t) & (True if pad is None else ~pad)
        steps[rows] = np.arange(int(rows.sum()))
    tokens = np.array(draw(st.lists(st.integers(1, 40), min_size=n, max_size=n)), dtype=np.int64)
    loss = np.minimum(tokens - 1, np.array(draw(st.lists(st.integers(0, 40), min_size=n, max_size=n))))
    if pad is not None:
        loss[pad] = 0  # a row flagged padding carries no loss token (one that does is refused)
    use_traj = draw(st.booleans())
    int_ids = draw(st.booleans())
    uid = traj_group[row_traj] if int_ids else np.array([f"g{g}" for g in traj_group[row_traj]], dtype=object)
    traj_id = row_traj * 10 if int_ids else np.array([f"t{t}" for t in row_traj], dtype=object)
    case = dict(tokens=tokens.astype(object), loss=loss.astype(object), uid=uid.astype(object),
                traj_id=traj_id.astype(object), steps=steps.astype(object), use_traj=use_traj, corruption=draw(st.sampled_from(CORRUPTIONS)),
                masks=draw(st.booleans()), mask_bad=draw(st.sampled_from([2, -1, 0.5, NAN])))
    r = draw(st.integers(0, n - 1))
    kind = case["corruption"]
    if kind == "count":
        case[draw(st.sampled_from(["tokens", "loss"]))][r] = draw(st.sampled_from(BAD_COUNTS))
    elif kind == "loss_gt":
        case["loss"][r] = int(tokens[r]) + draw(st.integers(1, 5))
    elif kind in ("uid_none", "traj_none"):
        case["uid" if kind == "uid_none" else "traj_id"][r] = None
    elif kind in ("uid_nan", "traj_nan"):
        case["uid" if kind == "uid_nan" else "traj_id"][r] = NAN
    elif kind in ("uid_mixed", "traj_mixed"):
        col = case["uid" if kind == "uid_mixed" else "traj_id"]
        col[r] = str(col[r]) if int_ids else 1
    elif kind == "step_dup" and n > 1:
        case["steps"][r] = case["steps"][(r + 1) % n]
    elif kind == "step_frac":
        case["steps"][r] = case["steps"][r] + 0.5
    case["pad"] = pad
    case["repr"] = draw(st.sampled_from(["numpy", "torch", "list"]))
    return case


def _as_repr(values: np.ndarray, how: str):
    as_float = np.array([float(v) for v in values])
    whole = np.all(np.isfinite(as_float)) and np.all(as_float == np.round(as_float))
    if how == "list":
        return list(values)
    arr = as_float.astype(np.int64) if whole else as_float
    return torch.from_numpy(arr) if how == "torch" else arr


def _masks(tokens: np.ndarray, loss: np.ndarray, bad, corrupt: bool):
    """[B, L] attention mask (left part prompt) and [B, R] response mask with the given counts."""
    R = max(int(max(loss)), 1)
    L = max(int(max(tokens)), R) + R
    attn = (torch.arange(L)[None, :] >= (L - torch.as_tensor(tokens.astype(np.int64)))[:, None]).long()
    resp = (torch.arange(R)[None, :] < torch.as_tensor(loss.astype(np.int64))[:, None]).long()
    if corrupt:
        resp = resp.double() if isinstance(bad, float) else resp
        resp[0, 0] = bad
    return attn, resp


def _layout_of(case):
    kw = dict(uid=case["uid"], is_padding=case["pad"])
    if case["use_traj"]:
        kw.update(traj_id=case["traj_id"], step_index=case["steps"])
    counts_ok = all(isinstance(v, int) and v >= 0 for v in list(case["tokens"]) + list(case["loss"]))
    if case["masks"] and counts_ok:
        attn, resp = _masks(case["tokens"], case["loss"], case["mask_bad"], case["corruption"] == "mask_value")
        return build_layout(attn, resp, **kw)
    return build_layout_from_counts(_as_repr(case["tokens"], case["repr"]), _as_repr(case["loss"], case["repr"]), **kw)


def _check_layout(lay, case):
    """What a returned layout promises: whole positive counts, loss <= tokens, dense ids, steps 0..n-1."""
    real = ~lay.is_padding
    tok, loss = lay.num_tokens[real], lay.num_loss_tokens[real]
    assert lay.num_tokens.dtype == torch.int64 and bool((tok >= 1).all()) and bool((loss >= 0).all())
    assert bool((loss <= tok).all())
    assert lay.traj_index[real].min() >= 0 and lay.traj_index[real].max() == lay.num_trajectories - 1
    assert sorted(set(lay.group_index[real].tolist())) == list(range(lay.num_groups))
    for t in range(lay.num_trajectories):
        rows = lay.traj_index == t
        assert sorted(lay.step_index[rows].tolist()) == list(range(int(rows.sum())))
        assert int(lay.is_last_step[rows].sum()) == 1
    # ids that were accepted are one type: no None, no NaN, never 1 next to "1"
    for col in ("uid", "traj_id") if case["use_traj"] else ("uid",):
        vals = [v for v, p in zip(case[col], lay.is_padding.tolist()) if not p]
        assert all(v is not None and v == v for v in vals)
        assert len({isinstance(v, str) for v in vals}) == 1


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=batches(), data=st.data())
def test_malformed_batches_refuse_with_a_named_field_or_plan_validly(case, data):
    try:
        lay = _layout_of(case)
    except Exception as err:  # noqa: BLE001 - the property: every refusal is a TrajInputError naming its field
        assert_names_its_field(err)
        if case["corruption"] == "none":  # a clean batch is refused only when every row is padding
            assert err.field == "is_padding" and case["pad"] is not None and case["pad"].all()
        return
    _check_layout(lay, case)
    group_by = data.draw(st.sampled_from(["group", "trajectory"]))
    units = lay.num_groups if group_by == "group" else lay.num_trajectories
    M, dp = data.draw(st.integers(1, units)), data.draw(st.integers(1, 3))
    plan = plan_mini_batches(lay, M, dp, group_by=group_by, seed=data.draw(st.integers(0, 99)))
    b = SimpleNamespace(is_padding=lay.is_padding.numpy(), num_tokens=lay.num_tokens.numpy(),
                        loss_len=lay.num_loss_tokens.numpy())
    check_plan(b, lay, plan, M, dp, group_by)
    _check_loss_weights(plan, lay, data)


def _check_loss_weights(plan, lay, data):
    order = plan.order.clamp(min=0)
    R = max(int(lay.num_loss_tokens.max()), 1)
    loss = torch.where(plan.is_padding, torch.zeros_like(order), lay.num_loss_tokens[order])
    mask = (torch.arange(R)[None, :] < loss[:, None]).long()
    mode = data.draw(st.sampled_from(list(loss_weight_modes()) + ["sum", "", None]))
    scale = data.draw(st.sampled_from([None, None, 1.0, 512, 0, -1.0, NAN, INF, True, "8"]))
    if data.draw(st.integers(0, 5)) == 0:
        mask = mask * 2  # a weighted "mask"
    try:
        w = compute_loss_weights(mode, mask, plan.mini_batch_id, plan.traj_index, plan.is_padding,
                                 loss_scale_factor=scale)
    except Exception as err:  # noqa: BLE001
        assert_names_its_field(err)
        return
    assert bool(torch.isfinite(w).all()) and bool((w >= 0).all()) and bool((w[plan.is_padding] == 0).all())
    if mode == "token-mean":  # every mini-batch with a loss token has its token weights summing to 1
        per_mb = torch.zeros(plan.num_mini_batches, dtype=torch.float64).index_add_(
            0, plan.mini_batch_id, (w.double() * mask.sum(-1)))
        has = torch.zeros(plan.num_mini_batches).index_add_(0, plan.mini_batch_id, mask.sum(-1).float()) > 0
        torch.testing.assert_close(per_mb[has], torch.ones(int(has.sum()), dtype=torch.float64))


CONFIG_VALUES = [True, False, None, "false", "true", "yes", 0, 1, -1, 1.5, 4096, "", "group", "trajectory", "tokens",
                 "units", "verl", "area", "token-mean", "traj-mean", "traj_id", "step_index", "traj_index", [1]]
CONFIG_KEYS = [f for f in TrajConfig.__dataclass_fields__] + ["micro_batch_max_token"]


@settings(max_examples=150, deadline=None)
@given(section=st.one_of(
    st.dictionaries(st.sampled_from(CONFIG_KEYS), st.sampled_from(CONFIG_VALUES), max_size=4),
    st.sampled_from([None, False, True, "traj", 3, [("enable", True)]]),
))
def test_malformed_traj_sections_refuse_with_a_named_field_or_parse_typed(section):
    try:
        cfg = TrajConfig.from_mapping(section)
    except Exception as err:  # noqa: BLE001
        assert_names_its_field(err)
        assert isinstance(err, TrajConfigError) and err.field.startswith("traj")
        return
    for name in ("enable", "balance_dp", "step_wise", "merge_prefix"):
        assert isinstance(getattr(cfg, name), bool)
    assert isinstance(cfg.seed, int) and not isinstance(cfg.seed, bool) and cfg.seed >= 0
    assert cfg.traj_id_key != cfg.step_index_key
    assert all(isinstance(getattr(cfg, f), str) for f in ("group_by", "mini_batch_balance", "workload", "padded_cap"))
    assert not (cfg.step_wise and not cfg.enable)


# ---------------------------------------------------------------------------------------------------------------------
# The error class
# ---------------------------------------------------------------------------------------------------------------------


def test_one_class_catches_every_boundary_error():
    for cls in (BatchLayoutError, TrajConfigError, StepwiseAdvantageError, StepExpansionError):
        assert issubclass(cls, TrajInputError) and issubclass(cls, ValueError)
    err = TrajInputError.invalid("traj.seed", -1, "is negative", "set traj.seed >= 0")
    assert str(err) == "traj.seed=-1 is negative. Fix: set traj.seed >= 0" and err.field == "traj.seed"
    assert str(TrajInputError("no room", field="uid")) == "uid: no room"  # the field is always in the message
    back = pickle.loads(pickle.dumps(TrajConfigError("traj.enable='false' is a str", field="traj.enable")))
    assert type(back) is TrajConfigError and back.field == "traj.enable" and str(back) == "traj.enable='false' is a str"


# ---------------------------------------------------------------------------------------------------------------------
# Worked examples, one per refused input
# ---------------------------------------------------------------------------------------------------------------------

UID3 = np.array(["a", "a", "b"], dtype=object)


@pytest.mark.parametrize("tokens, loss, field, needle", [
    ([5, -2, 4], [1, 1, 1], "num_tokens[1]", "is negative"),
    ([5, 0, 4], [1, 0, 1], "num_tokens[1]", "no attended token"),
    ([5, 2.5, 4], [1, 1, 1], "num_tokens[1]", "not a whole"),
    ([5, NAN, 4], [1, 1, 1], "num_tokens[1]", "not a whole, finite"),
    ([5, 6, 4], [1, INF, 1], "num_loss_tokens[1]", "not a whole, finite"),
    ([5, 6, 4], [1, 7, 1], "num_loss_tokens[1]", "exceeds num_tokens[1]=6"),
    ([5, 6, 4], [1, None, 1], "num_loss_tokens[1]", "is None"),
    ([5, 6, 4], ["1", "x", "1"], "num_loss_tokens", "not numeric"),
])
def test_token_counts_are_whole_positive_and_bound_the_loss_tokens(tokens, loss, field, needle):
    err = refuses(build_layout_from_counts, np.array(tokens), np.array(loss, dtype=object), UID3)
    assert err.field == field and needle in str(err) and "Fix:" in str(err)


def test_a_padding_row_may_be_empty_a_real_row_may_not():
    lay = build_layout_from_counts([5, 0, 4], [1, 0, 1], UID3, is_padding=[False, True, False])
    assert lay.num_real_rows == 2
    am = torch.tensor([[1, 1, 1], [0, 0, 0], [1, 1, 0]])
    err = refuses(build_layout, am, torch.zeros(3, 1, dtype=torch.long), UID3)
    assert err.field == "attention_mask.sum(-1)[1]"


@pytest.mark.parametrize("column, values, needle", [
    ("uid", ["a", None, "b"], "uid[1]=None is None"),
    ("uid", [1.0, NAN, 2.0], "uid[1]=nan is NaN"),
    ("uid", np.array(["a", NAN, "b"], dtype=object), "uid[1]=nan is NaN"),
    ("uid", np.array([1, "1", 2], dtype=object), "uid[0]=1 is a int but uid[1]='1' is a str"),
    ("traj_id", np.array(["t0", None, "t2"], dtype=object), "traj_id[1]=None"),
    ("traj_id", np.array([7, "7", 8], dtype=object), "traj_id[0]=7 is a int"),
])
def test_group_and_trajectory_ids_are_one_type_never_none_or_nan(column, values, needle):
    kw = dict(uid=np.array(["a", "a", "b"], dtype=object), traj_id=np.array(["t0", "t1", "t2"], dtype=object),
              step_index=np.zeros(3, dtype=np.int64))
    kw[column] = np.asarray(values, dtype=object) if not isinstance(values, np.ndarray) else values
    if column == "uid" and isinstance(values, list) and None not in values:
        kw[column] = np.array(values)  # a float array
    err = refuses(build_layout_from_counts, [5, 6, 4], [1, 1, 1], **kw)
    assert err.field.startswith(column) and needle in str(err)


def test_ids_on_input_padding_rows_are_not_checked():
    lay = build_layout_from_counts([5, 6, 4], [1, 0, 1], np.array(["a", None, "b"], dtype=object),
                                   is_padding=[False, True, False])
    assert lay.num_groups == 2


@pytest.mark.parametrize("bad", [2, -1, 0.5, NAN])
def test_masks_hold_only_zero_and_one(bad):
    attn = torch.ones(3, 4, dtype=torch.float32 if isinstance(bad, float) else torch.long)
    resp = torch.tensor([[1, 0], [1, 1], [0, 0]], dtype=attn.dtype)
    bad_resp = resp.clone()
    bad_resp[1, 1] = bad
    err = refuses(build_layout, attn, bad_resp, UID3)
    assert err.field == "response_mask" and "row 1" in str(err)
    bad_attn = attn.clone()
    bad_attn[2, 0] = bad
    assert refuses(build_layout, bad_attn, resp, UID3).field == "attention_mask"
    z = torch.zeros(3, dtype=torch.long)
    err = refuses(compute_loss_weights, "token-mean", bad_resp, z, torch.arange(3), z.bool())
    assert err.field == "response_mask"
    # bool and 0/1 float masks are masks
    assert build_layout(attn.bool(), resp.bool(), UID3).num_loss_tokens.tolist() == [1, 2, 0]
    assert build_layout(attn.float(), resp.float(), UID3).num_tokens.tolist() == [4, 4, 4]


def test_a_nan_reward_is_refused_where_trajectory_scores_are_formed():
    rewards = torch.tensor([[0.0, 0.0], [0.0, NAN], [1.0, 0.0], [0.0, 0.5]])
    traj_index, last_row = torch.tensor([0, 0, 1, 2]), torch.tensor([1, 2, 3])
    err = refuses(trajectory_scores, rewards, traj_index, last_row)
    assert isinstance(err, StepwiseAdvantageError) and err.field == "token_level_rewards"
    assert "trajectory index 0" in str(err) and "row 1" in str(err)
    # with "sum" the NaN row is found even when it is not the last step
    err = refuses(trajectory_scores, rewards, traj_index, torch.tensor([0, 2, 3]), "sum")
    assert "row 1" in str(err)
    # a NaN on an earlier step row that "last_step" ignores changes nothing
    assert trajectory_scores(rewards, traj_index, torch.tensor([0, 2, 3])).tolist() == [0.0, 1.0, 0.5]


def test_check_finite_names_the_field_the_row_and_the_fix():
    check_finite("token_level_rewards", torch.zeros(3, 2), "unused")
    check_finite("token_level_rewards", torch.zeros(3, 2, dtype=torch.long), "unused")
    err = refuses(check_finite, "token_level_rewards", torch.tensor([[0.0, 1.0], [INF, 0.0]]), "score failures as 0.")
    assert "1 non-finite value(s) (first: inf at row 1, column [0]" in str(err)
    assert "Fix: score failures as 0." in str(err)
    refuses(check_binary_mask, "response_mask", np.array([[0, 3]]))


@pytest.mark.parametrize("scale", [NAN, INF, -INF, 0, -2.0, True, "512", torch.tensor(NAN)])
def test_loss_scale_factor_is_a_finite_positive_number(scale):
    z = torch.zeros(2, dtype=torch.long)
    err = refuses(compute_loss_weights, "seq-mean-token-sum-norm", torch.ones(2, 3), z, torch.arange(2), z.bool(),
                  loss_scale_factor=scale)
    assert err.field == "loss_scale_factor"


def test_loss_scale_factor_valid_values_unchanged():
    z = torch.zeros(2, dtype=torch.long)
    for scale, expected in ((None, 1 / 6), (4, 1 / 8), (np.float64(4.0), 1 / 8), (torch.tensor(4.0), 1 / 8)):
        w = compute_loss_weights("seq-mean-token-sum-norm", torch.ones(2, 3), z, torch.arange(2), z.bool(),
                                 loss_scale_factor=scale)
        assert torch.allclose(w, torch.full((2,), expected))


def test_pad_token_id_falls_back_to_eos_and_refuses_neither():
    assert resolve_pad_token_id(0, 2) == 0  # a set pad token wins, even 0
    assert resolve_pad_token_id(None, 2) == 2  # verl's hf_tokenizer rule: pad = eos when missing
    assert resolve_pad_token_id(None, [7, 9]) == 7  # generation configs may list several eos ids
    assert resolve_pad_token_id(np.int64(3), None) == 3
    err = refuses(resolve_pad_token_id, None, None)
    assert err.field == "tokenizer.pad_token_id" and "pad_token = tokenizer.eos_token" in str(err)
    for bad in (-1, True, 1.5, "0"):
        assert refuses(resolve_pad_token_id, bad, 2).field == "tokenizer.pad_token_id"
    assert refuses(resolve_pad_token_id, None, -1).field == "tokenizer.eos_token_id"


def _small_plan():
    b = random_batch(0, 3, 1, 1, max_len=16)
    t = verl_tensors(b)
    lay = build_layout(t["attention_mask"], t["response_mask"], b.uid)
    return b, t, plan_mini_batches(lay, 1, 4)


def test_apply_plan_refuses_a_zero_d_tensor_and_a_scalar_column():
    b, t, plan = _small_plan()
    err = refuses(apply_plan, {**t, "temperature": torch.tensor(1.0)}, {"uid": b.uid}, plan)
    assert err.field == "tensors['temperature']" and "0-d" in str(err) and "meta_info" in str(err)
    err = refuses(apply_plan, t, {"uid": b.uid, "global_step": np.array(3)}, plan)
    assert err.field == "non_tensors['global_step']"
    assert refuses(apply_plan, t, {"uid": b.uid}, plan, pad_token_id=None).field == "pad_token_id"
    out, _ = apply_plan(t, {"uid": b.uid}, plan, pad_token_id=np.int64(5))
    assert (out["input_ids"][plan.is_padding] == 5).all()


def _one_row_batch(records):
    tensors = {
        "prompts": torch.tensor([[0, 1, 2]]), "responses": torch.tensor([[3, 4, 0]]),
        "attention_mask": torch.tensor([[0, 1, 1, 1, 1, 0]]), "response_mask": torch.tensor([[1, 1, 0]]),
    }
    non = {"uid": np.array(["g"], dtype=object), "traj_steps": np.empty(1, dtype=object)}
    non["traj_steps"][0] = records
    return tensors, non


def test_a_step_record_without_response_ids_is_refused():
    good = {"prompt_ids": [1, 2], "response_ids": [3, 4]}
    tensors, non = _one_row_batch({"steps": [good]})
    assert expand_step_rows(tensors, non).tensors["responses"].tolist() == [[3, 4]]
    for bad in ({"prompt_ids": [1, 2]}, {"prompt_ids": [1, 2], "response_ids": None}):
        tensors, non = _one_row_batch({"steps": [good, bad]})
        err = refuses(expand_step_rows, tensors, non)
        assert err.field == "response_ids" and "row 0 step record 1 has no response_ids" in str(err)
        for merge in (False, True):
            refuses(expand_step_rows, tensors, non, merge_prefix=merge)
        assert refuses(decode_step_records, [good, bad]).field == "response_ids"
        assert refuses(encode_step_records, [good, bad]).field == "response_ids"
    delta = encode_step_records([good])["steps"][0]
    del delta["response_ids"]
    tensors, non = _one_row_batch({"steps": [delta]})
    assert "row 0 step record 0 has no response_ids" in str(refuses(expand_step_rows, tensors, non, merge_prefix=True))
    tensors, non = _one_row_batch(["not a record"])
    assert refuses(expand_step_rows, tensors, non).field == "steps"


@pytest.mark.parametrize("section, field, needle", [
    ({"enable": "false"}, "traj.enable", "non-empty string is truthy"),
    ({"enable": None}, "traj.enable", "every start-up check keyed on it would be skipped"),
    ({"balance_dp": 1}, "traj.balance_dp", "a int is not a bool"),
    ({"merge_prefix": "no"}, "traj.merge_prefix", "traj.merge_prefix=true or traj.merge_prefix=false"),
    ({"step_wise": None}, "traj.step_wise", "null"),
    (False, "traj", "traj.enable=false"),
    (True, "traj", "traj.enable=true"),
    ("on", "traj", "not a mapping"),
    ({"seed": -1}, "traj.seed", "traj.seed=-1 is invalid"),
    ({"seed": 1.5}, "traj.seed", "non-negative int"),
    ({"seed": True}, "traj.seed", "traj.seed=True"),
    ({"seed": "7"}, "traj.seed", "traj.seed='7'"),
    ({"traj_id_key": "step", "step_index_key": "step"}, "traj.step_index_key", "both 'step'"),
    ({"traj_id_key": "traj_index"}, "traj.traj_id_key", "the plan would overwrite it"),
    ({"group_by": ["group"]}, "traj.group_by", "not one of"),
])
def test_traj_section_refuses_wrong_types(section, field, needle):
    err = refuses(TrajConfig.from_mapping, section)
    assert isinstance(err, TrajConfigError) and err.field == field and needle in str(err), str(err)


def test_traj_section_valid_values_unchanged():
    from omegaconf import OmegaConf

    cfg = TrajConfig.from_mapping(OmegaConf.create({"enable": False, "seed": 3, "balance_dp": False}))
    assert cfg.enable is False and cfg.seed == 3 and cfg.balance_dp is False
    assert TrajConfig.from_mapping(None) == TrajConfig()  # no traj section: the defaults


def test_a_loss_weight_mode_cannot_be_registered_twice_by_accident():
    builtin = LOSS_WEIGHT_FNS["token-mean"]
    err = refuses(register_loss_weight("token-mean"), lambda s: s.real)
    assert err.field == "loss_agg_mode" and "already registered" in str(err) and "override=True" in str(err)
    assert LOSS_WEIGHT_FNS["token-mean"] is builtin
    register_loss_weight("token-mean")(builtin)  # the same function again (a module re-import): accepted

    def rows(s):
        return s.real

    try:
        register_loss_weight("unit-test-override")(rows)
        replacement = register_loss_weight("unit-test-override", override=True)(lambda s: 2 * s.real)
        assert LOSS_WEIGHT_FNS["unit-test-override"] is replacement
        mask, z = torch.ones(2, 1), torch.zeros(2, dtype=torch.long)
        assert compute_loss_weights("unit-test-override", mask, z, torch.arange(2), z.bool()).tolist() == [2.0, 2.0]
    finally:
        LOSS_WEIGHT_FNS.pop("unit-test-override", None)
    assert refuses(register_loss_weight, "").field == "loss_agg_mode"


def test_clean_checks_are_cheap():
    """The per-step checks on a clean batch of thousands of rows cost milliseconds (one pass each)."""
    import time

    b = random_batch(1, 400, 4, 6)
    t = verl_tensors(b)
    start = time.perf_counter()
    lay = build_layout(t["attention_mask"], t["response_mask"], b.uid, b.traj_id, b.step_index, b.is_last_step)
    elapsed = time.perf_counter() - start
    assert lay.num_rows == b.num_rows and b.num_rows > 2000
    assert math.isfinite(elapsed) and elapsed < 2.0
