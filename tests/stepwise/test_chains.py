"""The vectorised expansion of whole chains (verl_traj.stepwise.chains) equals the per-trajectory path, row for row,
and leaves every record it would read differently to that path (whose errors stay the errors)."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import verl_traj.stepwise.expand as expand
from verl_traj.stepwise.chains import chain_rows
from verl_traj.stepwise.expand import StepExpansionError, encode_step_records, expand_step_rows
from verl_traj.stepwise.prefix_merge import MergeStats
from verl_traj.testing import step_record_batch, token_trajectory


def _per_trajectory_only(records, rows, **_):
    return None, MergeStats(), np.asarray(rows, dtype=np.int64)


def _records(rng, trajs, extras: bool):
    """Delta-encoded records of ``trajs``; ``extras``: some calls get a loss mask, a turn reward or an own anchor,
    some rows keep full prompts or lists, one row may carry no records."""
    out = np.empty(len(trajs), dtype=object)
    for b, t in enumerate(trajs):
        calls = [dict(c) for c in t[0]]
        for c in calls if extras else ():
            n = len(c["response_ids"])
            if rng.random() < 0.3:
                c["response_mask"] = rng.integers(0, 2, n).astype(np.int8)
            if rng.random() < 0.3:
                c["reward"] = float(rng.normal())
            if rng.random() < 0.2:
                c["anchor"] = int(rng.integers(1, 1 << 62))
        enc = encode_step_records(calls)
        kind = rng.integers(0, 6) if extras else 0
        if kind == 1:  # full prompts: the per-trajectory path
            enc = [dict(c, prompt_ids=np.asarray(r["prompt_ids"])) for c, r in zip(enc["steps"], calls)]
        elif kind == 2:  # lists instead of arrays
            enc = {"steps": [dict(c, response_ids=c["response_ids"].tolist()) for c in enc["steps"]]}
        elif kind == 3 and b:
            enc = None
        out[b] = enc
    return out


def _batch(seed: int, extras: bool):
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    trajs = []
    for _ in range(int(rng.integers(1, 6))):
        n = int(rng.integers(1, 6))
        brk = int(rng.integers(1, n)) if n > 1 and rng.random() < 0.3 else None
        trajs.append(token_trajectory(rng, n, break_at=brk, min_obs=int(rng.integers(0, 2)), obs_vocab=3))
    R = max(int(t[2].numel()) for t in trajs) + 1
    tensors, non = step_record_batch(trajs, [f"g{b % 2}" for b in range(len(trajs))], list(rng.random(len(trajs))), R=R)
    non["traj_steps"] = _records(rng, trajs, extras)
    return tensors, non


def _assert_same(a, b):
    assert a.tensors.keys() == b.tensors.keys()
    for k in a.tensors:
        assert a.tensors[k].dtype == b.tensors[k].dtype and torch.equal(a.tensors[k], b.tensors[k]), k
    assert a.non_tensors.keys() == b.non_tensors.keys()
    for k in a.non_tensors:
        assert list(a.non_tensors[k]) == list(b.non_tensors[k]), k
    assert torch.equal(a.source_row, b.source_row) and a.source_steps == b.source_steps and a.stats == b.stats


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 100_000), st.booleans(), st.booleans(), st.booleans())
def test_property_chains_equal_the_per_trajectory_path(seed, merge, anchors, extras):
    tensors, non = _batch(seed, extras)
    fast = expand_step_rows(tensors, non, merge_prefix=merge, step_anchors=anchors)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(expand, "chain_rows", _per_trajectory_only)
        slow = expand_step_rows(tensors, non, merge_prefix=merge, step_anchors=anchors)
    _assert_same(fast, slow)


def test_whole_chains_take_the_vectorised_path_and_the_rest_do_not():
    rng = np.random.default_rng(3)
    trajs = [token_trajectory(rng, 3, min_obs=1), token_trajectory(rng, 4, break_at=2, min_obs=1),
             token_trajectory(rng, 2, min_obs=1)]
    records = np.empty(3, dtype=object)
    records[:] = [encode_step_records(t[0]) for t in trajs]
    flat, stats, rest = chain_rows(records, np.arange(3), has_lp=True, merge=True, anchors=True)
    assert rest.tolist() == [1]  # the rewritten context: a partial merge, per trajectory
    assert flat.source_row.tolist() == [0, 2] and flat.last_step.tolist() == [2, 1]
    assert stats.rows_before == 5 and stats.rows_after == 2


@pytest.mark.parametrize("merge", [True, False])
@pytest.mark.parametrize("anchors", [True, False])
@pytest.mark.parametrize("has_lp", [True, False])
def test_unbroken_chains_as_the_recording_loop_sends_them_never_leave_the_vectorised_path(merge, anchors, has_lp):
    """Every setting: records as encode_step_records writes them, with masks, rewards and own anchors on some calls,
    take the vectorised path whole (the property test above would pass if every row went the slow way)."""
    rng = np.random.default_rng(5)
    trajs = [token_trajectory(rng, n, min_obs=1) for n in (1, 2, 4, 3)]
    records = np.empty(len(trajs), dtype=object)
    for b, t in enumerate(trajs):
        calls = [dict(c) for c in t[0]]
        calls[-1]["reward"], calls[0]["anchor"] = 0.5, 12345
        calls[0]["response_mask"] = np.ones(len(calls[0]["response_ids"]), dtype=np.int8)
        if not has_lp:
            for c in calls:
                c.pop("response_logprobs", None)
        records[b] = encode_step_records(calls)
    flat, _, rest = chain_rows(records, np.arange(len(trajs)), has_lp=has_lp, merge=merge, anchors=anchors)
    assert rest.tolist() == [] and flat is not None
    assert flat.source_row.unique().tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("field,bad", [
    ("response_ids", -1), ("prompt_tail_ids", -2), ("response_logprobs", np.nan), ("response_mask", 2),
    ("reward", float("nan")), ("anchor", 0), ("prompt_prefix_len", 1)])
def test_refused_records_raise_what_the_per_trajectory_path_raises(field, bad):
    rng = np.random.default_rng(0)
    trajs = [token_trajectory(rng, 2, min_obs=1), token_trajectory(rng, 3, min_obs=1)]
    tensors, non = step_record_batch(trajs, ["g", "g"], [1.0, 0.0])
    records = np.empty(2, dtype=object)
    records[:] = [encode_step_records(t[0]) for t in trajs]
    assert chain_rows(records, np.arange(2), has_lp=True, merge=True, anchors=True)[2].size == 0  # both on the path
    step = records[1]["steps"][0 if field == "prompt_prefix_len" else -1]
    if field in ("response_ids", "prompt_tail_ids", "response_logprobs"):
        step[field] = step[field].copy()
        step[field][0] = bad
    elif field == "response_mask":
        step[field] = np.full(step["response_ids"].size, bad, dtype=np.int8)
    else:
        step[field] = bad
    non["traj_steps"] = records
    with pytest.raises(StepExpansionError) as fast:
        expand_step_rows(tensors, non, merge_prefix=True, step_anchors=True)
    with pytest.MonkeyPatch.context() as mp, pytest.raises(StepExpansionError) as slow:
        mp.setattr(expand, "chain_rows", _per_trajectory_only)
        expand_step_rows(tensors, non, merge_prefix=True, step_anchors=True)
    assert str(fast.value) == str(slow.value) and fast.value.field == slow.value.field == field


def test_the_default_anchor_is_recorded_with_the_call_and_equals_what_the_driver_hashes():
    """GiGPO's default key is hashed once, where encode_step_records records the call (the tokens it saw since the
    previous one); a call that saw nothing new records none. The driver hashes only calls without a key: its step
    anchors are the same with the recorded keys and with them removed (9ce7796)."""
    from verl_traj.core.keys import STEP_ANCHORS
    from verl_traj.stepwise.anchors import observation_anchor

    calls = [{"prompt_ids": [1, 2, 3], "response_ids": [4]}, {"prompt_ids": [1, 2, 3, 4, 9], "response_ids": [5]},
             {"prompt_ids": [1, 2, 3, 4, 9, 5], "response_ids": [6]}]
    steps = encode_step_records(calls)["steps"]
    assert [s.get("anchor") for s in steps] == [observation_anchor([1, 2, 3]), observation_anchor([9]), None]

    rng = np.random.default_rng(5)
    trajs = [token_trajectory(rng, 3, min_obs=1), token_trajectory(rng, 4, min_obs=1)]
    tensors, non = step_record_batch(trajs, ["g", "g"], [1.0, 0.0])
    recorded = np.empty(2, dtype=object)
    recorded[:] = [encode_step_records(t[0]) for t in trajs]
    bare = np.empty(2, dtype=object)
    bare[:] = [{"steps": [{k: v for k, v in s.items() if k != "anchor"} for s in r["steps"]]} for r in recorded]
    assert all("anchor" in s for r in recorded for s in r["steps"])
    out = {}
    for name, records in (("recorded", recorded), ("hashed", bare)):
        out[name] = expand_step_rows(tensors, {**non, "traj_steps": records}, merge_prefix=True,
                                     step_anchors=True).tensors[STEP_ANCHORS]
    assert torch.equal(out["recorded"], out["hashed"]) and bool((out["recorded"] > 0).any())
