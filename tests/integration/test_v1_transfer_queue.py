"""The v1 adapter against a real TransferQueue (Ray + TQ controller + storage, in this process): rows stored as
verl's v1 agent-loop worker stores them, the trainer built by its real ``__init__``
(:func:`~verl_traj.testing.trainers.ray_less_trainer`), ``TrajV1Mixin._balance_batch`` on verl's sync trainer class,
verl's own ``_compute_advantage`` and ``_update_actor`` / ``_update_critic``, and what the workers would pull.

Checks the dispatch order (rank-major, equal blocks), padding rows stored with the rows' schema (so every field stays
common to the batch and reaches the workers), the plan's fields on every row, whole trajectories and groups per
mini-batch, the loss weights (each mini-batch's real loss tokens weigh 1, from the final loss-token counts), and the
planned-update contract: the meta verl hands an update names every planned field, exactly what a worker fetches
(verl's ``tqbridge``), and a worker refuses a planned update that lacks one."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from verl_traj.config import TrajConfig
from verl_traj.core.errors import TrajInputError
from verl_traj.core.keys import (LOSS_WEIGHT, MICRO_BATCH_ID, MINI_BATCH_ID, PLANNED_FIELDS, ROW_FIELDS, ROW_LENGTH,
                                 planned_update_fields)
from verl_traj.integration.config.verl_config import PlanSettings
from verl_traj.testing.trainers import ray_less_trainer

pytestmark = pytest.mark.e2e

DP, MINI, N = 2, 2, 3  # 4 prompts x 3 sessions, mini-batches of 2 prompts, 2 ranks


@pytest.fixture(scope="module")
def tq():
    import ray
    import transfer_queue

    # address="local": never join a cluster some earlier job left recorded on the machine (see test_ray_start.py)
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    transfer_queue.init(OmegaConf.create({"backend": {"SimpleStorage": {"num_data_storage_units": 1,
                                                                        "total_storage_size": 10000}}}))
    yield transfer_queue
    transfer_queue.close()
    ray.shutdown()


def _row(rng, prefix: str, g: int, s: int, log_probs: bool) -> tuple[dict, dict]:
    p, r = int(rng.integers(3, 9)), int(rng.integers(2, 7))
    mask = torch.ones(r, dtype=torch.int64)
    mask[: int(rng.integers(0, r))] = 0
    ids = torch.randint(3, 50, (p + r,))
    row = {"prompts": ids[:p], "responses": ids[p:], "input_ids": ids, "response_mask": mask, "loss_mask": mask,
           "position_ids": torch.arange(p + r), "uid": f"{prefix}{g}", "session_id": s,
           "rm_scores": torch.nn.functional.one_hot(torch.tensor(r - 1), r).float() * float(rng.random()),
           "num_turns": 2}
    if log_probs:  # some tokens far off-policy: verl's token-level rejection zeroes them in response_mask
        rollout = -torch.rand(r)
        row.update(rollout_log_probs=rollout, old_log_probs=rollout + 0.5 * torch.from_numpy(rng.random(r) < 0.3))
    tag = {"status": "success", "prompt_len": p, "response_len": r, "seq_len": p + r, "global_steps": 1,
           "min_global_steps": 0, "max_global_steps": 0}
    return row, tag


def _store_rows(tq, rng, prefix="u", log_probs=False):
    """Agent-loop outputs of 4 prompts x 3 sessions x 1-3 steps, as ``AgentLoopWorkerTQ`` stores them."""
    from transfer_queue import KVBatchMeta
    from verl.utils.tensordict_utils import list_of_dict_to_tensordict

    keys, fields, tags = [], [], []
    for g in range(4):
        for s in range(N):
            for k in range(int(rng.integers(1, 4))):
                row, tag = _row(rng, prefix, g, s, log_probs)
                keys.append(f"{prefix}{g}_{s}_{k}")
                fields.append(row)
                tags.append(tag)
    order = rng.permutation(len(keys))  # the replay buffer returns rows in completion order
    keys, fields, tags = [keys[i] for i in order], [fields[i] for i in order], [tags[i] for i in order]
    tq.kv_batch_put(keys=keys, partition_id="train", fields=list_of_dict_to_tensordict(fields), tags=tags)
    return KVBatchMeta(keys=keys, tags=tags, partition_id="train")


def _trainer(traj: "dict | None" = None, **sections):
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

    config = OmegaConf.merge({"data": {"train_batch_size": 4, "max_response_length": 8},
                              "actor_rollout_ref": {"actor": {"ppo_mini_batch_size": MINI, "ppo_epochs": 1}}}, sections)
    return ray_less_trainer(config, TrajConfig(**(traj or {})),
                            plan=PlanSettings(max_tokens=24, cost="tokens", derived=True, pad_row_tokens=2),
                            dp=DP, v1_class=PPOTrainerSync)


def _fetch(tq, meta, *fields):
    return tq.kv_batch_get(keys=meta.keys, partition_id=meta.partition_id, select_fields=list(fields))


def _dense(t):
    return t.to_padded_tensor(0) if t.is_nested else t


def _worker_blocks(tq, out, dp: int = DP) -> list:
    """What each data-parallel rank's worker holds in a call on ``out`` (the planned meta carrying the call's
    ``extra_info``): verl's equal chunk of the rows, fetched from TransferQueue, with the call's non-tensor data, after
    the worker's own :func:`take_row_fields`."""
    from verl.utils import tensordict_utils as tu

    from verl_traj.integration.workers.planned_update import take_row_fields

    blocks = []
    for rank, chunk in enumerate(out.chunk(dp)):
        data = _fetch(tq, chunk, "input_ids", "response_mask")
        tu.assign_non_tensor(data, **chunk.extra_info)
        take_row_fields(data, rank)
        blocks.append(data)
    return blocks


def test_planned_batch_in_transfer_queue(tq):
    from verl_traj.integration.trainers.update_contract import ACTOR
    from verl_traj.integration.trainers.v1_updates import planned_update

    batch = _store_rows(tq, np.random.default_rng(0))
    tr, metrics = _trainer(), {}
    out = tr._balance_batch(batch, metrics)
    n = len(out)
    assert n % DP == 0 and metrics["traj_plan/split_groups"] == 0 and metrics["traj_plan/split_trajectories"] == 0
    assert set(out.keys) >= set(batch.keys) and n - len(batch) == metrics["traj_plan/padding_rows"]

    stored = tq.kv_batch_get(keys=out.keys, partition_id="train")  # every stored field: the plan wrote none
    assert {"input_ids", "response_mask", "rm_scores", "uid"} <= set(stored.keys())
    assert not {MINI_BATCH_ID, MICRO_BATCH_ID, LOSS_WEIGHT} & set(stored.keys())
    pad = torch.tensor([bool(t.get("is_padding")) for t in out.tags])
    facts = tr._step_facts.current
    assert torch.equal(pad, facts.is_padding)
    assert pad.any() and stored["input_ids"].offsets().diff()[pad].tolist() == [2] * int(pad.sum())
    assert torch.equal(facts.loss_tokens, _dense(stored["response_mask"]).sum(-1))  # counted at planning

    with planned_update(out, tr._step_facts, tr.spec, ACTOR, DP):  # the update call: each rank gets its own rows' fields
        blocks = _worker_blocks(tq, out)
    assert ROW_FIELDS not in out.extra_info  # for that call only
    mb = torch.cat([b[MINI_BATCH_ID] for b in blocks])
    assert torch.equal(mb, facts.mini_batch_id)
    for block in blocks:  # dispatch hands rank r the r-th block: mini-batches in order within it
        assert torch.equal(block[MINI_BATCH_ID], torch.sort(block[MINI_BATCH_ID]).values)
    for key_set in ({k.rsplit("_", 2)[0] for k in out.keys}, {k.rsplit("_", 1)[0] for k in out.keys}):
        for unit in key_set:  # groups, trajectories: one mini-batch each
            ids = {int(m) for k, m in zip(out.keys, mb) if k.startswith(unit + "_")}
            assert len(ids) == 1 or unit.startswith("pad")
    weight = torch.cat([b[LOSS_WEIGHT] for b in blocks]).double()
    loss_tokens = torch.cat([_dense(b["response_mask"]).sum(-1) for b in blocks]).double()
    per_mb = torch.zeros(int(mb.max()) + 1, dtype=torch.float64).index_add_(0, mb, weight * loss_tokens)
    torch.testing.assert_close(per_mb, torch.ones_like(per_mb))
    assert torch.all(weight[pad] == 0)


def test_the_plans_fields_are_put_once_a_step_whatever_the_calls(tq, monkeypatch):
    """Issue 55, item 4 at users' scale: every tree pass (old log-probs, reference, values) and every update of a step
    ship the plan's fields; they go into the object store once a step (``dp`` objects), an update adds only its own
    loss weights; the next step's plan puts its own."""
    import ray

    from verl_traj.integration.trainers.update_contract import ACTOR
    from verl_traj.integration.trainers.v1_updates import planned_pass, planned_update

    puts, put = [], ray.put
    monkeypatch.setattr(ray, "put", lambda value: puts.append(sorted(value)) or put(value))
    tr = _trainer({"prefix_tree": True})
    out = tr._balance_batch(_store_rows(tq, np.random.default_rng(6), prefix="once"), {})
    for _ in range(3):
        with planned_pass(out, tr._step_facts, {"prefix_tree": True}, DP):
            _worker_blocks(tq, out)
    for _ in range(2):
        with planned_update(out, tr._step_facts, tr.spec, ACTOR, DP):
            blocks = _worker_blocks(tq, out)
    plan = [p for p in puts if ROW_LENGTH in p]
    assert len(plan) == DP and len(puts) == DP + 2 * DP  # the plan's once, each update's loss weights
    assert all(LOSS_WEIGHT in b.keys() and "prefix_tree_segment" in b.keys() for b in blocks)
    tr._balance_batch(_store_rows(tq, np.random.default_rng(7), prefix="next"), {})
    with planned_pass(tr._balance_batch(_store_rows(tq, np.random.default_rng(8), prefix="nx"), {}), tr._step_facts,
                      {"prefix_tree": True}, DP):
        pass
    assert len([p for p in puts if ROW_LENGTH in p]) == 2 * DP  # a new plan: its own fields


def test_a_worker_given_another_ranks_fields_refuses_naming_the_field(tq):
    """verl cuts a call's meta into equal chunks in order; a worker whose rows are not the block shipped for its rank
    (another rank's, or a batch cut differently) raises naming ``traj_row_length``, before any fields are set."""
    from verl.utils import tensordict_utils as tu

    from verl_traj.core.errors import TrajInputError
    from verl_traj.integration.trainers.update_contract import ACTOR
    from verl_traj.integration.trainers.v1_updates import planned_update
    from verl_traj.integration.workers.planned_update import take_row_fields

    tr = _trainer()
    out = tr._balance_batch(_store_rows(tq, np.random.default_rng(0)), {})
    with planned_update(out, tr._step_facts, tr.spec, ACTOR, DP):
        chunks = out.chunk(DP)
        lengths = [torch.tensor([int(t["seq_len"]) for t in c.tags]) for c in chunks]
        other = next(r for r in range(1, DP) if not torch.equal(lengths[r], lengths[0]))
        data = _fetch(tq, chunks[other], "input_ids")
        tu.assign_non_tensor(data, **chunks[other].extra_info)
        with pytest.raises(TrajInputError) as raised:
            take_row_fields(data, 0)
    assert raised.value.field == ROW_LENGTH and MINI_BATCH_ID not in data.keys()


def test_a_step_of_several_local_updates_reads_every_plans_padding(tq):
    """Regression: with parameter_sync_step > 1 one global step plans several local updates and v1 hands
    _compute_metrics the step's whole batch (every update's rows); the metrics' real-row mask must come from every
    plan of the step, not from the last one (which raised on the keys of the earlier updates)."""
    first = _store_rows(tq, np.random.default_rng(1), prefix="a")
    second = _store_rows(tq, np.random.default_rng(2), prefix="b")
    tr = _trainer()
    outs = [tr._balance_batch(b, {}) for b in (first, second)]
    keys = outs[0].keys + outs[1].keys
    real = tr._step_padding.real_rows(keys)
    expected = [not k.startswith("pad") for k in keys]
    assert real.tolist() == expected and not all(expected)  # padding rows of both updates found
    with pytest.raises(RuntimeError, match="not planned"):
        tr._step_padding.real_rows(keys)  # forgotten after the step's metrics


def test_verls_step_metrics_are_handed_the_real_rows_only(tq, monkeypatch):
    """verl's v1 ``_compute_metrics`` drops rows tagged ``is_padding`` from most metrics but counts every row it is
    handed in its timing and throughput: it is handed the step's real rows (no patch of its metric functions)."""
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    tr = _trainer()
    out = tr._balance_batch(_store_rows(tq, np.random.default_rng(7), prefix="met"), {})
    handed = []
    monkeypatch.setattr(PPOTrainer, "_compute_metrics", lambda self, batch, *args: handed.append(batch))
    monkeypatch.setattr("verl_traj.integration.trainers.v1.trajectory_metrics", lambda batch, step: {})
    tr._compute_metrics(out, {}, {}, 1, 0)
    assert any(k.startswith("pad") for k in out.keys)
    assert handed[0].keys == [k for k in out.keys if not k.startswith("pad")]
    assert not any(tag.get("is_padding") for tag in handed[0].tags)


# ---- the planned-update contract, through verl's own update methods --------------------------------------------

def _as_a_worker_receives(meta):
    """The ``TensorDict`` a worker method gets for a ``KVBatchMeta`` argument: verl's ``tqbridge`` fetches exactly the
    fields ``meta.fields`` names (every stored field when None) and adds ``meta.extra_info`` as non-tensor data."""
    from verl.utils.transferqueue_utils import tqbridge

    @tqbridge()
    def receive(data):
        return {"data": data}  # not a TensorDict: tqbridge writes nothing back

    return receive(meta)["data"]


class _WorkerGroup:
    """The worker side of one update dispatch, in this process: verl's equal chunk of the meta per data-parallel
    rank, what verl's worker receives for it, then verl_traj's worker taking its rank's plan fields and checking the
    planned fields (:func:`~verl_traj.integration.workers.engine_workers.check_planned_update`)."""

    _dispatch_info = {"actor": list(range(DP)), "train": list(range(DP))}

    def __init__(self):
        self.received, self.checked = [], []

    def _run(self, meta) -> dict:
        from verl_traj.integration.workers.engine_workers import check_planned_update
        from verl_traj.integration.workers.planned_update import take_row_fields

        for rank, chunk in enumerate(meta.chunk(DP)):
            data = _as_a_worker_receives(chunk)
            take_row_fields(data, rank)
            self.received.append(data)
            self.checked.append(check_planned_update(data))
        return {"metrics": {"mfu": [0.0], "loss": [1.0]}}

    def update_actor(self, meta):  # actor_rollout_wg: returns the metrics
        return self._run(meta)

    def train_mini_batch(self, meta):  # critic_wg: returns a future of them
        out = self._run(meta)
        return type("Future", (), {"get": lambda self: out})()


def _as_verl_leaves_it(tq, out):
    """The meta verl's ``_compute_advantage`` hands the updates: what ``kv_batch_put`` of its write-back returns,
    listing the fields stored so far (not the update's own, written after it)."""
    from tensordict import TensorDict

    adv = torch.zeros(len(out), 1)
    meta = tq.kv_batch_put(keys=out.keys, partition_id=out.partition_id,
                           fields=TensorDict({"advantages": adv, "returns": adv}, batch_size=[len(out)]))
    assert meta.fields is not None and not {LOSS_WEIGHT, MINI_BATCH_ID} & set(meta.fields)  # none stored
    return meta


STEP_ROWS_GSPO = dict(traj={"step_wise": True, "ratio_scope": "trajectory"},
                      actor_rollout_ref={"actor": {"policy_loss": {"loss_mode": "gspo"}}})
CRITIC_UNION = dict(algorithm={"adv_estimator": "gae"}, critic={"ppo_mini_batch_size": 4})


@pytest.mark.parametrize("role, setup, ratio_groups", [("actor", {}, False), ("actor", STEP_ROWS_GSPO, True),
                                                       ("critic", CRITIC_UNION, False)])
def test_a_planned_update_reaches_the_worker_through_the_meta(tq, role, setup, ratio_groups):
    """Regression: the workers fetch exactly the fields the meta names, and the meta verl hands an update lists only
    the fields stored before it; verl_traj's planned fields (the plan's ids, ``loss_weight``, ``ratio_group``) are
    not stored but shipped with the call, so every rank's worker gets all of them for its own rows, and the update's
    contract keys leave with the call."""
    from verl_traj.core.keys import CRITIC_UNION_KEY

    tr = _trainer(**setup)
    rows = _store_rows(tq, np.random.default_rng(3), prefix=f"w{role}{int(ratio_groups)}")
    meta = _as_verl_leaves_it(tq, tr._balance_batch(rows, {}))
    worker = _WorkerGroup()
    if role == "actor":
        tr.actor_rollout_wg = worker
    else:
        tr.critic_wg = worker
    metrics = {}
    getattr(tr, f"_update_{role}")(meta, metrics)
    planned = planned_update_fields(ratio_groups)
    assert worker.checked == [planned] * DP and all(set(planned) <= set(d.keys()) for d in worker.received)
    assert (CRITIC_UNION_KEY in worker.received[0].keys()) == (role == "critic")  # critic steps on unions of 2
    assert PLANNED_FIELDS not in meta.extra_info and CRITIC_UNION_KEY not in meta.extra_info
    assert f"perf/mfu/{role}" in metrics


@pytest.mark.parametrize("field", planned_update_fields(ratio_groups=True))
def test_a_planned_field_that_does_not_reach_the_worker_is_refused(tq, field):
    """Each planned field in turn missing from what a worker holds (a subclass that rebuilds the call's data): the
    worker refuses the update, naming the field; with every field there the check passes."""
    from verl_traj.integration.trainers.update_contract import ACTOR
    from verl_traj.integration.trainers.v1_updates import planned_update
    from verl_traj.integration.workers.engine_workers import check_planned_update
    from verl_traj.integration.workers.planned_update import take_row_fields

    tr = _trainer(**STEP_ROWS_GSPO)
    rows = _store_rows(tq, np.random.default_rng(4), prefix=f"m{field.replace('_', '')}")
    meta = _as_verl_leaves_it(tq, tr._balance_batch(rows, {}))
    with planned_update(meta, tr._step_facts, tr.spec, ACTOR, DP):
        chunk = meta.chunk(DP)[0]
        data, again = _as_a_worker_receives(chunk), _as_a_worker_receives(chunk)
    take_row_fields(data, 0)
    assert check_planned_update(data) == planned_update_fields(ratio_groups=True)
    take_row_fields(again, 0)
    again.pop(field)
    with pytest.raises(TrajInputError, match=f"lacks field '{field}'") as err:
        check_planned_update(again)
    assert err.value.field == field


def test_loss_weights_come_from_the_final_loss_token_counts(tq, monkeypatch):
    """Item 6: the loss weights need each row's loss-token count, not the ``[B, R]`` mask. The counts are taken at
    planning and again inside verl's own ``_compute_advantage``, after its rollout correction rejected tokens; the
    update then fetches no mask, and its weights equal the mask-based weights of the final mask."""
    import transfer_queue

    tr = _trainer(algorithm={"rollout_correction": {"rollout_rs": "token_k1", "rollout_rs_threshold": "0.98_1.02"}})
    out = tr._balance_batch(_store_rows(tq, np.random.default_rng(5), prefix="c", log_probs=True), {})
    planned = tr._step_facts.current
    planned_counts = planned.loss_tokens.clone()
    meta = tr._compute_advantage(out, {})
    final = _dense(_fetch(tq, meta, "response_mask")["response_mask"])
    facts = tr._step_facts.current  # the advantage step's: a new value, the planned one unchanged (issue 54, item 3)
    assert facts is not planned and torch.equal(planned.loss_tokens, planned_counts)
    assert torch.equal(facts.loss_tokens, final.sum(-1)) and not torch.equal(planned_counts, facts.loss_tokens)

    reads = []
    verl_get = transfer_queue.kv_batch_get
    monkeypatch.setattr(transfer_queue, "kv_batch_get",
                        lambda **kw: reads.append(kw.get("select_fields")) or verl_get(**kw))
    tr.actor_rollout_wg = worker = _WorkerGroup()
    tr._update_actor(meta, {})
    assert not any("response_mask" in (fields or ["response_mask"]) for fields in reads)  # no mask pulled
    weights = torch.cat([d[LOSS_WEIGHT] for d in worker.received])
    expected = tr.spec.actor_loss.weights(final, facts.mini_batch_id, facts.traj_index, facts.is_padding)
    torch.testing.assert_close(weights, expected)


def test_the_actor_update_says_whether_its_old_log_probs_came_from_its_starting_parameters(tq):
    """GSPO's trajectory pre-pass may skip an update's first optimizer step only where the old log-probs are the
    starting parameters': verl's base ``_compute_old_log_prob`` recomputes them before every local update (sync,
    colocate_async); a mode that overrides it (separate_async reuses the first local step's weights) only on its first
    local step. The flag reaches the worker with the update."""
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

    from verl.trainer.ppo.v1.trainer_separate_async import PPOTrainerSeparateAsync

    from verl_traj.core.keys import OLD_LOG_PROBS_AT_START
    from verl_traj.integration.trainers.update_contract import ACTOR, update_contract
    from verl_traj.integration.trainers.v1 import reuses_old_log_probs, traj_trainer_class

    class Reuses(PPOTrainerSync):  # as verl's separate_async: its own _compute_old_log_prob
        def _compute_old_log_prob(self, batch, metrics):
            return batch

    assert not reuses_old_log_probs(traj_trainer_class(PPOTrainerSync))
    assert reuses_old_log_probs(traj_trainer_class(Reuses))
    assert reuses_old_log_probs(traj_trainer_class(PPOTrainerSeparateAsync))
    tr = _trainer(**STEP_ROWS_GSPO)
    assert not tr.spec.reuses_old_log_probs  # derived once, in __init__, from the trainer's class
    reusing = dataclasses.replace(tr.spec, reuses_old_log_probs=True)
    rows = torch.zeros(2, dtype=torch.long), torch.zeros(2, dtype=torch.bool)
    for spec, step, at_start in ((tr.spec, 0, True), (tr.spec, 1, True), (reusing, 0, True), (reusing, 1, False)):
        contract = update_contract(spec, ACTOR, torch.ones(2), *rows, all_atomic=False, local_step=step)
        assert contract.markers[OLD_LOG_PROBS_AT_START] is at_start
    meta = _as_verl_leaves_it(tq, tr._balance_batch(_store_rows(tq, np.random.default_rng(6), prefix="olp"), {}))
    worker = _WorkerGroup()
    tr.actor_rollout_wg = worker
    tr._update_actor(meta, {})
    assert bool(worker.received[0][OLD_LOG_PROBS_AT_START]) and OLD_LOG_PROBS_AT_START not in meta.extra_info
    # a reusing mode's later local step, through the trainer's own path (the same planned rows, updated again)
    tr.spec, tr.local_trigger_step = reusing, 1
    tr._update_actor(meta, {})
    assert not bool(worker.received[-1][OLD_LOG_PROBS_AT_START])


def test_read_rows_gives_each_rows_ids_in_the_asked_order(tq):
    """The tree planner's rows from a real TransferQueue (rows put in batches of mixed and of one length; this
    TransferQueue returns them jagged either way), all of them and a subset in the asked order. The ``[K, L]`` form
    verl's ``list_of_dict_to_tensordict`` gives rows of one length is read by test_v1_kl_in_reward's store."""
    from transfer_queue import KVBatchMeta
    from verl.utils.tensordict_utils import list_of_dict_to_tensordict

    from verl_traj.integration.trainers.v1_planning import read_rows

    rows = [("ro_a", [5, 6, 7]), ("ro_b", [8, 9]), ("ro_c", [1, 2]), ("ro_d", [3, 4])]
    for batch in (rows[:2], rows[2:]):  # one put of mixed lengths, one of one length (as the padding rows are put)
        tq.kv_batch_put(keys=[k for k, _ in batch], partition_id="train",
                        fields=list_of_dict_to_tensordict([{"input_ids": torch.tensor(v)} for _, v in batch]),
                        tags=[{"status": "success"}] * len(batch))
    meta = KVBatchMeta(keys=[k for k, _ in rows], tags=[{}] * len(rows), partition_id="train")
    assert [r.tolist() for r in read_rows(meta).as_list()] == [v for _, v in rows]
    assert [r.tolist() for r in read_rows(meta, ["ro_d", "ro_c"]).as_list()] == [[3, 4], [1, 2]]
    tq.kv_clear(keys=[k for k, _ in rows], partition_id="train")


def test_the_plan_facts_are_checked_once_per_batch_and_a_reordered_batch_is_refused(tq, monkeypatch):
    """Issue 54, item 3: the batch's keys are checked against the plan's facts once (at the batch's first use after
    planning), not at every step of the update; a batch whose rows were reordered since is refused at its first use."""
    from verl_traj.integration.trainers.v1_plan_facts import PlanFacts

    tr = _trainer()
    out = tr._balance_batch(_store_rows(tq, np.random.default_rng(6), prefix="d"), {})
    checks, check = [], PlanFacts.check
    monkeypatch.setattr(PlanFacts, "check", lambda self, keys: checks.append(len(keys)) or check(self, keys))
    meta = tr._compute_advantage(out, {})
    for _ in range(3):  # the critic's and the actor's updates read the same facts
        assert tr._step_facts.of(meta) is tr._step_facts.current
    assert len(checks) == 1 + (meta.keys is not out.keys), checks
    reordered = dataclasses.replace(meta, keys=list(reversed(meta.keys)))
    with pytest.raises(RuntimeError, match="not the ones _balance_batch planned"):
        tr._step_facts.of(reordered)


def test_rows_written_with_their_facts_are_planned_as_trees_without_a_per_token_fetch(tq, monkeypatch):
    """Issue 55, item 4: the agent loop records each row's loss tokens and prefix block hashes in its tags
    (``row_fact_tags``), so a prefix-tree plan fetches neither ``response_mask`` nor ``input_ids`` (only verl's
    padding template row); the trees it stores are valid for the real rows (no mismatch in any micro-batch's device
    tree) and the loss tokens are the rows' own. A row written without the tags is fetched, alone."""
    import transfer_queue

    from verl_traj.core.keys import TREE_SEGMENT, TREE_SIZE
    from verl_traj.core.rollout.row_tags import row_fact_tags
    from verl_traj.core.trees.tree_facts import segment_tree_index, tree_from_facts

    rng = np.random.default_rng(3)
    batch = _store_rows(tq, rng, prefix="hf")
    stored = _fetch(tq, batch, "input_ids", "response_mask")
    ids = [r.tolist() for r in stored["input_ids"].unbind()]
    facts = row_fact_tags(ids, [m.tolist() for m in stored["response_mask"].unbind()])
    facts[0] = {}  # one row written without them (another agent loop)
    tq.kv_batch_put(keys=batch.keys, partition_id="train", tags=facts)
    batch.tags = [{**t, **f} for t, f in zip(batch.tags, facts)]
    fetched = []
    get = transfer_queue.kv_batch_get

    def counted(keys, partition_id, select_fields=None):
        fetched.append((len(keys), tuple(select_fields or ("*",))))
        return get(keys=keys, partition_id=partition_id, select_fields=select_fields)

    monkeypatch.setattr(transfer_queue, "kv_batch_get", counted)
    tr = _trainer({"prefix_tree": True})
    out = tr._balance_batch(batch, {})
    monkeypatch.setattr(transfer_queue, "kv_batch_get", get)
    assert sorted(fetched) == sorted([(1, ("response_mask",)), (1, ("input_ids",)), (1, ("*",))]), fetched
    from verl_traj.core.rollout.row_tags import PREFIX_HASH_TAG

    assert not [t for t in out.tags if PREFIX_HASH_TAG in t]  # read by planning, not carried to every worker call
    assert torch.equal(tr._step_facts.current.loss_tokens[:len(batch)].sort().values,
                       _dense(_fetch(tq, out, "response_mask")["response_mask"]).sum(-1)[:len(batch)].sort().values)
    rows = _fetch(tq, out, "input_ids")
    f = tr._step_facts.current.row_fields  # what the tree passes ship to the workers
    n = len(out)
    part = (torch.arange(n) // (n // DP)) * 1000 + f[MINI_BATCH_ID] * 100 + f[MICRO_BATCH_ID]
    for key in part.unique().tolist():
        members = (part == key).nonzero().flatten().tolist()
        row_ids = [rows["input_ids"][i] for i in members]
        lengths = torch.tensor([len(r) for r in row_ids])
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
        index = segment_tree_index(offsets, f[TREE_SEGMENT][members], int(offsets[-1]))
        tree = tree_from_facts(torch.cat(row_ids), torch.cat([torch.arange(len(r)) for r in row_ids]), offsets,
                               index, int(f[TREE_SIZE][members[0]]))
        assert {k: int(v) for k, v in tree.checks.items()} == {"tree_index": 0, "position_ids": 0}
