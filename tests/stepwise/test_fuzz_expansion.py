"""Fuzzing the step-row expansion (issue 28, item 8): ``expand_step_rows`` (and its DataProto entry),
``trajectory_step_rows``, ``decode_step_records`` and ``merge_trajectory_steps`` get a valid batch of token-in /
token-out trajectories (the shared factory's), then one random corruption of a record, a tensor or an option. Only the
clean result (harmless corruptions) or a :class:`~verl_traj.core.TrajInputError` whose ``field`` is set and named in
its message are accepted. Then one regression test per class of bug the fuzzing found."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.fuzz import INF, NAN, refused, run
from verl_traj.core import TrajInputError
from verl_traj.stepwise.expand import (StepExpansionError, decode_step_records, encode_step_records, expand_step_rows,
                                       trajectory_step_rows)
from verl_traj.stepwise.prefix_merge import PrefixMergeError, merge_trajectory_steps
from verl_traj.testing import step_record_batch, token_trajectory


FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _trajectories(seed: int):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 4))
    return [token_trajectory(rng, int(rng.integers(1, 4)), break_at=1 if rng.random() < 0.3 else None)
            for _ in range(n)]


def _batch(seed: int, delta: bool):
    trajs = _trajectories(seed)
    P = max(t[1].numel() for t in trajs) + 2
    R = max(t[2].numel() for t in trajs) + 2
    tensors, non = step_record_batch(trajs, [f"g{i // 2}" for i in range(len(trajs))], [1.0] * len(trajs), P=P, R=R)
    if delta:
        non["traj_steps"][:] = [encode_step_records(r) for r in non["traj_steps"]]
    return tensors, non


def _steps(records):
    return records["steps"] if isinstance(records, dict) else records


RECORD_KINDS = ["none", "resp_str", "resp_neg", "resp_frac", "resp_none", "resp_ragged", "mask_len", "mask_two",
                "lp_nan", "lp_len", "lp_missing", "lp_neg_inf", "reward_nan", "reward_str", "prefix_neg",
                "prefix_big", "prefix_frac", "prefix_str", "record_str", "records_int", "records_dict",
                "resp_float_whole", "resp_tensor", "reward_ok"]


def _corrupt_record(kind: str, records, delta: bool, rng) -> tuple:
    """Apply ``kind`` to one record (in place on a copy); returns (records, expectation)."""
    steps = _steps(records)
    k = int(rng.integers(0, len(steps)))
    rec = steps[k]
    n = len(rec["response_ids"])
    if kind.startswith("prefix_") and not delta:
        return records, "ok"
    if kind == "resp_str":
        rec["response_ids"] = "abc"
    elif kind == "resp_neg":
        rec["response_ids"] = [-1] + list(rec["response_ids"])[1:]
    elif kind == "resp_frac":
        rec["response_ids"] = [x + 0.5 for x in list(rec["response_ids"])]
    elif kind == "resp_none":
        rec["response_ids"] = None
    elif kind == "resp_ragged":
        rec["response_ids"] = [[1, 2], [3]]
    elif kind in ("resp_float_whole", "resp_tensor"):
        ids = np.asarray(rec["response_ids"])
        rec["response_ids"] = ids.astype(float) if kind == "resp_float_whole" else torch.as_tensor(ids)
        return records, "ok"
    elif kind == "mask_len":
        rec["response_mask"] = [1] * (n + 1)
    elif kind == "mask_two":
        rec["response_mask"] = [2] * n
        if n == 0:
            return records, "ok"
    elif kind in ("lp_nan", "lp_len", "lp_missing", "lp_neg_inf"):
        if kind == "lp_missing":
            rec.pop("response_logprobs", None)
        elif kind == "lp_len":
            rec["response_logprobs"] = [-0.1] * (n + 1)
        else:
            rec["response_logprobs"] = [NAN if kind == "lp_nan" else -INF] * n
            if n == 0:
                return records, "ok"
            return records, "refuse" if kind == "lp_nan" else "any"
    elif kind in ("reward_nan", "reward_str", "reward_ok"):
        rec["reward"] = {"reward_nan": NAN, "reward_str": "1", "reward_ok": 0.5}[kind]
        return records, "any" if kind == "reward_ok" else "refuse"  # ok unless the call has no response token
    elif kind.startswith("prefix_"):
        rec["prompt_prefix_len"] = {"prefix_neg": -2, "prefix_big": 10_000, "prefix_frac": 1.5, "prefix_str": "2"}[kind]
    elif kind == "record_str":
        steps[k] = "call"
    elif kind == "records_int":
        return 5, "refuse"
    elif kind == "records_dict":
        return {"calls": steps}, "refuse"
    else:
        return records, "ok"
    return records, "refuse"


@FUZZ
@given(seed=st.integers(0, 10_000), delta=st.booleans(), merge=st.booleans(), kind=st.sampled_from(RECORD_KINDS))
def test_fuzz_expand_step_rows_records(seed, delta, merge, kind):
    tensors, non = _batch(seed, delta)
    clean = expand_step_rows(tensors, non, merge_prefix=merge)
    rng = np.random.default_rng(seed)
    b = int(rng.integers(0, len(non["traj_steps"])))
    non2 = dict(non, traj_steps=copy.deepcopy(non["traj_steps"]))
    non2["traj_steps"][b], expect = _corrupt_record(kind, non2["traj_steps"][b], delta, rng)
    out = run(expand_step_rows, expect, tensors, non2, merge_prefix=merge)
    if out is not None and expect == "ok":
        for name, value in clean.tensors.items():
            assert torch.equal(out.tensors[name], value), name


TENSOR_KINDS = ["none", "attn_wide", "attn_short", "resp_mask_wide", "lp_wide", "prompts_1d", "attn_two",
                "steps_short", "traj_short", "pad_neg", "pad_float", "width_zero", "width_small", "multiple_zero",
                "drop_str", "column_short", "missing_responses", "routed_experts", "tensors_list", "rm_rows",
                "mask_bool", "drop_ok"]


def _corrupt_batch(kind: str, t: dict, nt: dict, kw: dict) -> str:
    B, R = t["responses"].shape
    if kind == "attn_wide":
        t["attention_mask"] = torch.cat([t["attention_mask"], torch.zeros(B, 1, dtype=torch.long)], 1)
    elif kind == "attn_short":
        t["attention_mask"] = t["attention_mask"][:, 1:]
    elif kind == "resp_mask_wide":
        t["response_mask"] = torch.cat([t["response_mask"], torch.zeros(B, 1, dtype=torch.long)], 1)
    elif kind == "lp_wide":
        t["rollout_log_probs"] = t["rollout_log_probs"][:, :-1]
    elif kind == "prompts_1d":
        t["prompts"] = t["prompts"][:, 0]
    elif kind == "attn_two":
        t["attention_mask"] = t["attention_mask"] * 2
    elif kind in ("steps_short", "traj_short", "column_short"):
        key = {"steps_short": "traj_steps", "traj_short": "traj_id", "column_short": "data_source"}[kind]
        nt[key] = nt[key][:-1] if B > 1 else nt[key][:0]
    elif kind in ("pad_neg", "pad_float"):
        kw["pad_token_id"] = -1 if kind == "pad_neg" else 0.5
    elif kind in ("width_zero", "width_small"):
        kw["response_width"] = 0 if kind == "width_zero" else 1
        return "refuse" if kind == "width_zero" else "any"
    elif kind == "multiple_zero":
        kw["pad_to_multiple_of"] = 0
    elif kind in ("drop_str", "drop_ok"):
        kw["drop_keys"] = "routed_experts" if kind == "drop_str" else ["routed_experts"]
        return "refuse" if kind == "drop_str" else "ok"
    elif kind == "missing_responses":
        t.pop("responses")
    elif kind == "routed_experts":
        t["routed_experts"] = torch.zeros(B, t["attention_mask"].shape[1], 2, dtype=torch.int32)
    elif kind == "tensors_list":
        kw["tensors"] = list(t.values())
    elif kind == "rm_rows":
        t["rm_scores"] = t["rm_scores"][:-1]
    elif kind == "mask_bool":
        t["response_mask"] = t["response_mask"].bool()
        return "any"  # the mask dtype is kept: compared by value below
    else:
        return "ok"
    return "refuse"


@FUZZ
@given(seed=st.integers(0, 10_000), delta=st.booleans(), merge=st.booleans(), records=st.booleans(),
       kind=st.sampled_from(TENSOR_KINDS))
def test_fuzz_expand_step_rows_batch(seed, delta, merge, records, kind):
    tensors, non = _batch(seed, delta)
    if not records:  # rows cut from the concatenated output (the fallback path)
        non["traj_steps"][:] = [None] * len(non["traj_steps"])
    clean = expand_step_rows(tensors, non, merge_prefix=merge)
    t, nt, kw = dict(tensors), dict(non), {}
    expect = _corrupt_batch(kind, t, nt, kw)
    out = run(expand_step_rows, expect, kw.pop("tensors", t), nt, merge_prefix=merge, **kw)
    if out is not None and expect in ("ok", "any"):
        for name, value in clean.tensors.items():
            if name in out.tensors:
                assert torch.equal(out.tensors[name].to(value.dtype), value), name


@FUZZ
@given(seed=st.integers(0, 10_000), delta=st.booleans(), kind=st.sampled_from(RECORD_KINDS))
def test_fuzz_decode_step_records(seed, delta, kind):
    records = _batch(seed, delta)[1]["traj_steps"][0]
    clean = decode_step_records(copy.deepcopy(records))
    bad, expect = _corrupt_record(kind, copy.deepcopy(records), delta, np.random.default_rng(seed))
    if kind.startswith(("mask_", "lp_", "reward_")):
        expect = "ok"  # decode reads ids and prefix lengths only; the rest is checked where rows are built
    out = run(decode_step_records, expect, bad)
    if out is not None and expect == "ok" and not kind.startswith(("mask_", "lp_", "reward_")):
        assert [torch.equal(a["prompt_ids"], b["prompt_ids"]) for a, b in zip(out, clean)] == [True] * len(clean)


TRAJ_KINDS = ["none", "mask_len", "mask_two", "lp_len", "lp_nan", "prompt_str", "resp_neg", "records_bad",
              "mask_none", "lp_none"]


@FUZZ
@given(seed=st.integers(0, 10_000), merge=st.booleans(), with_records=st.booleans(), kind=st.sampled_from(TRAJ_KINDS))
def test_fuzz_trajectory_step_rows(seed, merge, with_records, kind):
    records, prompt, response, mask, lp = token_trajectory(np.random.default_rng(seed), int(seed % 3) + 1)
    args = [prompt, response, mask, lp, records if with_records else None]
    clean = trajectory_step_rows(*args, merge_prefix=merge)
    expect = "refuse"
    if kind == "mask_len":
        args[2] = torch.cat([mask, mask[:1]])
    elif kind == "mask_two":
        args[2] = mask * 2
    elif kind == "lp_len":
        args[3] = lp[:-1]
    elif kind == "lp_nan":
        args[3] = torch.full_like(lp, NAN)
    elif kind == "prompt_str":
        args[0] = "hello"
    elif kind == "resp_neg":
        args[1] = -response
    elif kind == "records_bad":
        args[4] = [{"prompt_ids": [1]}]
    elif kind in ("mask_none", "lp_none"):
        args[2 if kind == "mask_none" else 3] = None
        expect = "any"
    else:
        expect = "ok"
    if with_records and kind in ("mask_len", "mask_two", "lp_nan", "resp_neg", "prompt_str"):
        expect = "any"  # records carry their own tokens: the concatenated row is still checked
    rows = run(trajectory_step_rows, expect, *args, merge_prefix=merge)
    if rows is not None and expect == "ok":
        assert len(rows[0]) == len(clean[0])
        assert all(torch.equal(a.response_ids, b.response_ids) for a, b in zip(rows[0], clean[0]))


MERGE_KINDS = ["none", "fewer_responses", "mask_len", "mask_two", "prompt_2d", "prompt_float", "prompt_list",
               "per_token_len", "per_token_not_mapping", "prompts_tensor", "per_token_short_list"]


@FUZZ
@given(seed=st.integers(0, 10_000), enable=st.booleans(), kind=st.sampled_from(MERGE_KINDS))
def test_fuzz_merge_trajectory_steps(seed, enable, kind):
    records = decode_step_records(token_trajectory(np.random.default_rng(seed), int(seed % 4) + 1)[0])
    prompts = [r["prompt_ids"] for r in records]
    responses = [r["response_ids"] for r in records]
    masks = [torch.ones(r.numel(), dtype=torch.long) for r in responses]
    per_token = {"lp": [torch.as_tensor(r["response_logprobs"]) for r in records]}
    clean = merge_trajectory_steps(prompts, responses, masks, per_token, enable=enable)
    i = seed % len(prompts)
    args, kw, expect = [list(prompts), list(responses), list(masks)], {"per_token": dict(per_token)}, "refuse"
    if kind == "fewer_responses":
        args[1] = args[1][:-1]
    elif kind == "mask_len":
        args[2][i] = torch.ones(responses[i].numel() + 1, dtype=torch.long)
    elif kind == "mask_two":
        args[2][i] = masks[i] * 2
    elif kind == "prompt_2d":
        args[0][i] = prompts[i][None]
    elif kind == "prompt_float":
        args[0][i] = prompts[i].float()
    elif kind == "prompt_list":
        args[0][i] = prompts[i].tolist()
    elif kind == "per_token_len":
        lp = list(per_token["lp"])
        lp[i] = torch.zeros(responses[i].numel() + 1)
        kw["per_token"] = {"lp": lp}
    elif kind == "per_token_not_mapping":
        kw["per_token"] = per_token["lp"]
    elif kind == "prompts_tensor":
        args[0] = prompts[0]
    elif kind == "per_token_short_list":
        kw["per_token"] = {"lp": per_token["lp"][:-1]}
    else:
        expect = "ok"
    out = run(merge_trajectory_steps, expect, *args, enable=enable, **kw)
    if out is not None:
        assert [torch.equal(a.response_ids, b.response_ids) for a, b in zip(out[0], clean[0])] == [True] * len(clean[0])


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 50), merge=st.booleans(), kind=st.sampled_from(RECORD_KINDS))
def test_fuzz_expand_dataproto_step_rows(seed, merge, kind):
    """The trainer's entry: the DataProto is replaced in place by its step rows, or left as it was when refused."""
    from tests.stepwise.verl_batches import stepwise_dataproto
    from verl_traj.integration.rows.stepwise_rows import expand_dataproto_step_rows

    data = stepwise_dataproto(seed)[0]
    clean = copy.deepcopy(data)
    expand_dataproto_step_rows(clean, merge_prefix=merge)
    rng = np.random.default_rng(seed)
    b = int(rng.integers(0, len(data)))
    data.non_tensor_batch["traj_steps"][b], expect = _corrupt_record(kind, data.non_tensor_batch["traj_steps"][b],
                                                                      False, rng)
    rows = len(data)
    metrics = run(expand_dataproto_step_rows, expect, data, merge_prefix=merge)
    if metrics is None:
        assert len(data) == rows  # refused before anything was replaced
    elif expect == "ok":
        assert torch.equal(data.batch["input_ids"], clean.batch["input_ids"])


# ---------------------------------------------------------------------------------------------------------------------
# Regressions
# ---------------------------------------------------------------------------------------------------------------------


def _refuses(fn, *args, **kwargs) -> TrajInputError:
    with pytest.raises(TrajInputError) as exc:
        fn(*args, **kwargs)
    refused(exc.value)
    return exc.value


def _delta_records():
    calls = [{"prompt_ids": [1, 2], "response_ids": [3, 4]}, {"prompt_ids": [1, 2, 3, 4, 5], "response_ids": [6]}]
    return encode_step_records(calls)


@pytest.mark.parametrize("bad", [-1, -3, 1.5, "2", None])
def test_a_step_record_with_a_negative_or_non_int_prefix_length_is_refused(bad):
    records = _delta_records()
    records["steps"][1]["prompt_prefix_len"] = bad
    err = _refuses(decode_step_records, records)
    assert isinstance(err, StepExpansionError) and err.field == "prompt_prefix_len"
    assert str(err).startswith("step record 1: prompt_prefix_len=")
    tensors = {"prompts": torch.tensor([[0, 1, 2]]), "responses": torch.tensor([[3, 4, 5, 6]]),
               "attention_mask": torch.ones(1, 7, dtype=torch.long), "response_mask": torch.tensor([[1, 1, 0, 1]])}
    non = {"uid": np.array(["g"], dtype=object), "traj_steps": np.empty(1, dtype=object)}
    non["traj_steps"][0] = records
    for merge in (False, True):  # the decoding path and the delta-encoded merge path
        err = _refuses(expand_step_rows, tensors, non, merge_prefix=merge)
        assert err.field == "prompt_prefix_len" and "row 0" in str(err) and "step record 1" in str(err)


@pytest.mark.parametrize("ids, needle", [("abc", "not a list of numbers"), ([1, -2], "negative token id"),
                                         ([1.5], "non-whole"), ([[1, 2], [3]], "not a list of numbers")])
def test_bad_token_ids_in_a_record_are_refused(ids, needle):
    err = _refuses(decode_step_records, [{"prompt_ids": [1], "response_ids": ids}])
    assert err.field == "response_ids" and needle in str(err) and str(err).startswith("step record 0: ")
    err = _refuses(encode_step_records, [{"prompt_ids": ids, "response_ids": [1]}])
    assert err.field == "prompt_ids" and str(err).startswith("LLM call 0: ")


def test_record_masks_and_log_probs_are_checked():
    rec = {"prompt_ids": [1], "response_ids": [2, 3], "response_mask": [1, 2]}
    err = _refuses(trajectory_step_rows, [1], [2, 3], [1, 1], None, [rec])
    assert err.field == "response_mask" and str(err).startswith("row 0 step 0: ")
    rec = {"prompt_ids": [1], "response_ids": [2, 3], "response_logprobs": [-0.1, NAN]}
    assert _refuses(trajectory_step_rows, [1], [2, 3], [1, 1], [-0.1, -0.2], [rec]).field == "response_logprobs"


def test_the_batch_is_in_verls_layout_before_it_is_cut():
    tensors, non = _batch(3, False)
    B = tensors["responses"].shape[0]
    wide = dict(tensors, attention_mask=torch.ones(B, tensors["attention_mask"].shape[1] + 1, dtype=torch.long))
    assert _refuses(expand_step_rows, wide, non).field == "attention_mask"
    assert _refuses(expand_step_rows, tensors, dict(non, traj_steps=non["traj_steps"][:0])).field == "steps"
    assert _refuses(expand_step_rows, tensors, non, pad_token_id=-1).field == "pad_token_id"
    assert _refuses(expand_step_rows, tensors, non, drop_keys="routed_experts").field == "drop_keys"
    assert _refuses(expand_step_rows, tensors, dict(non, traj_steps=np.array([{"calls": []}] * B))).field == "steps"


def test_merge_inputs_are_one_dimensional_int_tensors():
    p, r = [torch.tensor([1, 2])], [torch.tensor([3])]
    assert _refuses(merge_trajectory_steps, [[1, 2]], r).field == "prompts[0]"
    err = _refuses(merge_trajectory_steps, [p[0].float()], r)
    assert isinstance(err, PrefixMergeError) and err.field == "prompts[0]"
    assert _refuses(merge_trajectory_steps, p, r, [torch.tensor([2])]).field == "response_masks[0]"
    assert _refuses(merge_trajectory_steps, p, r + r).field == "responses"
