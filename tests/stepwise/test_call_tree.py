"""A session's calls as a tree (issue 56, ``verl_traj.stepwise.call_tree``): every fact against a brute force over
random forests (forks anywhere, several roots: sub-agents and condensed contexts), and a chain gives today's facts."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verl_traj.stepwise.call_tree import call_tree
from verl_traj.stepwise.expand_inputs import StepExpansionError

PROPS = settings(max_examples=200, deadline=None)


@st.composite
def forests(draw) -> list[int]:
    """1-30 calls, each naming an earlier call or -1 (a fresh context), leaning towards the previous call."""
    parent = []
    for c in range(draw(st.integers(1, 30))):
        kind = draw(st.sampled_from(["previous", "previous", "any", "root"])) if c else "root"
        parent.append(-1 if kind == "root" else c - 1 if kind == "previous" else draw(st.integers(0, c - 1)))
    return parent


def _children(parent):
    return {c: [k for k, p in enumerate(parent) if p == c] for c in range(len(parent))}


def _leaves(parent, c):
    kids = _children(parent)[c]
    return [c] if not kids else [leaf for k in kids for leaf in _leaves(parent, k)]


def _value(parent, rewards, gamma, c):
    kids = _children(parent)[c]
    return rewards[c] + (gamma * np.mean([_value(parent, rewards, gamma, k) for k in kids]) if kids else 0.0)


@PROPS
@given(parent=forests(), data=st.data())
def test_every_fact_equals_the_brute_force(parent, data):
    tree = call_tree(parent)
    n = len(parent)
    depth = [0 if p < 0 else None for p in parent]
    for c, p in enumerate(parent):
        depth[c] = 0 if p < 0 else depth[p] + 1
    assert tree.depth.tolist() == depth
    assert tree.leaves_below().tolist() == [len(_leaves(parent, c)) for c in range(n)]
    values = np.asarray(data.draw(st.lists(st.floats(-3, 3), min_size=n, max_size=n)))
    want = [np.mean([values[leaf] for leaf in _leaves(parent, c)]) for c in range(n)]
    np.testing.assert_allclose(tree.mean_of_leaves(values), want, rtol=1e-12, atol=1e-12)
    for gamma in (1.0, 0.9, 0.5):
        np.testing.assert_allclose(tree.returns(values, gamma), [_value(parent, values, gamma, c) for c in range(n)],
                                   rtol=1e-12, atol=1e-12)


@PROPS
@given(parent=forests())
def test_rows_are_a_path_decomposition(parent):
    """Every call in exactly one row; a row's calls are a chain (each after the first continues the one before, its
    parent's first child); a row starts at a root or at a later child of a fork: rows = roots + extra children."""
    tree = call_tree(parent)
    row, starts = tree.rows()
    children = _children(parent)
    for r in np.unique(row).tolist():
        calls = np.flatnonzero(row == r).tolist()
        assert starts[calls[0]] and not starts[calls[1:]].any()
        assert all(parent[b] == a and children[a][0] == b for a, b in zip(calls, calls[1:]))
    roots = sum(p < 0 for p in parent)
    assert len(np.unique(row)) == roots + sum(max(len(k) - 1, 0) for k in children.values())
    assert (row[starts] == np.arange(int(starts.sum()))).all()  # numbered by their first call's issue order


def test_a_chain_is_one_row_with_discounted_returns():
    tree = call_tree([-1, 0, 1, 2])
    row, starts = tree.rows()
    assert row.tolist() == [0, 0, 0, 0] and starts.tolist() == [True, False, False, False]
    assert tree.leaves_below().tolist() == [1, 1, 1, 1]
    np.testing.assert_allclose(tree.returns(np.array([0, 0, 0, 1.0]), 0.9), [0.729, 0.81, 0.9, 1.0])


def test_best_of_two_from_a_mid_state_and_a_sub_agent():
    """Calls: 0 root, 1 continues it, 2 and 3 two samples from 1's state, 4 a sub-agent's fresh context, 5 continues 3."""
    tree = call_tree([-1, 0, 1, 1, -1, 3])
    row, starts = tree.rows()
    assert row.tolist() == [0, 0, 0, 1, 2, 1] and starts.tolist() == [True, False, False, True, True, False]
    assert tree.leaves_below().tolist() == [2, 2, 1, 1, 1, 1]


@pytest.mark.parametrize("parent", [[0], [-1, 1], [-1, 5], [-1, -2]])
def test_a_parent_that_is_not_an_earlier_call_is_refused(parent):
    with pytest.raises(StepExpansionError, match="parent must be an earlier call"):
        call_tree(parent)


def _credit(parent, session, leaf_estimator, weighting="once", session_term=False, outcome=None):
    """verl_traj's tree credit (``stepwise.tree_credit``) on a forest laid out one call per row (its one token the
    call's, its packed leaf span on it; ``outcome`` ``[C]``: each leaf's own, read at the leaves): each call's
    ``(advantage, negative part, copies)``."""
    from verl_traj.stepwise.call_tree import pack_leaf_span
    from verl_traj.stepwise.tree_credit import tree_credit

    parent, session = np.asarray(parent), np.asarray(session)
    keys = np.zeros(parent.size, dtype=np.int64)
    for s in np.unique(session).tolist():  # each session's own tree and leaf numbering
        calls = np.flatnonzero(session == s)
        lo, hi = call_tree(np.where(parent[calls] >= 0, parent[calls] - calls[0], -1)).leaf_spans()
        own = np.zeros_like(lo) if outcome is None else (hi - lo == 1) & ~np.isin(calls - calls[0], parent[calls] - calls[0])
        keys[calls] = pack_leaf_span(lo, hi, own)
    t = torch.as_tensor(session)
    outcomes = torch.zeros(parent.size, 1, dtype=torch.float64) if outcome is None else \
        torch.as_tensor(outcome, dtype=torch.float64)[:, None]
    credit = tree_credit(torch.zeros(int(session.max()) + 1), torch.ones(parent.size, 1), t,
                         torch.as_tensor(keys)[:, None], outcomes,
                         np.zeros(int(session.max()) + 1, dtype=object), leaf_estimator,
                         session_term=session_term, norm_by_std=True, weighting=weighting)
    copies = credit.copies[:, 0] if credit.copies is not None else torch.ones(parent.size)
    return credit.advantages[:, 0].double(), credit.negative[:, 0].double(), copies.double()


def _forest(sessions):
    parent, session = [], []
    for s, p in enumerate(sessions):
        base = len(parent)
        parent += [x + base if x >= 0 else -1 for x in p]
        session += [s] * len(p)
    return parent, session


@PROPS
@given(sessions=st.lists(forests(), min_size=1, max_size=6), data=st.data())
def test_tree_grpo_equals_the_paper_on_each_leaf_and_the_mean_below_each_call(sessions, data):
    """Sessions of two prompts, each leaf its own outcome; the reference computes every leaf's two normalised terms
    from the lists of leaves directly (unbiased std, 0 for a group of one) and averages them per call; the tree credit
    takes the prompt term from the estimator it is given (checked to receive the leaves' outcomes) and adds the
    session term itself."""
    parent, session = _forest(sessions)
    prompt = [s % 2 for s in session]
    outcome = np.asarray(data.draw(st.lists(st.floats(-2, 2), min_size=len(parent), max_size=len(parent))))
    leaves = [c for c in range(len(parent)) if not _children(parent)[c]]  # depth-first within each session

    def norm(leaf, key):
        group = [outcome[m] for m in leaves if key[m] == key[leaf]]
        std = np.std(group, ddof=1) if len(group) > 1 else 0.0
        return (outcome[leaf] - np.mean(group)) / (std + 1e-6)

    ordered = [leaf for s in range(len(sessions)) for leaf in _session_leaves(parent, session, s)]
    prompt_term = torch.tensor([norm(leaf, prompt) for leaf in ordered], dtype=torch.float64)

    def estimator(g, group):
        torch.testing.assert_close(g, torch.tensor([outcome[leaf] for leaf in ordered], dtype=torch.float64))
        return prompt_term

    got, _, _ = _credit(parent, session, estimator, session_term=True, outcome=outcome)
    adv = {leaf: norm(leaf, prompt) + norm(leaf, session) for leaf in leaves}
    want = [np.mean([adv[leaf] for leaf in _leaves(parent, c)]) for c in range(len(parent))]
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-5)


def _session_leaves(parent, session, s):
    """Session ``s``'s leaves in depth-first order (children in issue order), as the leaf spans number them."""
    roots = [c for c, p in enumerate(parent) if p < 0 and session[c] == s]
    return [leaf for r in roots for leaf in _leaves(parent, r)]


def _ppo_loss(ratio: np.ndarray, adv: float, clip: float = 0.2, dual: float = 3.0) -> np.ndarray:
    """verl's vanilla PPO token loss with dual-clip (``clip_ratio_c``): ``max(-A r, -A clip(r))``, and for ``A < 0``
    at most ``-A c``."""
    loss = np.maximum(-adv * ratio, -adv * np.clip(ratio, 1 - clip, 1 + clip))
    return np.minimum(loss, -adv * dual) if adv < 0 else loss


@PROPS
@given(parent=forests(), data=st.data())
def test_the_parts_train_each_call_as_its_root_to_leaf_paths_would_under_clipping(parent, data):
    """The tree credit's parts (``advantages - negative`` and ``negative``, times the copies): per token,
    loss(r, P) + loss(r, N) = the sum over the call's paths of loss(r, A_l) (``expanded``), or that with each path's
    copy weighted 1 / m_c (``once``), for ratios inside and outside the clip range."""
    n = len(parent)
    leaves = _session_leaves(parent, [0] * n, 0)
    adv = np.asarray(data.draw(st.lists(st.floats(-3, 3), min_size=len(leaves), max_size=len(leaves))))
    adv = np.where(np.abs(adv) < 1e-3, 0.0, adv)  # float32 rows: no sign lost to rounding
    of_leaf = dict(zip(leaves, adv))
    ratio = np.asarray(data.draw(st.lists(st.floats(0.2, 5.0), min_size=4, max_size=4)))
    for weighting in ("expanded", "once"):
        a, neg, copies = _credit(parent, [0] * n, lambda g, group: torch.as_tensor(adv), weighting)
        for c in range(n):
            below = _leaves(parent, c)
            scale = 1.0 if weighting == "expanded" else 1.0 / len(below)
            want = sum(scale * _ppo_loss(ratio, of_leaf[leaf]) for leaf in below)
            part = float(a[c] - neg[c]), float(neg[c])
            got = float(copies[c]) * (_ppo_loss(ratio, part[0]) + _ppo_loss(ratio, part[1]))
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_records_delta_encode_against_their_parent_and_siblings_share_their_states_anchor():
    """Best-of-2 from call 1's state (calls 2 and 3, each seeing the same tool result) and a sub-agent's fresh context
    (call 4): each record stores only the tokens its parent's context lacks, decoding gives back every prompt, the
    siblings' GiGPO anchor is the state they branch from (equal), and a chain encodes as before (no parent key)."""
    from verl_traj.stepwise.records import decode_step_records, encode_step_records

    p0, r0 = [1, 2, 3], [4, 5]
    p1, r1 = p0 + r0 + [6], [7]
    obs = [8, 9]
    calls = [dict(prompt_ids=p0, response_ids=r0), dict(prompt_ids=p1, response_ids=r1),
             dict(prompt_ids=p1 + r1 + obs, response_ids=[10]), dict(prompt_ids=p1 + r1 + obs, response_ids=[11], parent=1),
             dict(prompt_ids=[20, 21], response_ids=[22], parent=-1)]
    steps = encode_step_records(calls)["steps"]
    assert [s.get("parent") for s in steps] == [None, None, None, 1, -1]
    assert [len(s["prompt_tail_ids"]) for s in steps] == [3, 1, 2, 2, 2]  # the sibling re-pays only the observation
    full = decode_step_records({"steps": steps})
    assert [f["prompt_ids"].tolist() for f in full] == [c["prompt_ids"] for c in calls]
    assert [f["parent"] for f in full] == [-1, 0, 1, 1, -1]
    assert torch.equal(torch.as_tensor(full[2]["anchor"]), torch.as_tensor(full[3]["anchor"]))
    chain = encode_step_records(calls[:3])["steps"]
    assert all("parent" not in s for s in chain)
    with pytest.raises(StepExpansionError, match="names parent 7"):
        encode_step_records([dict(prompt_ids=[1], response_ids=[2], parent=7)])


def _t(x):
    return torch.tensor(x, dtype=torch.long)


@st.composite
def sessions_with_tokens(draw):
    """A forest's calls with token contexts: a child's prompt is its parent's full context plus an observation, or
    (sometimes) rewritten; a root's prompt fresh."""
    parent = draw(forests())
    tok = st.integers(1, 50)
    prompts, responses = [], []
    for k, p in enumerate(parent):
        if p < 0 or draw(st.integers(0, 5)) == 0:
            prompt = draw(st.lists(tok, min_size=1, max_size=6))
        else:
            prompt = prompts[p] + responses[p] + draw(st.lists(tok, max_size=4))
        prompts.append(prompt)
        responses.append(draw(st.lists(tok, min_size=1, max_size=5)))
    return parent, prompts, responses


@PROPS
@given(session=sessions_with_tokens())
def test_tree_rows_train_every_call_once_and_keep_its_context(session):
    """Each call's response is a loss span of exactly one row, the row's tokens before it are exactly the call's
    prompt, and the rows number roots + forks' later children + rewritten contexts."""
    from verl_traj.stepwise.tree_rows import tree_merged_rows

    parent, prompts, responses = session
    n = len(parent)
    rows = tree_merged_rows([_t(p) for p in prompts], [_t(r) for r in responses],
                            [torch_ones(len(r)) for r in responses], parent, {"lp": [_t(r) * 10 for r in responses]})
    seen = sorted(k for row in rows for k in row.source_steps)
    assert seen == list(range(n))
    for row in rows:
        full = row.prompt_ids.tolist() + row.response_ids.tolist()
        mask = [0] * row.prompt_ids.numel() + row.response_mask.tolist()
        at = row.prompt_ids.numel()
        for k in row.source_steps:
            start = len(prompts[k])
            assert full[:start] == prompts[k]  # the call's context, whole
            assert full[start:start + len(responses[k])] == responses[k] and all(mask[start:start + len(responses[k])])
            assert not any(mask[at:start])  # observations between are masked
            at = start + len(responses[k])
        assert at == len(full)
    assert sum(int(r.response_mask.sum()) for r in rows) == sum(map(len, responses))


def torch_ones(n):
    return torch.ones(n, dtype=torch.long)


def test_a_chain_gives_todays_merged_rows_and_interleaved_sub_agents_one_row_each():
    from verl_traj.stepwise.prefix_merge import merge_trajectory_steps
    from verl_traj.stepwise.tree_rows import tree_merged_rows

    prompts = [[1, 2], [1, 2, 3, 4, 5], [9], [1, 2, 3, 4, 5, 6, 7]]
    responses = [[3], [6], [10], [8]]
    chain = [-1, 0, 1, 2]
    args = ([_t(p) for p in prompts], [_t(r) for r in responses], [torch_ones(len(r)) for r in responses])
    want, _ = merge_trajectory_steps(*args, enable=True)
    got = tree_merged_rows(*args, chain)
    assert [(r.prompt_ids.tolist(), r.response_ids.tolist(), r.response_mask.tolist(), r.source_steps)
            for r in got] == [(r.prompt_ids.tolist(), r.response_ids.tolist(), r.response_mask.tolist(), r.source_steps)
                              for r in want]
    # A1 [1,2]->[3]; B1 (a sub-agent, fresh) [9]->[10]; A2 continues A1; B2 continues B1: two rows, each distinct token once
    a1, b1 = ([1, 2], [3]), ([9], [10])
    a2, b2 = ([1, 2, 3, 4], [5]), ([9, 10, 11], [12])
    calls = [a1, b1, a2, b2]
    rows = tree_merged_rows([_t(c[0]) for c in calls], [_t(c[1]) for c in calls], [torch_ones(1)] * 4, [-1, -1, 0, 1])
    assert [r.source_steps for r in rows] == [[0, 2], [1, 3]]
    assert [r.prompt_ids.tolist() + r.response_ids.tolist() for r in rows] == [[1, 2, 3, 4, 5], [9, 10, 11, 12]]
