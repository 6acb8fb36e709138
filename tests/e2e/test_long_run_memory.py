"""Bounded memory over a long run (issue 40, item 4): 100 steps of the tiny PPO preset with every per-step cache and
log verl_traj keeps in play (prefix trees on, a reference model, a critic, Ulysses SP=2 so that one of the two ranks
returns no output from its passes), and no process of the run grows after warm-up.

Every process of the run (the driver, the task runner, the actor/reference and critic workers, the rollout server,
TransferQueue's storage, Ray's own daemons) is sampled every half second with the number of steps logged by then;
each one's RSS is fitted against the step (:func:`~tests.e2e.runs.rss_slopes`) from step 20 on; noise on this preset
is below 0.1 MiB a step. What it catches is growth above 0.25 MiB a step (a per-step cache of models, compiled kernels,
rows of every step); this preset's batch is tens of KB, so a leak of one batch's tensors or of a metric list per step
stays under the bound: the unit tests of the logs and caches (tests/integration/test_tree_forward.py) cover those.

About 5.5 minutes on 2 cores (~3 s a step): opt in with ``VERL_TRAJ_TEST_LONG=1`` (the default suite is at its
30-minute budget); ``VERL_TRAJ_TEST_LONG_STEPS`` sets the steps (default 100). The unit tests that the tree logs stay
bounded without an update are in ``tests/integration/test_tree_forward.py``."""

from __future__ import annotations

import os

import pytest

from tests.e2e.runs import REMOVE_PADDING, TRAINERS, ULYSSES_2, rss_slopes

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(os.environ.get("VERL_TRAJ_TEST_LONG") != "1",
                                                  reason="a 100-step run (~6 min): set VERL_TRAJ_TEST_LONG=1")]

STEPS = int(os.environ.get("VERL_TRAJ_TEST_LONG_STEPS", "100"))
WARM_UP = 20
OURS_MIB_PER_STEP = 0.25  # the run's own processes: the driver and every ray:: worker (verl, verl_traj)
RAY_MIB_PER_STEP = 1.0  # Ray's daemons (GCS, raylet, dashboard): their task-event history grows by design, bounded
LONG_RUN = [*TRAINERS["v1"], f"trainer.total_training_steps={STEPS}", *REMOVE_PADDING, *ULYSSES_2,
            "data.train_batch_size=6", "actor_rollout_ref.actor.ppo_mini_batch_size=6", "actor_rollout_ref.rollout.n=3",
            "traj.micro_batch_max_tokens=200", "critic.ppo_mini_batch_size=6", "actor_rollout_ref.actor.use_kl_loss=true",
            "traj.prefix_tree=true", "trainer.save_freq=-1", "trainer.test_freq=-1"]


def test_no_process_grows_after_warm_up_over_a_long_tree_run(run_training):
    run = run_training(list(dict.fromkeys(LONG_RUN)), config_name="cpu_tiny_ppo", timeout=STEPS * 20 + 300)
    assert run.returncode == 0, run.tail()
    assert len(run.metrics) == STEPS
    assert all(m.get("actor/tree_micro_batches", 0) > 0 for m in run.metrics)  # the tree path ran every step
    slopes = rss_slopes(run.rss_samples, WARM_UP)
    names = run.process_names
    ours = {p: s for p, s in slopes.items()  # the launched driver and Ray's workers (ray::<Actor>)
            if "verl_traj.main_ppo" in names.get(p, "") or names.get(p, "").startswith("ray::")}
    ray = {p: s for p, s in slopes.items() if p not in ours}
    report = "\n".join(f"  {names.get(p, '?')[:60]:60s} pid {p}: {s:+.3f} MiB/step"
                       for p, s in sorted(slopes.items(), key=lambda x: -x[1]))
    assert len(ours) >= 4, f"too few of the run's processes sampled past step {WARM_UP}:\n{report}"
    assert max(ours.values()) < OURS_MIB_PER_STEP, f"a process of the run grows after warm-up:\n{report}"
    assert max(ray.values(), default=0.0) < RAY_MIB_PER_STEP, f"a Ray daemon grows after warm-up:\n{report}"
    print(f"RSS slopes from step {WARM_UP} to {STEPS}:\n{report}")
