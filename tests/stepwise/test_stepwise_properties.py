"""Hypothesis properties of step-wise advantages and prefix merging."""

import numpy as np
import torch
from hypothesis import example, given, settings, strategies as st

from verl.trainer.ppo.core_algos import get_adv_estimator_fn

from tests.stepwise.helpers import trajectory_advantages
from verl_traj.stepwise.prefix_merge import can_merge_boundaries, merge_trajectory_steps

SETTINGS = settings(max_examples=60, deadline=None)


# ----------------------------------------------------------------------------- advantages
@st.composite
def stepwise_batches(draw):
    n_groups = draw(st.integers(1, 4))
    width = draw(st.integers(1, 12))
    rows = []  # (traj, uid, step, last, resp_len, reward)
    t = 0
    for g in range(n_groups):
        for _ in range(draw(st.integers(1, 4))):
            n_steps = draw(st.integers(1, 5))
            reward = draw(st.sampled_from([0.0, 0.5, 1.0, -1.0]))
            for s in range(n_steps):
                rows.append((f"t{t}", f"g{g}", s, s == n_steps - 1, draw(st.integers(0, width)), reward))
            t += 1
    n_pad = draw(st.integers(0, 3))
    perm = draw(st.permutations(list(range(len(rows) + n_pad))))
    return rows, width, n_pad, perm


_EMPTY_GROUP = ([("t0", "g0", 0, True, 0, 0.0), ("t1", "g0", 0, True, 0, 0.0), ("t2", "g1", 0, True, 0, 0.0),
                 ("t3", "g2", 0, True, 0, 0.0)], 1, 0, [0, 1, 2, 3])  # CI found: opo on a group with no tokens


@SETTINGS
@given(stepwise_batches(), st.sampled_from(["grpo", "grpo_vectorized", "rloo", "rloo_vectorized", "opo", "gpg"]))
@example(_EMPTY_GROUP, "opo")
def test_advantage_equals_per_trajectory_reference(batch, name):
    rows, width, n_pad, perm = batch
    B = len(rows) + n_pad
    lengths = [r[4] for r in rows] + [0] * n_pad
    mask = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).float()
    rewards = torch.zeros(B, width)
    for b, r in enumerate(rows):
        if r[3]:
            rewards[b, 0] = r[5]  # position does not matter: the row sum is the score
    traj = np.array([r[0] for r in rows] + [None] * n_pad, dtype=object)
    uid = np.array([r[1] for r in rows] + [f"__pad{k}" for k in range(n_pad)], dtype=object)
    last = np.array([r[3] for r in rows] + [True] * n_pad)
    pad = np.array([False] * len(rows) + [True] * n_pad)
    p = np.array(perm)
    fn = get_adv_estimator_fn(name)
    adv, _, traj_adv, index = trajectory_advantages(
        rewards[p], mask[p], uid[p], traj[p], last[p], pad[p], estimator_fn=fn, estimator_name=name
    )
    # reference: the estimator on one row per trajectory (loss-token-length mask for opo)
    names = list(dict.fromkeys(traj[p][~pad[p]]))
    score = {r[0]: r[5] for r in rows}
    group = {r[0]: r[1] for r in rows}
    ntok = {}
    for r in rows:
        ntok[r[0]] = ntok.get(r[0], 0) + r[4]
    sc = torch.tensor([[score[n]] for n in names])
    if name == "opo":
        L = max([ntok[n] for n in names] + [1])
        m = (torch.arange(L)[None] < torch.tensor([ntok[n] for n in names])[:, None]).float()
        ref_full, _ = fn(token_level_rewards=sc * 0 + torch.nn.functional.pad(sc, (0, L - 1)), response_mask=m,
                         index=np.array([group[n] for n in names], dtype=object))
        # a trajectory with no loss token has no advantage to compare: verl's opo gives it 0/0 = nan when its
        # whole group is empty (regression: hypothesis found a group of zero-length trajectories)
        has_tokens = torch.tensor([ntok[n] for n in names]) > 0
        ref = torch.where(has_tokens, ref_full[:, 0], 0.0)
        got = torch.where(has_tokens, traj_adv, 0.0)
        assert torch.allclose(got, ref, atol=1e-5)
    else:
        ref, _ = fn(token_level_rewards=sc, response_mask=torch.ones(len(names), 1),
                    index=np.array([group[n] for n in names], dtype=object))
        assert torch.allclose(traj_adv, ref[:, 0], atol=1e-5)
    # every row: its trajectory's scalar times its OWN mask; padding rows zero
    mp = mask[p]
    for b in range(B):
        if pad[p][b]:
            assert torch.count_nonzero(adv[b]) == 0
        else:
            k = names.index(traj[p][b])
            assert torch.allclose(adv[b], traj_adv[k] * mp[b], atol=1e-6)


@SETTINGS
@given(stepwise_batches())
def test_advantage_is_permutation_equivariant(batch):
    rows, width, n_pad, perm = batch
    if n_pad:
        return
    lengths = [r[4] for r in rows]
    mask = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).float()
    rewards = torch.tensor([[r[5] if r[3] else 0.0] + [0.0] * (width - 1) for r in rows])
    traj = np.array([r[0] for r in rows], dtype=object)
    uid = np.array([r[1] for r in rows], dtype=object)
    last = np.array([r[3] for r in rows])
    fn = get_adv_estimator_fn("grpo")
    a, *_ = trajectory_advantages(rewards, mask, uid, traj, last, estimator_fn=fn)
    p = np.array(perm)
    b, *_ = trajectory_advantages(rewards[p], mask[p], uid[p], traj[p], last[p], estimator_fn=fn)
    assert torch.allclose(a[p], b, atol=1e-6)


# ----------------------------------------------------------------------------- prefix merge
@st.composite
def trajectories(draw):
    """Steps whose next prompt continues the context, rewrites it, or re-tokenises the last response."""
    n = draw(st.integers(1, 7))
    tok = st.integers(0, 50)
    prompts, responses, masks, lps = [], [], [], []
    prompt = torch.tensor(draw(st.lists(tok, min_size=0, max_size=5)), dtype=torch.long)
    for i in range(n):
        resp = torch.tensor(draw(st.lists(tok, min_size=0, max_size=5)), dtype=torch.long)
        m = torch.tensor(draw(st.lists(st.sampled_from([0, 1, 1]), min_size=resp.numel(), max_size=resp.numel())), dtype=torch.long)
        lp = -torch.rand(resp.numel()) - 0.01
        prompts.append(prompt)
        responses.append(resp)
        masks.append(m)
        lps.append(lp)
        kind = draw(st.sampled_from(["continue", "continue", "rewrite", "retokenise"]))
        obs = torch.tensor(draw(st.lists(tok, min_size=0, max_size=4)), dtype=torch.long)
        full = torch.cat([prompt, resp])
        if kind == "continue":
            prompt = torch.cat([full, obs])
        elif kind == "rewrite":
            prompt = torch.cat([prompt[: draw(st.integers(0, prompt.numel()))], obs])
        else:  # last response token re-tokenised differently (or dropped) in the next prompt
            if resp.numel():
                prompt = torch.cat([prompt, resp[:-1], torch.tensor([resp[-1] + 100]), obs])
            else:
                prompt = torch.cat([full, obs])
    return prompts, responses, masks, lps


@SETTINGS
@given(trajectories(), st.booleans())
def test_merge_preserves_loss_tokens_and_values(traj, enable):
    prompts, responses, masks, lps = traj
    rows, stats = merge_trajectory_steps(prompts, responses, masks, {"lp": lps}, enable=enable)
    n = len(prompts)
    # steps are partitioned into consecutive, ordered runs
    assert [s for r in rows for s in r.source_steps] == list(range(n))
    assert [r.step_index for r in rows] == list(range(len(rows)))
    assert [r.is_last_step for r in rows] == [False] * (len(rows) - 1) + [True]
    # loss tokens: same ids, same per-token values, same order, same count
    before_ids = torch.cat([r[m != 0] for r, m in zip(responses, masks)])
    before_lp = torch.cat([v[m != 0] for v, m in zip(lps, masks)])
    after_ids = torch.cat([r.response_ids[r.response_mask != 0] for r in rows])
    after_lp = torch.cat([r.per_token["lp"][r.response_mask != 0] for r in rows])
    assert torch.equal(before_ids, after_ids) and torch.equal(before_lp, after_lp)
    assert stats.loss_tokens_before == stats.loss_tokens_after == before_ids.numel()
    assert stats.rows_after == len(rows) <= stats.rows_before == n
    assert stats.tokens_after <= stats.tokens_before
    for r in rows:
        last = r.source_steps[-1]
        # a merged row is exactly its last step's full context (so the policy sees the same tokens)
        assert torch.equal(torch.cat([r.prompt_ids, r.response_ids]), torch.cat([prompts[last], responses[last]]))
        assert torch.equal(r.prompt_ids, prompts[r.source_steps[0]])
        # observation tokens (not part of any step's response) carry zero values
        resp_pos = torch.zeros(r.response_ids.numel(), dtype=torch.bool)
        off = 0
        for j, s in enumerate(r.source_steps):
            if j:
                off += prompts[s].numel() - (prompts[r.source_steps[j - 1]].numel() + responses[r.source_steps[j - 1]].numel())
            resp_pos[off : off + responses[s].numel()] = True
            off += responses[s].numel()
        assert torch.count_nonzero(r.response_mask[~resp_pos]) == 0
        assert torch.count_nonzero(r.per_token["lp"][~resp_pos]) == 0
    # merging is maximal (enabled) / absent (disabled)
    ok = can_merge_boundaries(prompts, responses)
    for a, b in zip(rows, rows[1:]):
        assert not enable or not ok[a.source_steps[-1]]
    if not enable:
        assert len(rows) == n
    else:
        assert len(rows) == 1 + sum(1 for x in ok if not x)
