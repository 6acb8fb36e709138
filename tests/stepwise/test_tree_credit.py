"""Credit and loss on branching sessions (issue 56), against the expanded root-to-leaf chains, in fp64 on CPU.

Random forests of sessions (forks anywhere, sub-agents' fresh contexts, per-leaf outcomes or the session's) are
recorded as the agent loop records them, expanded and planned by v0's ``_balance_batch`` on two ranks under a token cap
that cuts sessions across micro-batches, and advantaged by fit's ``compute_advantage``:

* (a) a session without forks records and trains exactly as before (no tree field; the tree credit on chains is
  today's advantage bit for bit);
* each loss token trains once, with its call's parts against a brute force over Python lists of the leaves below it
  (outcome estimators over each prompt's leaves, Tree-GRPO's two terms);
* (b), (c) verl's clipped policy loss (dual-clip on) through verl_traj's weighted loss on the planned rows, micro-batch
  by micro-batch on both ranks, equals the root-to-leaf paths trained as separate rows (each call's copy weighted
  ``1 / m_c`` for ``once``; every copy whole for ``expanded``, the normaliser counting the copies): the same loss and
  the same gradient on every token's log-prob, in fp64 (the batch's float32 advantages and loss weights are checked
  against the fp64 values the loss then takes; the loss rounds its token weights to float32, as in training).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from verl import DataProto
from verl.trainer.ppo import ray_trainer

from verl_traj.config import TrajConfig
from verl_traj.core.keys import (ADVANTAGES_NEGATIVE, IS_PADDING, MICRO_BATCH_ID, MINI_BATCH_ID, PATH_COPIES,
                                 TRAJ_INDEX, TREE_CALLS)
from verl_traj.integration.config.update_spec import LossSpec
from verl_traj.integration.patches.scoped import fit_patches, patched
from verl_traj.stepwise.advantages import compute_trajectory_advantages
from verl_traj.stepwise.expand import expand_step_rows
from verl_traj.stepwise.step_groups import StepGroupOptions
from verl_traj.stepwise.tree_credit import tree_credit
from verl_traj.testing.branching import branching_batch, branching_session, leaves_below

from .verl_batches import planned_stepwise_batch, stepwise_trainer

EPS = 1e-6
UIDS = ["g0"] * 3 + ["g1"] * 3


def _sessions(seed: int, leaf_outcomes: bool, fork: float = 0.35, fresh: float = 0.15):
    rng = np.random.default_rng(seed)
    sessions, token = [], 1000
    for g in range(2):
        prompt = rng.integers(1, 100, 3).tolist()
        for _ in range(3):
            s = branching_session(rng, int(rng.integers(1, 9)), token, prompt=prompt, fork=fork, fresh=fresh,
                                  leaf_outcomes=leaf_outcomes)
            token += sum(map(len, s.response))
            sessions.append(s)
    rewards = [float(rng.integers(0, 5)) / 4 for _ in sessions]
    return sessions, rewards


def _planned(seed: int, estimator: str, weighting: str = "once", leaf_outcomes: bool = True, advantage: bool = True):
    """The sessions as v0's ``_balance_batch`` on two ranks under a token cap, advantaged by fit's
    ``compute_advantage`` (``advantage``)."""
    sessions, rewards = _sessions(seed, leaf_outcomes)
    tensors, non = branching_batch(sessions, UIDS, rewards)
    data = DataProto.from_dict(tensors=tensors, non_tensors=non, meta_info={})
    longest = int(expand_step_rows(tensors, non, merge_prefix=True).tensors["attention_mask"].sum(-1).max())
    # a micro-batch holds about one longest row: sessions are cut across micro-batches (and ranks)
    traj = TrajConfig(step_wise=True, branch_weighting=weighting, micro_batch_max_tokens=longest, prefix_tree=False)
    stepwise_trainer(traj, 2, estimator)._balance_batch(data, {})
    data.batch["token_level_rewards"] = data.batch["rm_scores"].clone()
    if not advantage:
        return data, sessions, rewards
    with patched(fit_patches(True, step_groups=StepGroupOptions.of(traj))):
        ray_trainer.compute_advantage(data, estimator, gamma=1.0, norm_adv_by_std_in_grpo=True,
                                      config=OmegaConf.create({}))
    return data, sessions, rewards


def _normalised(values: list[float], one_is_mean: bool) -> list[float]:
    """verl's GRPO on one group: a group of one has mean 0 and std 1 (``one_is_mean``: Tree-GRPO's session term, a
    group of one is its own mean)."""
    v = np.asarray(values, dtype=np.float64)
    if v.size == 1:
        return [0.0] if one_is_mean else [float(v[0] / (1.0 + EPS))]
    return ((v - v.mean()) / (v.std(ddof=1) + EPS)).tolist()


def _reference(sessions, rewards, estimator: str):
    """``{(session, call): (P, N, m)}`` by brute force: each leaf's outcome (own or the session's), GRPO over the
    leaves of each prompt's sessions (plus Tree-GRPO's term over the session's own), summed over the leaves below."""
    leaf_keys, outcomes = [], []
    for b, s in enumerate(sessions):
        for path in s.paths():
            leaf = path[-1]
            leaf_keys.append((b, leaf))
            outcomes.append(s.outcome[leaf] if s.outcome[leaf] is not None else rewards[b])
    adv = {}
    for uid in set(UIDS):
        members = [i for i, (b, _) in enumerate(leaf_keys) if UIDS[b] == uid]
        for i, a in zip(members, _normalised([outcomes[i] for i in members], False)):
            adv[leaf_keys[i]] = a
    if estimator == "tree_grpo":
        for b in range(len(sessions)):
            members = [i for i, (s, _) in enumerate(leaf_keys) if s == b]
            for i, a in zip(members, _normalised([outcomes[i] for i in members], True)):
                adv[leaf_keys[i]] += a
    out = {}
    for b, s in enumerate(sessions):
        for c, below in enumerate(leaves_below(s)):
            a = [adv[(b, leaf)] for leaf in below]
            out[(b, c)] = (sum(x for x in a if x > 0), sum(x for x in a if x < 0), len(below))
    return out, adv


def _token_calls(sessions):
    return {t: (b, c) for b, s in enumerate(sessions) for c, r in enumerate(s.response) for t in r}


@pytest.mark.parametrize("estimator", ["grpo", "tree_grpo"])
@pytest.mark.parametrize("seed", range(6))
def test_every_loss_token_trains_once_with_its_calls_parts(seed, estimator):
    data, sessions, rewards = _planned(seed, estimator)
    want, _ = _reference(sessions, rewards, estimator)
    td = data.batch
    calls = _token_calls(sessions)
    ids, mask = td["responses"], td["response_mask"]
    real = td[TRAJ_INDEX] >= 0
    negative = td[ADVANTAGES_NEGATIVE] if ADVANTAGES_NEGATIVE in td.keys() else torch.zeros_like(td["advantages"])
    seen = []
    for b, t in (mask.bool() & real[:, None]).nonzero().tolist():
        key = calls[int(ids[b, t])]
        seen.append(int(ids[b, t]))
        P, N, m = want[key]
        assert float(td["advantages"][b, t]) == pytest.approx((P + N) / m, abs=1e-5)
        assert float(negative[b, t]) == pytest.approx(N / m if P > 0 and N < 0 else 0.0, abs=1e-5)
    assert sorted(seen) == sorted(calls)  # every response token once, no other loss token
    assert not td["advantages"][~real].any() and TREE_CALLS not in td.keys()  # read once, then removed


def test_a_session_without_forks_records_and_trains_as_before():
    """(a): chains record no ``parent`` / ``outcome`` and expand without tree fields; on chains the tree credit is
    today's per-trajectory advantage, bit for bit."""
    sessions, _ = _sessions(3, False, fork=0.0, fresh=0.0)
    assert not any("parent" in r or "outcome" in r for s in sessions for r in s.records["steps"])
    data, _ = planned_stepwise_batch(seed=4, merge=True)
    assert TREE_CALLS not in data.batch.keys()
    td = data.batch
    from verl.trainer.ppo.core_algos import get_adv_estimator_fn
    from verl_traj.stepwise.advantages import last_step_rows, run_outcome_estimator

    fn = get_adv_estimator_fn("grpo")
    adv, _, _ = compute_trajectory_advantages(td["token_level_rewards"], td["response_mask"], td[TRAJ_INDEX],
                                              data.non_tensor_batch["is_last_step"], data.non_tensor_batch["uid"],
                                              estimator_fn=fn)
    last = last_step_rows(td[TRAJ_INDEX], data.non_tensor_batch["is_last_step"])
    credit = tree_credit(td["token_level_rewards"].sum(-1)[last], td["response_mask"], td[TRAJ_INDEX],
                         torch.zeros(td["response_mask"].shape, dtype=torch.long), torch.zeros(td["response_mask"].shape),
                         np.asarray(data.non_tensor_batch["uid"], dtype=object)[last.numpy()],
                         lambda g, group: run_outcome_estimator(fn, g.float(), group)[0])
    assert torch.equal(credit.advantages, adv) and not credit.negative.any()


def _theta(sessions, seed: int):
    """A log-prob per response token (the policy being trained) and an old one that puts about half the ratios
    outside the clip range (dual-clip included)."""
    gen = torch.Generator().manual_seed(seed)
    tokens = sorted(_token_calls(sessions))
    theta = {t: -torch.rand((), generator=gen, dtype=torch.float64) - 0.05 for t in tokens}
    old = {t: theta[t] + (torch.rand((), generator=gen, dtype=torch.float64) - 0.5) * 2.5 for t in tokens}
    return tokens, theta, old


def _config():
    """verl's actor config: vanilla PPO clipping at 0.2 with dual-clip at 3, no entropy or KL term."""
    from verl.workers.config import ActorConfig

    return ActorConfig(strategy="fsdp2", ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=1, rollout_n=1,
                       use_kl_loss=False, entropy_coeff=0.0, clip_ratio=0.2, clip_ratio_c=3.0,
                       loss_agg_mode="token-mean")


def _policy_loss(H, log_prob, old, adv, mask, weight, negative=None, copies=None):
    from verl_traj.integration.workers.losses import weighted_policy_loss

    loss, _ = weighted_policy_loss(_config(), log_prob=log_prob, old_log_prob=old, advantages=adv, response_mask=mask,
                                   loss_weight=weight, dp_size=1, negative=negative, copies=copies)
    return loss


def _tree_loss(H, data, want, calls, theta_vec, index, old_of):
    """verl_traj's loss on the planned rows, micro-batch by micro-batch on each rank (what the engines sum), in fp64:
    each loss token's call parts from ``want`` (the batch holds them in float32: checked against ``want`` by
    :func:`test_every_loss_token_trains_once_with_its_calls_parts`), the loss weights from ``LossSpec.weights`` in
    fp64 (checked equal to the float32 ones)."""
    td = data.batch
    ids, mask = td["responses"], td["response_mask"].bool() & (td[TRAJ_INDEX] >= 0)[:, None]
    parts = torch.zeros(*ids.shape, 3, dtype=torch.float64)  # P, N, m of each loss token's call
    for b, t in mask.nonzero().tolist():
        parts[b, t] = torch.tensor(want[calls[int(ids[b, t])]], dtype=torch.float64)
    P, N, m = parts.unbind(-1)
    m = m.clamp(min=1)
    adv, negative = (P + N) / m, torch.where((P > 0) & (N < 0), N / m, 0.0)
    copies = td[PATH_COPIES].double() if PATH_COPIES in td.keys() else None
    spec = LossSpec("token-mean", None)
    weights = spec.weights(td["response_mask"], td[MINI_BATCH_ID], td[TRAJ_INDEX], td[IS_PADDING], copies=copies)
    counted = (mask * (copies if copies is not None else 1.0)).double().sum(-1)
    mass = torch.zeros(int(td[MINI_BATCH_ID].max()) + 1, dtype=torch.float64).index_add_(0, td[MINI_BATCH_ID], counted)
    exact = torch.where(td[TRAJ_INDEX] >= 0, 1.0 / mass[td[MINI_BATCH_ID]], 0.0)
    torch.testing.assert_close(weights.double(), exact, rtol=1e-6, atol=0.0)
    log_prob = torch.where(mask, theta_vec[index(ids)], 0.0)
    old = torch.where(mask, old_of(ids), 0.0)
    total = torch.zeros((), dtype=torch.float64)
    for mb in torch.unique(td[MICRO_BATCH_ID]).tolist():  # the loss is a weighted token sum: any cut of the rows
        rows = td[MICRO_BATCH_ID] == mb
        total = total + _policy_loss(H, log_prob[rows], old[rows], adv[rows], mask[rows], exact[rows],
                                     negative[rows] if bool(negative.any()) else None,
                                     None if copies is None else copies[rows])
    return total


def _path_loss(H, sessions, adv, mini_batch_of, theta_vec, index, old_of, weighting: str):
    """The reference: every root-to-leaf path its own row, each token with its leaf's advantage; ``once`` weighs a
    call's copy ``1 / m_c``; each mini-batch normalised by its tokens (``once``: distinct; ``expanded``: copies)."""
    total = torch.zeros((), dtype=torch.float64)
    below = [leaves_below(s) for s in sessions]
    for mb in sorted(set(mini_batch_of.values())):
        members = [b for b in range(len(sessions)) if mini_batch_of[b] == mb]
        rows, advs, weights = [], [], []
        for b in members:
            for path in sessions[b].paths():
                tokens = [t for c in path for t in sessions[b].response[c]]
                share = [1.0 / len(below[b][c]) if weighting == "once" else 1.0 for c in path
                         for _ in sessions[b].response[c]]
                rows.append(tokens)
                advs.append([adv[(b, path[-1])]] * len(tokens))
                weights.append(share)
        norm = sum(sum(w) for w in weights)
        width = max(map(len, rows))
        ids = torch.tensor([r + [rows[0][0]] * (width - len(r)) for r in rows])
        mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows]).bool()
        a = torch.tensor([x + [0.0] * (width - len(x)) for x in advs], dtype=torch.float64)
        w = torch.tensor([x + [0.0] * (width - len(x)) for x in weights], dtype=torch.float64) / norm
        log_prob = torch.where(mask, theta_vec[index(ids)], 0.0)
        old = torch.where(mask, old_of(ids), 0.0)
        from verl_traj.integration.workers.losses import weighted_policy_loss

        loss, _ = weighted_policy_loss(_config(), log_prob=log_prob, old_log_prob=old, advantages=a, response_mask=mask,
                                       loss_weight=torch.ones(len(rows), dtype=torch.float64), dp_size=1,
                                       rollout_is_weights=w)
        total = total + loss
    return total


@pytest.mark.parametrize("weighting", ["once", "expanded"])
@pytest.mark.parametrize("estimator", ["grpo", "tree_grpo"])
@pytest.mark.parametrize("seed", range(4))
def test_the_tree_loss_is_the_root_to_leaf_paths_loss(seed, estimator, weighting, monkeypatch):
    """(b) ``expanded`` and (c) ``once``: the loss and its gradient on every token's log-prob equal the paths'."""
    from tests.integration import grad_harness as H

    H.patch_verl_device(monkeypatch)
    data, sessions, rewards = _planned(seed, estimator, weighting)
    want, adv = _reference(sessions, rewards, estimator)
    tokens, theta, old = _theta(sessions, seed)
    lookup = torch.zeros(max(tokens) + 1, dtype=torch.long)
    lookup[torch.tensor(tokens)] = torch.arange(len(tokens))
    old_vec = torch.stack([old[t] for t in tokens])

    def index(ids):
        return lookup[ids.clamp(max=max(tokens))]

    def old_of(ids):
        return old_vec[index(ids)]

    traj_id = data.non_tensor_batch["traj_id"]
    mb = data.batch[MINI_BATCH_ID]
    mini_batch_of = {int(str(traj_id[r])[1:]): int(mb[r]) for r in range(len(traj_id))
                     if int(data.batch[TRAJ_INDEX][r]) >= 0}
    grads = []
    for fn in (lambda v: _tree_loss(H, data, want, _token_calls(sessions), v, index, old_of),
               lambda v: _path_loss(H, sessions, adv, mini_batch_of, v, index, old_of, weighting)):
        theta_vec = torch.stack([theta[t] for t in tokens]).clone().requires_grad_(True)
        loss = fn(theta_vec)
        loss.backward()
        grads.append((loss.detach(), theta_vec.grad.clone()))
    (tree_loss, tree_grad), (path_loss, path_grad) = grads
    # fp64 throughout but the token weights, which verl_traj's loss takes in float32 by design (a weighting error is
    # off by a factor, far above this)
    torch.testing.assert_close(tree_loss, path_loss, rtol=1e-6, atol=1e-12)
    torch.testing.assert_close(tree_grad, path_grad, rtol=1e-6, atol=1e-12)
    ratio = (torch.stack([theta[t] for t in tokens]) - old_vec).exp()
    assert ((ratio < 0.8) | (ratio > 1.2)).any() and ((ratio > 0.8) & (ratio < 1.2)).any()  # clipping is active


def test_the_token_cap_cuts_sessions_across_micro_batches():
    """The loss cases above include sessions whose rows the token cap puts in different micro-batches."""
    cut = 0
    for seed in range(4):
        data, *_ = _planned(seed, "grpo")
        cells: dict = {}
        for r, t in enumerate(data.non_tensor_batch["traj_id"]):
            if int(data.batch[TRAJ_INDEX][r]) >= 0:
                cells.setdefault(t, set()).add(int(data.batch[MICRO_BATCH_ID][r]))
        cut += sum(len(c) > 1 for c in cells.values())
    assert cut > 0


@pytest.mark.parametrize("weighting", ["once", "expanded"])
@pytest.mark.parametrize("estimator", ["grpo", "tree_grpo"])
def test_v1s_planned_advantage_gives_v0s_on_trees(estimator, weighting):
    """v1: the tree fields travel as the agent-loop worker's row tags, the plan's facts put them back on their tokens;
    ``planned_advantage`` gives v0's advantages and hands on v0's two-sign part and path copies, each row's loss
    tokens counting the copies."""
    from tests.integration.test_v1_adapter import _v1_view
    from verl_traj.core.rollout.row_key import parse_row_keys
    from verl_traj.core.rollout.row_tags import TREE_CALLS_TAG, TREE_OUTCOMES_TAG, sparse_tag, tag_entries
    from verl_traj.integration.trainers.v1_advantage import planned_advantage
    from verl_traj.testing.batches import as_dataproto
    import dataclasses

    data, *_ = _planned(5, estimator, weighting, advantage=False)
    keys, scores, facts = _v1_view(data)
    td = data.batch
    tags = [{**sparse_tag(TREE_CALLS_TAG, c), **sparse_tag(TREE_OUTCOMES_TAG, o)}
            for c, o in zip(td[TREE_CALLS], td["traj_tree_outcomes"])]
    facts = dataclasses.replace(facts, tree_calls=tag_entries(tags, TREE_CALLS_TAG, torch.int64),
                                tree_outcomes=tag_entries(tags, TREE_OUTCOMES_TAG, torch.float32))
    options = StepGroupOptions(branch_weighting=weighting)
    handed = []
    v1 = planned_advantage(facts, as_dataproto({"token_level_scores": scores, "token_level_rewards": scores.clone(),
                                                "response_mask": td["response_mask"],
                                                "attention_mask": td["attention_mask"]},
                                               {"uid": parse_row_keys(keys).uid}), keys, estimator,
                           config=OmegaConf.create({}), step_groups=options, hand_on=handed.append)
    with patched(fit_patches(True, step_groups=options)):
        ray_trainer.compute_advantage(data, estimator, gamma=1.0, config=OmegaConf.create({}))
    torch.testing.assert_close(v1.batch["advantages"], td["advantages"])
    (got,) = handed
    for name, part in ((ADVANTAGES_NEGATIVE, got.advantages_negative), (PATH_COPIES, got.path_copies)):
        assert (part is None) == (name not in td.keys())
        if part is not None:
            torch.testing.assert_close(part, td[name])
    if weighting == "expanded":
        copies = td[PATH_COPIES] if PATH_COPIES in td.keys() else torch.ones_like(td["advantages"])
        want = ((td["response_mask"] != 0) * copies).sum(-1).round().long() * (td[TRAJ_INDEX] >= 0)
        assert torch.equal(got.loss_tokens, want)


@pytest.mark.parametrize("estimator,field", [("gae", "algorithm.adv_estimator"), ("reinforce_plus_plus",
                         "algorithm.adv_estimator"), ("opo", "algorithm.adv_estimator"),
                         ("gigpo", "algorithm.adv_estimator")])
def test_estimators_not_defined_on_a_tree_are_refused_naming_the_fix(estimator, field):
    """Before any update, on the first batch whose sessions branch (start-up cannot know an agent will fork)."""
    from verl_traj.core.errors import TrajInputError

    data, *_ = _planned(0, "grpo", advantage=False)
    data.batch["values"] = torch.zeros_like(data.batch["token_level_rewards"])
    with pytest.raises(TrajInputError, match="sessions branch") as raised:
        with patched(fit_patches(True, step_groups=StepGroupOptions())):
            ray_trainer.compute_advantage(data, estimator, gamma=1.0, config=OmegaConf.create({}))
    assert raised.value.field == field and "Fix:" in str(raised.value)


@pytest.mark.parametrize("estimator", ["grpo", "tree_grpo"])
def test_trajectory_scoped_ratios_on_trees_are_refused(estimator):
    from verl_traj.core.errors import TrajInputError

    data, *_ = _planned(0, "grpo", advantage=False)
    with pytest.raises(TrajInputError, match="ratio_scope=row") as raised:
        with patched(fit_patches(True, step_groups=StepGroupOptions(ratio_scope="trajectory"))):
            ray_trainer.compute_advantage(data, estimator, config=OmegaConf.create({}))
    assert raised.value.field == "traj.ratio_scope"


def test_kl_in_reward_and_turn_rewards_on_trees_are_refused():
    from verl_traj.core.errors import TrajInputError
    from verl_traj.stepwise.expand_inputs import StepExpansionError

    data, *_ = _planned(0, "grpo", advantage=False)
    with pytest.raises(TrajInputError) as raised:
        with patched(fit_patches(True, step_groups=StepGroupOptions())):
            ray_trainer.compute_advantage(data, "grpo", config=OmegaConf.create({"use_kl_in_reward": True}))
    assert raised.value.field == "algorithm.use_kl_in_reward"
    sessions, rewards = _sessions(0, False)
    branching = next(s for s in sessions if any(p != k - 1 for k, p in enumerate(s.parent)))
    branching.records["steps"][0]["reward"] = 0.5
    tensors, non = branching_batch(sessions, UIDS, rewards)
    with pytest.raises(StepExpansionError) as raised:
        expand_step_rows(tensors, non, merge_prefix=True)
    assert raised.value.field == "reward" and "branching session" in str(raised.value)
    branching.records["steps"][0].pop("reward")
    branching.records["steps"][0]["outcome"] = 1.0  # the first call has children: not a leaf
    with pytest.raises(StepExpansionError, match="not a leaf") as raised:
        expand_step_rows(*branching_batch(sessions, UIDS, rewards), merge_prefix=True)
    assert raised.value.field == "outcome"


def test_the_two_part_loss_refuses_a_loss_it_is_not_exact_for(monkeypatch):
    from tests.integration import grad_harness as H
    from verl.workers.config import ActorConfig, PolicyLossConfig
    from verl_traj.core.errors import TrajInputError
    from verl_traj.integration.workers.losses import weighted_policy_loss

    H.patch_verl_device(monkeypatch)
    config = ActorConfig(strategy="fsdp2", ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=1, rollout_n=1,
                         use_kl_loss=False, entropy_coeff=0.0, loss_agg_mode="token-mean",
                         policy_loss=PolicyLossConfig(loss_mode="clip_cov"))
    x = torch.zeros(1, 3)
    with pytest.raises(TrajInputError, match="positively homogeneous") as raised:
        weighted_policy_loss(config, log_prob=x, old_log_prob=x, advantages=x + 1, response_mask=x + 1,
                             loss_weight=torch.ones(1), dp_size=1, negative=x - 1)
    assert raised.value.field == "actor_rollout_ref.actor.policy_loss.loss_mode"


def test_start_up_checks_tree_grpo_and_the_weighting():
    from verl_traj.config import TrajConfigError
    from verl_traj.integration.startup.checks import check_adv_estimator

    check_adv_estimator(OmegaConf.create({"algorithm": {"adv_estimator": "tree_grpo"}, "traj": {"step_wise": True}}))
    with pytest.raises(TrajConfigError, match="traj.step_wise=true"):
        check_adv_estimator(OmegaConf.create({"algorithm": {"adv_estimator": "tree_grpo"}, "traj": {}}))
    with pytest.raises(TrajConfigError) as raised:
        TrajConfig(branch_weighting="per_path")
    assert raised.value.field == "traj.branch_weighting"
    with pytest.raises(TrajConfigError, match="would do nothing") as raised:
        check_adv_estimator(OmegaConf.create({"algorithm": {"adv_estimator": "grpo"},
                                              "traj": {"branch_weighting": "expanded"}}))
    assert raised.value.field == "traj.branch_weighting"


@pytest.mark.parametrize("estimator", ["grpo", "tree_grpo"])
@pytest.mark.parametrize("seed", range(3))
def test_paths_rows_train_as_expanded_with_every_path_forwarded(seed, estimator):
    """``traj.branch_weighting=paths`` (the peers' layout): every root-to-leaf path its own rows, each loss token
    copy with its path's leaf advantage; the rows hold every path's tokens; the loss and gradient are ``expanded``'s
    (the oracle above), so the per-token advantage sum over copies is the expanded parts' ``P + N``."""
    data, sessions, rewards = _planned(seed, estimator, "paths")
    want, adv = _reference(sessions, rewards, estimator)
    td = data.batch
    calls = _token_calls(sessions)
    real = (td[TRAJ_INDEX] >= 0)[:, None]
    copies = {}
    total = {}
    for b, t in (td["response_mask"].bool() & real).nonzero().tolist():
        key = calls[int(td["responses"][b, t])]
        copies[key] = copies.get(key, 0) + 1
        total[key] = total.get(key, 0.0) + float(td["advantages"][b, t])
    for key, (P, N, m) in want.items():
        tokens = len(sessions[key[0]].response[key[1]])
        assert copies[key] == m * tokens  # each call's tokens once per path through it
        assert total[key] == pytest.approx((P + N) * tokens, abs=1e-4)
    assert ADVANTAGES_NEGATIVE not in td.keys() and PATH_COPIES not in td.keys()
