"""Fuzzing the pure core's entries (issue 28, item 8): a valid input, one random corruption, and only two outcomes
are accepted -- the correct result (where the corruption is harmless: a bool mask for an int one, whole floats for
ints) or a :class:`~verl_traj.core.TrajInputError` whose ``field`` is set and named in its message. Any other
exception (a raw ``IndexError`` / ``TypeError`` / ``RuntimeError`` from inside) fails the test, and so does a
harmful corruption that is accepted. Then one regression test per class of bug the fuzzing found."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.core.plan_checks import check_plan
from tests.fuzz import INF, NAN, refused, run
from verl_traj.core import (
    PackingError,
    PlanError,
    PlanSpec,
    TrajInputError,
    apply_plan,
    build_layout,
    build_layout_from_counts,
    compute_loss_weights,
    pack_micro_batches,
    plan_mini_batches,
    register_loss_weight,
    resolve_pad_token_id,
)
from verl_traj.core.plan.loss_weights import LOSS_WEIGHT_FNS
from verl_traj.testing import random_batch, verl_tensors


FUZZ = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _batch(seed: int, pad_rows: int = 0):
    b = random_batch(seed, 3, 2, 3, max_len=12, pad_rows=pad_rows)
    return b, verl_tensors(b)


def _real_row(b, rng) -> int:
    return int(rng.choice(np.flatnonzero(~b.is_padding)))


# ---------------------------------------------------------------------------------------------------------------------
# build_layout / build_layout_from_counts
# ---------------------------------------------------------------------------------------------------------------------


def _layout_corruption(kind: str, kw: dict, b, rng) -> str:
    """Apply ``kind`` to the build_layout kwargs in place; returns the expectation."""
    r = _real_row(b, rng)
    n = b.num_rows
    obj = lambda col: np.asarray(col, dtype=object).copy()  # noqa: E731
    if kind == "uid_short":
        kw["uid"] = kw["uid"][:-1]
    elif kind == "uid_2d":
        kw["uid"] = np.stack([kw["uid"], kw["uid"]], 1)
    elif kind in ("uid_none", "traj_none"):
        key = "uid" if kind == "uid_none" else "traj_id"
        kw[key] = obj(kw[key])
        kw[key][r] = None
    elif kind == "step_dup":
        same = np.flatnonzero((b.traj_id == b.traj_id[r]) & ~b.is_padding)
        steps = kw["step_index"].copy()
        steps[r] = steps[same[same != r][0]] if same.size > 1 else steps[r] + 1
        kw["step_index"] = steps
    elif kind == "step_neg":
        kw["step_index"] = kw["step_index"].copy()
        kw["step_index"][r] = -1
    elif kind in ("step_str", "step_nan", "step_frac"):
        steps = kw["step_index"].astype(object if kind == "step_str" else float)
        steps[r] = {"step_str": "x", "step_nan": NAN, "step_frac": steps[r] + 0.5}[kind]
        kw["step_index"] = steps
    elif kind == "step_float_whole":
        kw["step_index"] = kw["step_index"].astype(float)
        return "ok"
    elif kind == "last_flip":
        kw["is_last_step"] = kw["is_last_step"].copy()
        kw["is_last_step"][r] = not kw["is_last_step"][r]
    elif kind in ("last_two", "pad_two", "pad_nan", "pad_str"):
        key = "is_last_step" if kind == "last_two" else "is_padding"
        col = kw[key].astype(object if kind == "pad_str" else float)
        col[r] = {"last_two": 2, "pad_two": 2, "pad_nan": NAN, "pad_str": "yes"}[kind]
        kw[key] = col
    elif kind == "pad_with_loss":
        if b.loss_len[r] == 0:
            return "any"
        kw["is_padding"] = kw["is_padding"].copy()
        kw["is_padding"][r] = True
    elif kind in ("mask_two", "mask_half", "mask_nan"):
        m = kw["response_mask"].double()
        m[r, 0] = {"mask_two": 2, "mask_half": 0.5, "mask_nan": NAN}[kind]
        kw["response_mask"] = m
    elif kind == "mask_complex":
        kw["attention_mask"] = kw["attention_mask"].to(torch.complex64)
    elif kind == "mask_3d":
        kw["response_mask"] = kw["response_mask"][:, None, :]
    elif kind == "mask_rows":
        kw["response_mask"] = kw["response_mask"][:-1]
    elif kind in ("mask_bool", "mask_float", "mask_list"):
        m = kw["response_mask"]
        kw["response_mask"] = {"mask_bool": m.bool(), "mask_float": m.float(), "mask_list": m.tolist()}[kind]
        return "ok"
    elif kind == "mask_str":
        kw["attention_mask"] = kw["attention_mask"].numpy().astype(str)
    elif kind == "no_steps":
        kw["step_index"] = None
    elif kind == "no_mask":
        kw["response_mask"] = None
    elif kind == "ragged_uid":
        kw["uid"] = [[1, 2]] + [[1]] * (n - 1)
    else:
        return "ok"
    return "refuse"


LAYOUT_KINDS = ["none", "uid_short", "uid_2d", "uid_none", "traj_none", "step_dup", "step_neg", "step_str", "step_nan",
                "step_frac", "step_float_whole", "last_flip", "last_two", "pad_two", "pad_nan", "pad_str",
                "pad_with_loss", "mask_two", "mask_half", "mask_nan", "mask_complex", "mask_3d", "mask_rows",
                "mask_bool", "mask_float", "mask_list", "mask_str", "no_steps", "no_mask", "ragged_uid"]


def _same_layout(a, b) -> None:
    for name in ("traj_index", "group_index", "step_index", "is_last_step", "num_tokens", "num_loss_tokens",
                 "is_padding"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name


@FUZZ
@given(seed=st.integers(0, 10_000), pad_rows=st.integers(0, 2), kind=st.sampled_from(LAYOUT_KINDS))
def test_fuzz_build_layout(seed, pad_rows, kind):
    b, t = _batch(seed, pad_rows)
    kw = dict(attention_mask=t["attention_mask"], response_mask=t["response_mask"], uid=b.uid, traj_id=b.traj_id,
              step_index=b.step_index, is_last_step=b.is_last_step, is_padding=b.is_padding)
    clean = build_layout(**kw)
    expect = _layout_corruption(kind, kw, b, np.random.default_rng(seed))
    out = run(build_layout, expect, **kw)
    if out is not None and expect == "ok":
        _same_layout(out, clean)


COUNT_BAD = [-1, 2.5, NAN, INF, None, "7", 1 + 2j]


@FUZZ
@given(seed=st.integers(0, 10_000), which=st.sampled_from(["num_tokens", "num_loss_tokens"]),
       bad=st.sampled_from(COUNT_BAD + ["loss_gt", "short", "float_whole", "torch"]))
def test_fuzz_build_layout_from_counts(seed, which, bad):
    b, _ = _batch(seed, 1)
    kw = dict(num_tokens=b.num_tokens.copy(), num_loss_tokens=b.loss_len.copy(), uid=b.uid, traj_id=b.traj_id,
              step_index=b.step_index, is_last_step=b.is_last_step, is_padding=b.is_padding)
    clean = build_layout_from_counts(**kw)
    r = _real_row(b, np.random.default_rng(seed))
    expect = "refuse"
    if bad == "loss_gt":
        kw["num_loss_tokens"][r] = kw["num_tokens"][r] + 1
    elif bad == "short":
        kw[which] = kw[which][:-1]
    elif bad in ("float_whole", "torch"):
        kw[which] = kw[which].astype(float) if bad == "float_whole" else torch.from_numpy(kw[which])
        expect = "ok"
    else:
        col = kw[which].astype(object)
        col[r] = bad
        kw[which] = col
    out = run(build_layout_from_counts, expect, **kw)
    if out is not None:
        _same_layout(out, clean)


# ---------------------------------------------------------------------------------------------------------------------
# plan_mini_batches / PlanSpec
# ---------------------------------------------------------------------------------------------------------------------

PLAN_BAD = {  # option -> values that must be refused
    "num_mini_batches": [0, -1, 2.5, NAN, "2", None, True],
    "dp_size": [0, -2, 1.5, INF, "1", None],
    "micro_batch_max_tokens": [NAN, 0, -5, "100", 1.5, True, INF],
    "group_by": ["groups", None, ["group"], "Group"],
    "mini_batch_balance": ["token", 1],
    "workload": ["flops", None],
    "micro_batch_cost": ["area", "padded-area"],
    "balance_dp": ["false", 1, None],
    "pad_row_tokens": [1, NAN, "2"],
    "seed": [-1, 1.5, "x", None],
    "micro_batch_pass_cost": [-1, NAN, "x", INF, True],
    "group_bye": ["group"], "micro_batch_max_token": [100], "seeds": [1],  # misspelled options
    "partitioner": [5, "verl"],
}


@FUZZ
@given(seed=st.integers(0, 10_000), data=st.data())
def test_fuzz_plan_mini_batches(seed, data):
    b, _ = _batch(seed, data.draw(st.integers(0, 2)))
    layout = b.layout()
    group_by = data.draw(st.sampled_from(["group", "trajectory"]))
    units = layout.num_groups if group_by == "group" else layout.num_trajectories
    kw = dict(num_mini_batches=data.draw(st.integers(1, units)), dp_size=data.draw(st.integers(1, 3)),
              group_by=group_by, seed=data.draw(st.integers(0, 50)),
              micro_batch_max_tokens=data.draw(st.sampled_from([None, int(layout.num_tokens.max()) + 5])))
    option = data.draw(st.sampled_from(list(PLAN_BAD) + ["harmless", "too_many", "not_a_layout", "cap_below_row"]))
    expect, target = "refuse", layout
    if option == "harmless":  # numpy ints and whole floats are the ints they hold
        kw["num_mini_batches"], kw["dp_size"] = np.int64(kw["num_mini_batches"]), float(kw["dp_size"])
        expect = "ok"
    elif option == "too_many":
        kw["num_mini_batches"] = units + 1
    elif option == "not_a_layout":
        target = {"traj_index": layout.traj_index}
    elif option == "cap_below_row":
        kw["micro_batch_max_tokens"] = int(layout.num_tokens.max()) - 1
    else:
        kw[option] = data.draw(st.sampled_from(PLAN_BAD[option]))
    M, dp = kw.pop("num_mini_batches"), kw.pop("dp_size")
    plan = run(plan_mini_batches, expect, target, M, dp, **kw)
    if plan is not None:
        b2 = SimpleNamespace(is_padding=layout.is_padding.numpy(), num_tokens=layout.num_tokens.numpy(),
                             loss_len=layout.num_loss_tokens.numpy())
        check_plan(b2, layout, plan, int(M), int(dp), group_by, cap=kw.get("micro_batch_max_tokens"))


# ---------------------------------------------------------------------------------------------------------------------
# apply_plan
# ---------------------------------------------------------------------------------------------------------------------

APPLY_KINDS = ["none", "prompts_wider", "prompt_length_L", "prompt_length_0", "prompt_length_nan", "prompt_length_str",
               "prompt_length_ok", "attention_1d", "tensor_rows", "tensor_0d", "tensor_list", "scalar_column",
               "ragged_column", "column_rows", "tensors_list", "plan_dict", "pad_neg", "pad_float", "pad_bool",
               "pad_none", "pad_np"]


def _apply_corruption(kind: str, t: dict, nt: dict, kw: dict, plan):
    """Apply ``kind``; returns (tensors, non_tensors, plan, expectation)."""
    B, L = t["attention_mask"].shape
    if kind == "prompts_wider":
        t["prompts"] = torch.zeros(B, L + 1, dtype=torch.long)
    elif kind.startswith("prompt_length"):
        P = t.pop("prompts").shape[1]
        kw["prompt_length"] = {"prompt_length_L": L, "prompt_length_0": 0, "prompt_length_nan": NAN,
                               "prompt_length_str": "5", "prompt_length_ok": P}[kind]
        return t, nt, plan, "ok" if kind == "prompt_length_ok" else "refuse"
    elif kind == "attention_1d":
        t["attention_mask"] = t["attention_mask"].sum(-1)
    elif kind == "tensor_rows":
        t["rm_scores"] = t["rm_scores"][:-1]
    elif kind == "tensor_0d":
        t["temperature"] = torch.tensor(1.0)
    elif kind == "tensor_list":
        t["rm_scores"] = t["rm_scores"].tolist()
    elif kind == "scalar_column":
        nt["global_step"] = np.array(3)
    elif kind == "ragged_column":
        nt["extra"] = [[1, 2]] + [[1]] * (B - 1)
    elif kind == "column_rows":
        nt["uid"] = nt["uid"][:-1]
    elif kind == "tensors_list":
        t = list(t.values())
    elif kind == "plan_dict":
        plan = {"order": plan.order}
    elif kind.startswith("pad_"):
        kw["pad_token_id"] = {"pad_neg": -1, "pad_float": 1.5, "pad_bool": True, "pad_none": None,
                              "pad_np": np.int64(0)}[kind]
        return t, nt, plan, "ok" if kind == "pad_np" else "refuse"
    else:
        return t, nt, plan, "ok"
    return t, nt, plan, "refuse"


@FUZZ
@given(seed=st.integers(0, 10_000), dp=st.integers(2, 4), kind=st.sampled_from(APPLY_KINDS))
def test_fuzz_apply_plan(seed, dp, kind):
    b, t = _batch(seed)
    plan = plan_mini_batches(b.layout(), 1, dp)
    nt = {"uid": b.uid, "traj_id": b.traj_id, "step_index": b.step_index, "is_last_step": b.is_last_step,
          "raw_prompt": np.array([{"q": i} for i in range(b.num_rows)], dtype=object)}
    clean_t, clean_nt = apply_plan(dict(t), dict(nt), plan)
    kw: dict = {}
    t2, nt2, plan2, expect = _apply_corruption(kind, dict(t), dict(nt), kw, plan)
    out = run(apply_plan, expect, t2, nt2, plan2, **kw)
    if out is not None:
        for name, value in out[0].items():
            assert torch.equal(value, clean_t[name]), name
        assert out[1].keys() == clean_nt.keys()


# ---------------------------------------------------------------------------------------------------------------------
# compute_loss_weights, with custom weight functions
# ---------------------------------------------------------------------------------------------------------------------

CUSTOM = {  # name -> (fn, expectation)
    "fuzz-ok": (lambda s: s.real * 0.5, "ok"),
    "fuzz-column": (lambda s: s.real[:, None], "refuse"),
    "fuzz-scalar": (lambda s: s.real.sum(), "refuse"),
    "fuzz-numpy": (lambda s: s.real.numpy(), "refuse"),
    "fuzz-list": (lambda s: s.real.tolist(), "refuse"),
    "fuzz-nan": (lambda s: s.real * NAN, "refuse"),
    "fuzz-negative": (lambda s: -s.real - 1, "refuse"),
    "fuzz-int": (lambda s: s.real.long(), "refuse"),
    "fuzz-short": (lambda s: s.real[1:], "refuse"),
}


@pytest.fixture(scope="module", autouse=True)
def _custom_modes():
    for name, (fn, _) in CUSTOM.items():
        register_loss_weight(name, override=True)(fn)
    yield
    for name in CUSTOM:
        LOSS_WEIGHT_FNS.pop(name, None)


WEIGHT_KINDS = ["none", "mode_typo", "mode_none", "mask_nan", "mask_two", "mask_complex", "mask_bool", "mb_neg",
                "mb_frac", "mb_float_whole", "mb_short", "mb_list", "traj_below", "traj_real_neg", "traj_short",
                "pad_two", "pad_short", "scale_nan", "scale_zero", "scale_str", "scale_bool", "mask_1d"]


def _weight_corruption(kind: str, args: list, kw: dict, rng) -> str:
    mask, mb, traj, pad = args[1:]
    real = np.flatnonzero(~pad.numpy())
    r = int(rng.choice(real))
    if kind == "mode_typo":
        args[0] = args[0].replace("-", "_") + "s"
    elif kind == "mode_none":
        args[0] = None
    elif kind in ("mask_nan", "mask_two"):
        args[1] = mask.double()
        args[1][r, 0] = NAN if kind == "mask_nan" else 2
    elif kind == "mask_complex":
        args[1] = mask.to(torch.complex64)
    elif kind == "mask_bool":
        args[1] = mask.bool()
        return "ok"
    elif kind == "mask_1d":
        args[1] = mask.sum(-1)
    elif kind == "mb_neg":
        args[2] = mb.clone()
        args[2][r] = -1
    elif kind in ("mb_frac", "mb_float_whole"):
        args[2] = mb.double() + (0.5 if kind == "mb_frac" else 0.0)
        return "refuse" if kind == "mb_frac" else "ok"
    elif kind in ("mb_short", "traj_short", "pad_short"):
        i = {"mb_short": 2, "traj_short": 3, "pad_short": 4}[kind]
        args[i] = args[i][:-1]
    elif kind == "mb_list":
        args[2] = mb.tolist()
    elif kind == "traj_below":
        args[3] = traj.clone()
        args[3][r] = -2
    elif kind == "traj_real_neg":
        args[3] = traj.clone()
        args[3][r] = -1
    elif kind == "pad_two":
        args[4] = pad.long()
        args[4][r] = 2
    elif kind.startswith("scale_"):
        kw["loss_scale_factor"] = {"scale_nan": NAN, "scale_zero": 0, "scale_str": "8", "scale_bool": True}[kind]
    else:
        return "ok"
    return "refuse"


@FUZZ
@given(seed=st.integers(0, 10_000), dp=st.integers(1, 3),
       mode=st.sampled_from(["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm", "traj-mean"]
                            + list(CUSTOM)),
       kind=st.sampled_from(WEIGHT_KINDS))
def test_fuzz_compute_loss_weights(seed, dp, mode, kind):
    b, _ = _batch(seed)
    layout = b.layout()
    plan = plan_mini_batches(layout, min(2, layout.num_groups), dp)
    loss = torch.where(plan.is_padding, 0, layout.num_loss_tokens[plan.order.clamp(min=0)])
    mask = (torch.arange(max(int(loss.max()), 1))[None, :] < loss[:, None]).long()
    args = [mode, mask, plan.mini_batch_id, plan.traj_index, plan.is_padding]
    kw: dict = {}
    expect = _weight_corruption(kind, args, kw, np.random.default_rng(seed))
    if expect == "ok" and mode in CUSTOM:
        expect = CUSTOM[mode][1]
    elif mode in CUSTOM and CUSTOM[mode][1] == "refuse":
        expect = "refuse"  # refused for its input or for its output
    w = run(compute_loss_weights, expect, *args, **kw)
    if w is not None:
        clean = compute_loss_weights(mode, mask, plan.mini_batch_id, plan.traj_index, plan.is_padding)
        assert w.shape == (mask.shape[0],) and torch.allclose(w, clean)
        assert bool((w[plan.is_padding] == 0).all()) and bool(torch.isfinite(w).all())


# ---------------------------------------------------------------------------------------------------------------------
# pack_micro_batches
# ---------------------------------------------------------------------------------------------------------------------

PACK_BAD = {
    "cost": ["token", None, "area"], "cap": [NAN, 0, -1, "100", 1.5, INF], "num_blocks": [-1, NAN, "4"],
    "pass_cost": [-1, NAN, "x", INF], "partitioner": [5],
}


@FUZZ
@given(seed=st.integers(0, 10_000), m=st.integers(1, 3), dp=st.integers(1, 3),
       cost=st.sampled_from(["tokens", "padded", "padded_area"]), data=st.data())
def test_fuzz_pack_micro_batches(seed, m, dp, cost, data):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 20))
    tokens = rng.integers(1, 40, size=n)
    kw = dict(tokens=tokens, block=rng.integers(0, m * dp, size=n), block_sync=np.arange(m * dp) // dp,
              num_blocks=m * dp, cap=int(tokens.max()) * (4 if cost == "padded_area" else 1) + int(rng.integers(0, 30)),
              cost=cost, pass_cost=None)
    kind = data.draw(st.sampled_from(list(PACK_BAD) + ["none", "cap_below", "tok_neg", "tok_nan", "tok_frac",
                                                        "tok_2d", "tok_str", "block_high", "block_neg", "block_short",
                                                        "sync_short", "sync_neg", "tok_float_whole"]))
    expect = "refuse"
    r = int(rng.integers(0, n))
    if kind in PACK_BAD:
        kw[kind] = data.draw(st.sampled_from(PACK_BAD[kind]))
    elif kind == "cap_below":
        kw["cap"] = int(tokens.max()) - 1
    elif kind.startswith("tok_"):
        tok = tokens.astype(float if kind != "tok_str" else str).astype(object)
        if kind == "tok_2d":
            kw["tokens"] = np.stack([tokens, tokens], 1)
        elif kind == "tok_float_whole":
            kw["tokens"], expect = tokens.astype(float), "ok"
        else:
            tok[r] = {"tok_neg": -3, "tok_nan": NAN, "tok_frac": 2.5, "tok_str": "x"}[kind]
            kw["tokens"] = tok.astype(float) if kind != "tok_str" else tok.astype(str)
    elif kind.startswith("block_"):
        blk = kw["block"].copy()
        if kind == "block_short":
            blk = blk[:-1]
        else:
            blk[r] = m * dp if kind == "block_high" else -1
        kw["block"] = blk
    elif kind.startswith("sync_"):
        kw["block_sync"] = kw["block_sync"][:-1] if kind == "sync_short" else kw["block_sync"] - 1
    else:
        expect = "ok"
    cap, block = kw["cap"], kw["block"]
    packing = run(pack_micro_batches, expect, kw.pop("tokens"), kw.pop("block"), kw.pop("block_sync"),
                  kw.pop("num_blocks"), kw.pop("cap"), **kw)
    if packing is not None:  # every block's micro-batches dense and within the cap under the cost
        for b in np.unique(block):
            ids = packing.micro_index[block == b]
            assert sorted(set(ids.tolist())) == list(range(len(set(ids.tolist()))))
            for k in set(ids.tolist()):
                part = tokens[block == b][ids == k]
                assert (part.size * part.max() if cost == "padded_area" else part.sum()) <= cap


# ---------------------------------------------------------------------------------------------------------------------
# resolve_pad_token_id
# ---------------------------------------------------------------------------------------------------------------------

TOKEN_IDS = st.one_of(st.none(), st.integers(-5, 50_000), st.floats(allow_nan=True), st.booleans(), st.text(max_size=3),
                      st.lists(st.one_of(st.none(), st.integers(-2, 9)), max_size=3),
                      st.builds(np.int64, st.integers(0, 9)),
                      st.builds(torch.tensor, st.integers(0, 9)))


@settings(max_examples=150, deadline=None)
@given(pad=TOKEN_IDS, eos=TOKEN_IDS)
def test_fuzz_resolve_pad_token_id(pad, eos):
    def is_id(x):
        return isinstance(x, (int, np.integer)) and not isinstance(x, bool) and x >= 0

    first = eos[0] if isinstance(eos, list) and eos else eos
    ok = is_id(pad) if pad is not None else is_id(first)
    got = run(resolve_pad_token_id, "ok" if ok else "refuse", pad, eos)
    if got is not None:
        assert got == int(pad if pad is not None else first) and type(got) is int


# ---------------------------------------------------------------------------------------------------------------------
# Regressions: one per bug class the fuzzing found
# ---------------------------------------------------------------------------------------------------------------------


def _refuses(fn, *args, **kwargs) -> TrajInputError:
    with pytest.raises(TrajInputError) as exc:
        fn(*args, **kwargs)
    refused(exc.value)
    return exc.value


def test_a_padding_row_with_loss_tokens_is_refused_not_dropped():
    uid = np.array(["a", "a", "b"], dtype=object)
    err = _refuses(build_layout_from_counts, [5, 6, 4], [1, 2, 1], uid, is_padding=[False, True, False])
    assert err.field == "is_padding[1]" and "num_loss_tokens[1]=2" in str(err)
    assert build_layout_from_counts([5, 6, 4], [1, 0, 1], uid, is_padding=[False, True, False]).num_real_rows == 2


def test_padding_and_last_step_flags_are_bools_or_zero_one():
    uid = np.array(["a", "b"], dtype=object)
    assert _refuses(build_layout_from_counts, [5, 6], [1, 0], uid, is_padding=[0, 2]).field == "is_padding"
    assert _refuses(build_layout_from_counts, [5, 6], [1, 0], uid, is_padding=np.array(["no", "yes"])).field \
        == "is_padding"
    assert build_layout_from_counts([5, 6], [1, 0], uid, is_padding=np.array([0.0, 1.0])).num_real_rows == 1


def test_string_and_complex_masks_are_refused():
    attn = torch.ones(2, 3, dtype=torch.long)
    uid = np.array(["a", "b"], dtype=object)
    assert _refuses(build_layout, attn.to(torch.complex64), attn[:, :1], uid).field == "attention_mask"
    assert _refuses(build_layout, attn.numpy().astype(str), attn[:, :1], uid).field == "attention_mask"
    assert _refuses(build_layout_from_counts, [3, 3], [1, 1], uid, np.array(["t0", "t1"], dtype=object),
                    np.array(["0", "0"], dtype=object)).field == "step_index"


@pytest.mark.parametrize("cap", [NAN, INF, 2.5, "4096", True])
def test_a_nan_or_non_int_token_cap_is_a_plan_error(cap):
    layout = random_batch(0, 3, 1, 1).layout()
    err = _refuses(plan_mini_batches, layout, 1, 1, micro_batch_max_tokens=cap)
    assert isinstance(err, PlanError) and err.field == "micro_batch_max_tokens"
    with pytest.raises(PlanError):
        PlanSpec(1, 1, micro_batch_max_tokens=cap)
    assert PlanSpec(np.int64(2), 1.0, micro_batch_max_tokens=4096.0).micro_batch_max_tokens == 4096


def test_a_misspelled_plan_option_is_named_with_a_suggestion():
    layout = random_batch(0, 3, 1, 1).layout()
    err = _refuses(plan_mini_batches, layout, 1, 1, micro_batch_max_token=100)
    assert isinstance(err, PlanError) and err.field == "micro_batch_max_token"
    assert "did you mean 'micro_batch_max_tokens'" in str(err)
    err = _refuses(plan_mini_batches, layout, 1, 1, group_by="groups")
    assert err.field == "group_by" and "did you mean 'group'" in str(err)
    assert _refuses(plan_mini_batches, layout, "1", 1).field == "num_mini_batches"
    assert _refuses(plan_mini_batches, layout, 9, 1).field == "num_mini_batches"  # fewer groups than mini-batches


def test_packing_inputs_are_checked():
    tokens, block, sync = np.array([3, 4]), np.array([0, 1]), np.array([0, 0])
    assert _refuses(pack_micro_batches, tokens, block, sync, 2, 8, cost="token").field == "cost"
    assert _refuses(pack_micro_batches, tokens, np.array([0, 2]), sync, 2, 8).field.startswith("block")
    assert _refuses(pack_micro_batches, tokens, block, sync, 2, NAN).field == "micro_batch_max_tokens"
    err = _refuses(pack_micro_batches, tokens, block, sync, 2, 3)
    assert isinstance(err, PackingError) and err.field == "micro_batch_max_tokens"
    assert _refuses(pack_micro_batches, np.array([3.0, NAN]), block, sync, 2, 8).field.startswith("tokens")


def test_prompts_wider_than_the_attention_mask_are_refused():
    b, t = _batch(1)
    plan = plan_mini_batches(b.layout(), 1, 4)
    assert bool(plan.is_padding.any())
    L = t["attention_mask"].shape[1]
    wide = {**t, "prompts": torch.zeros(b.num_rows, L, dtype=torch.long)}
    err = _refuses(apply_plan, wide, {"uid": b.uid}, plan)
    assert err.field == "tensors['prompts'].shape[1]" and f"{L}" in str(err)
    no_prompts = {k: v for k, v in t.items() if k != "prompts"}
    assert _refuses(apply_plan, no_prompts, {"uid": b.uid}, plan, prompt_length=L + 3).field == "prompt_length"
    assert _refuses(apply_plan, no_prompts, {"uid": b.uid}, plan, prompt_length=NAN).field == "prompt_length"
    assert _refuses(apply_plan, {**t, "attention_mask": t["attention_mask"][:, None]}, {"uid": b.uid}, plan).field \
        == "tensors['attention_mask']"


@pytest.mark.parametrize("name", ["fuzz-column", "fuzz-scalar", "fuzz-numpy", "fuzz-nan", "fuzz-negative", "fuzz-int"])
def test_a_custom_loss_weight_of_the_wrong_shape_or_value_is_refused(name):
    mask, z = torch.ones(3, 2), torch.zeros(3, dtype=torch.long)
    err = _refuses(compute_loss_weights, name, mask, z, torch.arange(3), z.bool())
    assert err.field == "loss_agg_mode" and name in str(err)
    assert compute_loss_weights("fuzz-ok", mask, z, torch.arange(3), z.bool()).tolist() == [0.5, 0.5, 0.5]


def test_loss_weight_ids_are_integers_in_range():
    mask, z = torch.ones(3, 2), torch.zeros(3, dtype=torch.long)
    assert _refuses(compute_loss_weights, "token-mean", mask, z + 0.5, torch.arange(3), z.bool()).field \
        == "mini_batch_id[0]"
    assert _refuses(compute_loss_weights, "traj-mean", mask, z, torch.tensor([0, -1, 1]), z.bool()).field \
        == "traj_index[1]"
    assert _refuses(compute_loss_weights, "traj-mean", mask, z, torch.tensor([0, -2, 1]),
                    torch.tensor([False, True, False])).field == "traj_index[1]"
    assert _refuses(compute_loss_weights, "token-mean", mask, z, torch.arange(3), z + 2).field == "is_padding"


# Modules whose checks and tensor work must not grow with the batch: a Python loop over rows in any of them shows up as
# more executed lines on a larger batch. (balancing.py and packing.py pack rows into ranks and micro-batches one unit
# at a time by design; scripts/bench_driver.py times them at 10^5-10^6 rows.)
_LOOP_FREE = ("errors.py", "layout.py", "loss_weights.py", "planning.py")


def _lines_run(groups: int) -> tuple[int, dict[str, int]]:
    """Build layout, plan and loss weights for a clean batch of ``groups`` GRPO groups; count the Python lines each
    module of :data:`_LOOP_FREE` executed (``sys.settrace``)."""
    import collections
    import sys

    b = random_batch(1, groups, 4, 6)
    t = verl_tensors(b)
    lines: collections.Counter = collections.Counter()

    def tracer(frame, event, arg):
        name = frame.f_code.co_filename.replace("\\", "/")
        if "/verl_traj/core/" not in name:
            return None
        lines[name.rsplit("/", 1)[1]] += event == "line"
        return tracer

    sys.settrace(tracer)
    try:
        layout = build_layout(t["attention_mask"], t["response_mask"], b.uid, b.traj_id, b.step_index, b.is_last_step,
                              b.is_padding)
        plan = plan_mini_batches(layout, 4, 4, micro_batch_max_tokens=int(layout.num_tokens.max()) * 4)
        loss = layout.num_loss_tokens[plan.order.clamp(min=0)]
        mask = (torch.arange(int(loss.max()))[None, :] < loss[:, None]).long()
        compute_loss_weights("traj-mean", mask, plan.mini_batch_id, plan.traj_index, plan.is_padding)
    finally:
        sys.settrace(None)
    return b.num_rows, {name: lines[name] for name in _LOOP_FREE}


def test_the_clean_checks_stay_one_pass_whatever_the_batch_size():
    """The input checks and the layout / plan / loss-weight tensor work run the same Python lines on 384 rows as on
    3,600: every per-row fact is a tensor op (a per-row check loop would add lines in proportion to the rows)."""
    small_rows, small = _lines_run(40)
    large_rows, large = _lines_run(400)
    assert large_rows > 3000 and large_rows > 8 * small_rows
    assert all(small.values()) and large == small


def test_balancing_and_the_estimator_registry_refuse_with_a_field():
    from verl_traj.core import balance_equal_size, calculate_workload
    from verl_traj.core.plan.estimators import EstimatorTraits, register_estimator_traits

    assert _refuses(calculate_workload, np.array([3, 4]), "flops").field == "workload"
    assert _refuses(balance_equal_size, np.array([1, 2, 3]), np.zeros(3, dtype=np.int64), 1, 2).field == "block"
    err = _refuses(register_estimator_traits, "grpo", EstimatorTraits(temporal=True))
    assert err.field == "adv_estimator" and "override=True" in str(err)
