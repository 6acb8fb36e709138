"""Multi-node: a local 2-node Ray cluster (``ray.cluster_utils.Cluster``), ``trainer.nnodes=2``,
one logical GPU per node, so verl places one data-parallel rank (FSDP2 over gloo across the two
"nodes") and one CPU rollout replica on each node. Checks real training happened on both ranks
and reports the peak memory of the whole process tree (cluster daemons + driver + workers)."""

from __future__ import annotations

import json
import os
import re

import pytest


GiB = 1024**3


@pytest.fixture
def two_node_cluster(tiny_home, tmp_path, monkeypatch):
    from ray.cluster_utils import Cluster

    # Ray workers inherit the environment of the node daemons (started here), not the driver's:
    # set what the config interpolates (${oc.env:...}) and the file logger path before starting them.
    monkeypatch.setenv("VERL_TRAJ_HOME", str(tiny_home.parent))
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(tmp_path / "metrics.jsonl"))
    monkeypatch.setenv("VERL_TRAJ_CKPT_DIR", str(tmp_path / "ckpt"))

    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 6, "num_gpus": 1, "include_dashboard": False},
    )
    cluster.add_node(num_cpus=6, num_gpus=1)
    cluster.wait_for_nodes()
    try:
        yield cluster
    finally:
        cluster.shutdown()


@pytest.mark.e2e
def test_two_node_data_parallel_training(two_node_cluster, run_training):
    steps = 2
    run = run_training(
        [
            f"trainer.total_training_steps={steps}",
            "trainer.nnodes=2",
            "trainer.n_gpus_per_node=1",
            f"+ray_kwargs.ray_init.address={two_node_cluster.address}",
            # connecting to an existing cluster: resources come from the cluster, not ray.init
            "ray_kwargs.ray_init.num_cpus=null",
            "ray_kwargs.ray_init.num_gpus=null",
            "~ray_kwargs.ray_init.include_dashboard",
        ],
        timeout=480,
        extra_roots=[os.getpid()],  # cluster daemons are children of this test process
    )
    assert run.returncode == 0, run.tail()
    assert [m["step"] for m in run.metrics] == list(range(1, steps + 1)), run.tail()

    # two rollout replicas (one per DP rank / node)
    servers = re.findall(r"LLMServerManager: \[(.*?)\]", run.output)
    assert servers and len(servers[0].split(",")) == 2, servers
    for m in run.metrics:
        assert m["actor/grad_norm"] > 0
        assert m["training/rollout_probs_diff_max"] < 1e-4
        # the trainer's planner (traj.enable=true) reports the DP size it balanced over
        if "traj_plan/dp_size" in m:
            assert m["traj_plan/dp_size"] == 2

    figures = {
        "wall_seconds": round(run.wall_seconds, 1),
        "step_seconds": [round(m["timing_s/step"], 2) for m in run.metrics],
        "peak_rss_gib_process_tree": round(run.peak_rss_bytes / GiB, 2),
        "rollout_probs_diff_max": max(m["training/rollout_probs_diff_max"] for m in run.metrics),
        "grad_norm": [round(m["actor/grad_norm"], 4) for m in run.metrics],
    }
    print("\n[cpu 2-node figures]", json.dumps(figures))
    assert run.peak_rss_bytes < 20 * GiB
