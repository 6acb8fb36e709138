"""verl_traj's group policies on verl's v1 pieces (:mod:`verl_traj.integration.async_modes.v1_staleness`,
``v1_failures``):

* the version of every generate attempt, through verl's own ``FullyAsyncLLMServerClient`` resume loop (a partial
  rollout aborted at a weight sync and resumed under the next version), with only the Ray transport replaced;
* verl's ``ReplayBufferAsync`` with verl_traj's group policies over a real TransferQueue (Ray + TQ in this process):
  ``drop`` evicts a group with one trajectory over the bound, whole, and verl refills it; ``defer`` holds sampling
  until a running group that would pass the bound at the next step finishes, then trains it; both counted;
* a rollout that failed with a verl_traj refusal (the loop recorded something wrong) stops training with its message
  instead of being dropped and refilled for ever.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from omegaconf import OmegaConf

from verl.trainer.ppo.v1.replay_buffer import ReplayBufferAsync
from verl.workers.rollout.llm_server import FullyAsyncLLMServerClient, LLMServerClient
from verl.workers.rollout.replica import TokenOutput

from verl_traj.config import TrajConfig, TrajConfigError
from verl_traj.core.errors import TrajInputError
from verl_traj.core.rollout.session_ledger import LENGTH_TAG, VERSION_TOKENS_TAG, session_ledger
from verl_traj.integration.async_modes.v1_failures import (POLL_COST_SHARE, FailedGroupPolicy, group_policy_class,
                                                           poll_interval, with_group_policies)
from verl_traj.integration.async_modes.v1_staleness import (StaleGroupPolicy, TrajFullyAsyncLLMServerClient,
                                                            TrajLLMServerClient, check_recording,
                                                            recording_client_class)

from tests.integration.test_v1_transfer_queue import tq  # noqa: F401  (the module's Ray + TransferQueue)

pytestmark = pytest.mark.e2e


class _Remote:
    def __init__(self, fn):
        self.remote = fn


class _Server:
    """A rollout server that is aborted once by a weight sync: 5 tokens under version 3, then 7 under version 4."""

    def __init__(self):
        self.script = [(5, "aborted", 3), (7, "completed", 4)]
        self.generate = _Remote(self._generate)

    async def _generate(self, **kwargs):
        n, reason, version = self.script.pop(0)
        return TokenOutput(token_ids=list(range(n)), log_probs=[-0.1] * n, stop_reason=reason,
                           extra_fields={"global_steps": version})


class _Balancer:
    def __init__(self, server):
        async def fields():
            return []

        async def acquire(**_):
            return "s0", server

        self.require_acquire_fields = _Remote(fields)
        self.require_release_fields = _Remote(fields)
        self.acquire_server = _Remote(acquire)
        self.release_server = _Remote(lambda **_: None)


def test_each_attempt_of_a_resumed_partial_rollout_is_recorded_with_its_version():
    config = OmegaConf.create({"actor_rollout_ref": {"rollout": {"name": "vllm", "response_length": 32}}})
    client = recording_client_class(FullyAsyncLLMServerClient)(config, load_balancer_handle=_Balancer(_Server()))

    async def session():
        with session_ledger() as ledger:
            out = await client.generate("req", prompt_ids=[1, 2, 3], sampling_params={"temperature": 1.0})
            return out, ledger.tags()

    out, versions = asyncio.run(session())
    assert (out.extra_fields["min_global_steps"], out.extra_fields["max_global_steps"]) == (3, 4)  # verl's own tags
    assert len(out.token_ids) == 12
    assert versions[VERSION_TOKENS_TAG] == [[3, 5], [4, 7]]  # what verl's min/max cannot say: 5 old, 7 new
    assert versions[LENGTH_TAG] == [12, 1]  # one call of two attempts (traj_bias/*)
    assert type(client).__mro__.index(FullyAsyncLLMServerClient) < [c.__name__ for c in type(client).__mro__].index(
        "AttemptRecorder")  # below verl's resume loop, so each attempt passes through it


def test_verls_plain_client_of_the_sync_mode_records_its_one_attempt_per_call():
    config = OmegaConf.create({"actor_rollout_ref": {"rollout": {"name": "vllm", "response_length": 32}}})
    server = _Server()
    server.script = [(6, "completed", 2)]
    client = recording_client_class(None)(config, load_balancer_handle=_Balancer(server))
    assert type(client) is TrajLLMServerClient and recording_client_class(TrajLLMServerClient) is TrajLLMServerClient
    check_recording(client, 1.0)
    plain = LLMServerClient(config, load_balancer_handle=_Balancer(server))  # a client verl_traj's trainer did not build
    with pytest.raises(TrajConfigError, match="traj.max_staleness and the traj_bias") as err:
        check_recording(plain, 1.0)
    assert err.value.field == "traj.max_staleness"
    with pytest.raises(TrajConfigError, match=r"traj_bias/\* and traj_version.*Fix: let the trainer") as err:
        check_recording(plain, None)  # no bound: the metrics every step need it all the same
    assert err.value.field == "get_llm_client"
    with pytest.raises(TrajConfigError, match="LLMServerClient"):
        recording_client_class(dict)

    async def session():
        with session_ledger() as ledger:
            await client.generate("req", prompt_ids=[1], sampling_params={})
            return ledger.tags()

    assert asyncio.run(session()) == {VERSION_TOKENS_TAG: [[2, 6]], LENGTH_TAG: [6, 1]}


# ---- the replay buffer over a real TransferQueue -------------------------------------------------------------------

def _put_group(tq, uid: str, dispatched: int, ledgers: list, status: str = "finished") -> None:
    """A prompt key as verl's agent-loop worker leaves it, and one row per session with its version tokens and its
    length (tokens, one call per version)."""
    for session, ledger in enumerate(ledgers):
        tq.kv_put(key=f"{uid}_{session}_0", partition_id="train",
                  tag={"status": "success", "global_steps": dispatched, VERSION_TOKENS_TAG: ledger,
                       LENGTH_TAG: [sum(n for _, n in ledger), len(ledger)]})
    tq.kv_put(key=uid, partition_id="train", tag={"is_prompt": True, "status": status, "global_steps": dispatched})


def _buffer(tq, policy: str, refill, failed_groups: str = "drop", group_size: int = 4):
    buffer = group_policy_class(ReplayBufferAsync)(trainer_mode="colocate_async", trainer_config=OmegaConf.create({}),
                               max_off_policy_threshold=None, max_off_policy_strategy="drop",
                               sampler_kwargs=OmegaConf.create({}), refill_fn=refill)
    return with_group_policies(buffer, TrajConfig(max_staleness=1.0, stale_groups=policy, failed_groups=failed_groups,
                                                  replay_poll_s=0.05), group_size)


def test_the_buffer_polls_at_traj_replay_poll_s():
    """verl builds its replay buffer with poll_interval=2.0 (not in its config): sampling then waits for the step's
    groups in 2-second ticks. verl_traj's buffer polls at ``traj.replay_poll_s``."""
    def verls() -> ReplayBufferAsync:
        return ReplayBufferAsync(trainer_mode="colocate_async", trainer_config=OmegaConf.create({}),
                                 max_off_policy_threshold=None, max_off_policy_strategy="drop",
                                 sampler_kwargs=OmegaConf.create({}))

    def ours() -> ReplayBufferAsync:
        return group_policy_class(ReplayBufferAsync)(
            trainer_mode="colocate_async", trainer_config=OmegaConf.create({}), max_off_policy_threshold=None,
            max_off_policy_strategy="drop", sampler_kwargs=OmegaConf.create({}))

    assert verls().poll_interval == 2.0
    assert with_group_policies(ours(), TrajConfig(), 4).poll_interval == TrajConfig.replay_poll_s == 2.0
    assert with_group_policies(ours(), TrajConfig(replay_poll_s=0.05), 4).poll_interval == 0.05
    with pytest.raises(RuntimeError, match="group_policy_class"):  # verl's buffer is never retyped
        with_group_policies(verls(), TrajConfig(), 4)


@pytest.mark.parametrize("mode", ["sync", "colocate_async"])
def test_verl_builds_the_buffer_and_the_client_as_verl_trajs_classes_and_its_names_come_back(mode):
    """Through verl's own ``_build_replay_buffer`` and ``get_llm_client`` (the trainer's real ``__init__``): the
    buffer and the agent loops' client are built as verl_traj's subclasses (no live object retyped), and the names
    swapped for the call are verl's again after it."""
    from verl.trainer.ppo.v1 import trainer_base
    from verl.trainer.ppo.v1.trainer_colocate_async import PPOTrainerColocateAsync
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

    from verl_traj.testing.trainers import ray_less_trainer

    names = {n: getattr(trainer_base, n) for n in ("ReplayBuffer", "ReplayBufferAsync", "load_extern_type")}
    cls = PPOTrainerSync if mode == "sync" else PPOTrainerColocateAsync
    tr = ray_less_trainer({"trainer": {"v1": {"trainer_mode": mode}}}, TrajConfig(), v1_class=cls)
    assert isinstance(tr.replay_buffer, FailedGroupPolicy)
    assert isinstance(tr.replay_buffer, StaleGroupPolicy) == (mode != "sync")
    assert {n: getattr(trainer_base, n) for n in names} == names
    stock = ray_less_trainer({"trainer": {"v1": {"trainer_mode": mode}}}, TrajConfig(enable=False), v1_class=cls)
    built_with = ("train_batch_size", "gen_batch_size", "max_inflight_gen_batches", "filter_groups_metric",
                  "sync_refill_failed_groups", "max_off_policy_threshold")  # verl's arguments (its sync branch too)
    assert {k: getattr(tr.replay_buffer, k) for k in built_with} == {k: getattr(stock.replay_buffer, k) for k in built_with}
    assert type(stock.replay_buffer) is (trainer_base.ReplayBuffer if mode == "sync" else trainer_base.ReplayBufferAsync)

    class Manager:  # verl's LLMServerManager.get_client, as the trainer calls it
        def get_client(self, client_cls=None, **kwargs):
            return client_cls or LLMServerClient

    tr.llm_server_manager = Manager()
    built = tr.get_llm_client()
    assert built is (TrajLLMServerClient if mode == "sync" else TrajFullyAsyncLLMServerClient)
    assert "get_client" not in vars(tr.llm_server_manager)


def test_separate_async_builds_its_standalone_pools_client_as_the_recording_class():
    """``separate_async`` asks its standalone rollout pool's manager for the client (verl's ``get_llm_client``)."""
    from verl.trainer.ppo.v1.trainer_separate_async import PPOTrainerSeparateAsync

    from verl_traj.integration.trainers.v1 import traj_trainer_class

    class Manager:
        def get_client(self, client_cls=None, **kwargs):
            return client_cls or LLMServerClient

    tr = object.__new__(traj_trainer_class(PPOTrainerSeparateAsync))
    tr.traj_config, tr.standalone_server_manager = TrajConfig(), Manager()
    assert tr.get_llm_client() is TrajFullyAsyncLLMServerClient
    assert "get_client" not in vars(tr.standalone_server_manager)


def test_a_slow_poll_waits_longer():
    """A poll reads every key's tag: where it takes long (thousands of sessions), the wait grows so that polling
    costs at most POLL_COST_SHARE of it; never below traj.replay_poll_s."""
    assert poll_interval(0.25, 0.001) == 0.25
    assert poll_interval(0.25, 0.4) == pytest.approx(0.4 * (1 - POLL_COST_SHARE) / POLL_COST_SHARE)


def test_the_buffer_times_its_own_polls(tq):  # noqa: F811
    """Over a real TransferQueue, a metadata read of the wrapped buffer sets the next wait from its own duration."""
    _clear(tq)
    _put_group(tq, "slow", 1, [[[0, 4]]] * 2)
    buffer = _buffer(tq, "drop", refill=lambda n: None)
    buffer.replay_poll_s = 1e-9  # below any real read: the wait is the read's own cost x 4
    buffer.poll_interval = 123.0  # what the read must replace
    buffer._sync_metadata_from_transfer_queue()
    assert 1e-9 < buffer.poll_interval < 5.0


def _clear(tq) -> None:
    keys = list((tq.kv_list(partition_id="train") or {}).get("train", {}))
    if keys:
        tq.kv_clear(partition_id="train", keys=keys)


def test_drop_evicts_the_whole_group_over_the_bound_and_verl_refills_it(tq):  # noqa: F811
    _clear(tq)
    # at step 6 the trained policy is version 5: one trajectory of "stale" is 1.5 versions behind, its sibling 0
    _put_group(tq, "fresh", 5, [[[4, 10], [5, 10]], [[5, 8]]])
    _put_group(tq, "stale", 4, [[[3, 10], [4, 10]], [[5, 8]]])
    refills = []
    buffer = _buffer(tq, "drop", lambda k: (refills.append(k), _put_group(tq, "refill", 6, [[[5, 6]]] * 2)))
    batch, metrics = buffer.sample(global_steps=6, partition_id="train", batch_size=2)
    assert sorted({key.split("_")[0] for key in batch.keys}) == ["fresh", "refill"]
    assert refills == [1] and metrics["traj_staleness/groups_dropped_total"] == 1.0
    left = (tq.kv_list(partition_id="train") or {}).get("train", {})
    assert not any(key.startswith("stale") for key in left)  # both sessions gone, never half the group
    assert metrics["traj_staleness/groups_deferred_total"] == 0.0
    cut = buffer.cut_lengths.take()  # traj_bias/*: the dropped group's two trajectories, as long as they were
    assert sorted(cut["stale"].tokens.tolist()) == [8, 20] and sorted(cut["stale"].turns.tolist()) == [1, 2]
    assert buffer.cut_lengths.take() == {}


def test_correct_trains_the_group_over_the_bound_and_counts_it(tq):  # noqa: F811
    """traj.stale_groups=correct: the group ``drop`` evicts (one trajectory 1.5 versions behind) trains, whole,
    without a refill or a wait, and is counted; nothing is cut, so there is no length bias to report."""
    _clear(tq)
    _put_group(tq, "fresh", 5, [[[4, 10], [5, 10]], [[5, 8]]])
    _put_group(tq, "stale", 4, [[[3, 10], [4, 10]], [[5, 8]]])
    buffer = _buffer(tq, "correct", lambda k: pytest.fail(f"refilled {k}: correct drops nothing"))
    batch, metrics = buffer.sample(global_steps=6, partition_id="train", batch_size=2)
    assert sorted(batch.keys) == ["fresh_0_0", "fresh_1_0", "stale_0_0", "stale_1_0"]
    assert metrics["traj_staleness/groups_corrected_total"] == 1.0
    assert metrics["traj_staleness/groups_dropped_total"] == 0.0 and metrics["traj_staleness/groups_deferred_total"] == 0
    assert buffer.cut_lengths.take() == {}
    _clear(tq)


def test_a_failed_group_kept_for_its_survivors_is_still_bounded(tq):  # noqa: F811
    """traj.failed_groups=keep_survivors keeps a failed group that has finished sessions; a stale one is dropped all
    the same (the bound holds for every group that could train)."""
    from verl_traj.core.rollout.failures import failure_tag

    _clear(tq)
    _put_group(tq, "fresh", 5, [[[5, 8]]])
    _put_group(tq, "survivor", 3, [[[3, 10]], [[4, 10]]], status="failure")  # session 0: 2 versions behind
    tq.kv_put(key="survivor", partition_id="train", tag=failure_tag(2, RuntimeError("sandbox died"), [37, 3]))
    buffer = _buffer(tq, "drop", lambda k: _put_group(tq, "refill", 6, [[[5, 6]]]), failed_groups="keep_survivors")
    batch, metrics = buffer.sample(global_steps=6, partition_id="train", batch_size=2)
    assert sorted({key.split("_")[0] for key in batch.keys}) == ["fresh", "refill"]
    assert metrics["traj_staleness/groups_dropped_total"] == 1.0
    cut = buffer.cut_lengths.take()  # the finished sessions as stale, the failed one with its length when it failed
    assert cut["stale"].tokens.tolist() == [10, 10] and cut["failed"].tokens.tolist() == [37]
    assert cut["failed"].turns.tolist() == [3]
    _clear(tq)


@pytest.mark.parametrize("finished, group_size, kept", [(1, 4, False), (2, 4, True), (3, 4, True), (1, 2, False)])
def test_keep_survivors_trains_a_failed_group_on_two_or_more_survivors(tq, finished, group_size, kept):  # noqa: F811
    """One survivor has no baseline but itself (verl's estimators would give it its raw score as its advantage): its
    group is dropped and refilled like a group with none; two or more train, exactly the finished sessions."""
    from verl_traj.core.rollout.failures import failure_tag

    _clear(tq)
    _put_group(tq, "ragged", 5, [[[5, 4 + i]] for i in range(finished)], status="failure")
    for session in range(finished, group_size):
        tq.kv_put(key="ragged", partition_id="train", tag=failure_tag(session, RuntimeError("tool crashed"), [9, 2]))
    refills = []
    buffer = _buffer(tq, "drop", lambda k: (refills.append(k), _put_group(tq, "refill", 6, [[[5, 6]]] * group_size)),
                     failed_groups="keep_survivors", group_size=group_size)
    batch, metrics = buffer.sample(global_steps=6, partition_id="train", batch_size=1)
    assert sorted(batch.keys) == ([f"ragged_{i}_0" for i in range(finished)] if kept
                                  else [f"refill_{i}_0" for i in range(group_size)])
    assert metrics["traj_failure/groups_kept_total" if kept else "traj_failure/groups_dropped_total"] == 1.0
    assert refills == ([] if kept else [1])
    cut = buffer.cut_lengths.take()  # traj_bias/*: the failed sessions, and a dropped group's survivor
    assert cut["failed"].tokens.tolist() == [9] * (group_size - finished)
    assert ("failed_group" in cut) == (not kept)
    _clear(tq)


def test_defer_waits_for_a_running_group_that_would_pass_the_bound_and_then_trains_it(tq):  # noqa: F811
    _clear(tq)
    _put_group(tq, "ready", 5, [[[5, 9]]])
    tq.kv_put(key="slow", partition_id="train", tag={"is_prompt": True, "status": "running", "global_steps": 4})
    tq.kv_put(key="new", partition_id="train", tag={"is_prompt": True, "status": "running", "global_steps": 6})
    finisher = threading.Timer(0.6, lambda: _put_group(tq, "slow", 4, [[[4, 3], [5, 6]]]))
    finisher.start()
    buffer = _buffer(tq, "defer", refill=lambda k: None)
    start = time.perf_counter()
    batch, metrics = buffer.sample(global_steps=6, partition_id="train", batch_size=1)
    finisher.join()
    # dispatched at step 4, "slow" would be 6 - 4 + 1 = 3 versions behind at step 7: the trainer waited for it; "new"
    # (dispatched at step 6) held nothing. verl takes the oldest sampleable group first: "slow", within the bound
    assert {key.split("_")[0] for key in batch.keys} == {"slow"}
    assert time.perf_counter() - start >= 0.5
    assert metrics["traj_staleness/groups_deferred_total"] == 1.0
    assert 0.4 < metrics["traj_staleness/defer_wait_s_total"] < 30
    assert metrics["traj_staleness/groups_dropped_total"] == 0.0
    _clear(tq)


def test_a_verl_traj_refusal_in_a_rollout_stops_training_with_its_message_instead_of_refilling(tq):  # noqa: F811
    """A loop that records something wrong fails every rollout the same way: dropping and refilling its groups would
    loop for ever. The refusal's message, tagged by the failed session, is raised in the trainer."""
    from verl_traj.core.rollout.failures import failure_tag
    from verl_traj.stepwise.expand import StepExpansionError

    _clear(tq)
    error = StepExpansionError("step_rewards returned 2 rewards for 3 LLM calls", field="step_rewards",
                               every_rollout=True)
    tq.kv_put(key="broken", partition_id="train",
              tag={"is_prompt": True, "status": "failure", "global_steps": 6, **failure_tag(0, error)})
    refills = []
    buffer = _buffer(tq, "drop", refill=refills.append)
    with pytest.raises(TrajInputError, match=r"group 'broken'.*StepExpansionError.*2 rewards for 3 LLM calls"):
        buffer.sample(global_steps=6, partition_id="train", batch_size=1)
    assert refills == []
    _clear(tq)


def test_a_failed_session_leaves_its_length_on_its_prompt_key(tq):  # noqa: F811
    """run_session: a session that raises tags its group with why and with how long it had run (tokens generated,
    LLM calls), so dropping it is counted in traj_bias/* with its length."""
    from verl_traj.core.rollout.failures import CUT_LENGTH_PREFIX, FAILURE_TAG_PREFIX
    from verl_traj.core.rollout.session_ledger import current_ledger
    from verl_traj.integration.async_modes.v1_failures import run_session

    _clear(tq)
    tq.kv_put(key="cut", partition_id="train", tag={"is_prompt": True, "status": "running", "global_steps": 1})

    async def session():
        ledger = current_ledger()
        ledger.attempts += [(1, 30), (2, 12)]
        ledger.calls += 2
        await asyncio.sleep(10)

    async def run():
        with session_ledger():
            await run_session(session(), 0.05, "cut", 3)

    with pytest.raises((asyncio.TimeoutError, TimeoutError)):
        asyncio.run(run())
    tag = (tq.kv_list(partition_id="train") or {}).get("train", {})["cut"]
    assert tag[f"{FAILURE_TAG_PREFIX}3"] == "timeout" and tag[f"{CUT_LENGTH_PREFIX}3"] == [42, 2]
    _clear(tq)


def _correct(tq, refill, fallback: str = "defer", max_lag: int = 2):
    buffer = group_policy_class(ReplayBufferAsync)(trainer_mode="colocate_async", trainer_config=OmegaConf.create({}),
                               max_off_policy_threshold=None, max_off_policy_strategy="drop",
                               sampler_kwargs=OmegaConf.create({}), refill_fn=refill)
    return with_group_policies(buffer, TrajConfig(max_staleness=1.0, stale_groups="correct", max_lag=max_lag,
                                                  correct_fallback=fallback, replay_poll_s=0.05), 2)


def test_correct_trains_within_the_cap_and_hands_a_group_past_it_to_the_fallback(tq):  # noqa: F811
    """Issue 53: ``correct`` is a bound. At step 6 (trained version 5), with ``max_lag=2``: "stale" (1.5 versions
    behind on average, oldest token 2 behind) trains corrected; "partial" (token staleness 0.3, but one token 3
    versions old) is past the cap whatever its mean, and is dropped and refilled."""
    _clear(tq)
    _put_group(tq, "stale", 4, [[[3, 10], [4, 10]], [[5, 8]]])
    _put_group(tq, "partial", 2, [[[2, 1], [5, 9]], [[5, 8]]])
    refills = []
    buffer = _correct(tq, lambda k: (refills.append(k), _put_group(tq, "refill", 6, [[[5, 6]]] * 2)), fallback="drop")
    batch, metrics = buffer.sample(global_steps=6, partition_id="train", batch_size=2)
    assert sorted({key.split("_")[0] for key in batch.keys}) == ["refill", "stale"]
    assert refills == [1]
    assert metrics["traj_staleness/groups_corrected_total"] == 1.0
    assert metrics["traj_offpolicy/groups_past_cap_dropped_total"] == 1.0
    assert metrics["traj_staleness/groups_dropped_total"] == 1.0 and metrics["traj_offpolicy/sampled_in_fallback"] == 0
    _clear(tq)


def test_correct_defers_a_running_group_that_would_pass_the_cap_not_the_bound(tq):  # noqa: F811
    """``correct_fallback=defer``: a running group is waited for only where its first tokens would pass the cap
    (dispatched at step 4: 3 versions behind at step 7, past ``max_lag=2``); one dispatched at step 5 (2 behind,
    over ``max_staleness=1`` but within the cap) is not: it will train corrected."""
    _clear(tq)
    _put_group(tq, "ready", 5, [[[5, 9]]] * 2)
    tq.kv_put(key="slow", partition_id="train", tag={"is_prompt": True, "status": "running", "global_steps": 4})
    tq.kv_put(key="within", partition_id="train", tag={"is_prompt": True, "status": "running", "global_steps": 5})
    finisher = threading.Timer(0.6, lambda: _put_group(tq, "slow", 4, [[[4, 3], [5, 6]]] * 2))
    finisher.start()
    buffer = _correct(tq, refill=lambda k: None)
    batch, metrics = buffer.sample(global_steps=6, partition_id="train", batch_size=1)
    finisher.join()
    assert {key.split("_")[0] for key in batch.keys} == {"slow"}
    assert metrics["traj_staleness/groups_deferred_total"] == 1.0  # "slow" only
    _clear(tq)


@pytest.mark.parametrize("fallback", ["drop", "defer"])
def test_an_unhealthy_step_opens_the_gate_and_the_next_sampling_follows_the_fallback(tq, fallback):  # noqa: F811
    """After a step whose off-policy ESS is below ``offpolicy_min_ess`` the buffer treats a group over
    ``max_staleness`` as ``correct_fallback`` does, loudly: ``drop``: "stale" (finished, within the cap) leaves,
    refilled; ``defer`` discards nothing: "stale" trains corrected. Three healthy steps hand back."""
    _clear(tq)
    _put_group(tq, "fresh", 5, [[[5, 8]]] * 2)
    _put_group(tq, "stale", 4, [[[3, 10], [4, 10]], [[5, 8]]])
    buffer = _correct(tq, lambda k: _put_group(tq, "refill", 6, [[[5, 6]]] * 2), fallback=fallback)
    assert buffer.observe_health({"traj_offpolicy/ess_truncated": 0.1}) == {"traj_offpolicy/fallback_active": 1.0}
    assert buffer.acting_policy == fallback
    batch, metrics = buffer.sample(global_steps=6, partition_id="train", batch_size=2)
    kept = "refill" if fallback == "drop" else "stale"
    assert sorted({key.split("_")[0] for key in batch.keys}) == sorted(["fresh", kept])
    assert metrics["traj_staleness/groups_corrected_total"] == float(fallback == "defer")
    assert metrics["traj_staleness/groups_dropped_total"] == float(fallback == "drop")
    assert metrics["traj_offpolicy/sampled_in_fallback"] == 1.0
    for _ in range(3):
        buffer.observe_health({"traj_offpolicy/ess_truncated": 0.9})
    assert buffer.acting_policy == "correct"
    _clear(tq)
