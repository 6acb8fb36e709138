"""Where ``python -m verl_traj.main_ppo`` starts Ray
(:func:`verl_traj.integration.config.verl_config.ray_init_address`).

Regression: CI's machine had a Ray cluster recorded in ``/tmp/ray/ray_current_cluster``; every CPU run then
connected to it and died inside ``ray.init`` ("When connecting to an existing cluster, num_cpus and num_gpus must
not be provided") because the CPU presets size their own cluster."""

from __future__ import annotations

import pytest

from verl_traj.config import TrajConfigError
from verl_traj.integration.config.verl_config import ray_init_address
from verl_traj.testing.engine import cpu_config


def test_sized_cluster_starts_locally_and_the_config_says_so():
    config = cpu_config()
    assert config.ray_kwargs.ray_init.num_cpus is not None
    assert ray_init_address(config, environ={}) == "local"
    assert config.ray_kwargs.ray_init.address == "local"


def test_unsized_cluster_joins_a_running_one_as_verl_does():
    config = cpu_config(["ray_kwargs.ray_init.num_cpus=null", "ray_kwargs.ray_init.num_gpus=null"])
    assert ray_init_address(config, environ={}) is None
    assert config.ray_kwargs.ray_init.get("address") is None


@pytest.mark.parametrize("overrides, environ, source", [
    (["+ray_kwargs.ray_init.address=10.0.0.1:6379"], {}, "ray_kwargs.ray_init.address"),
    ([], {"RAY_ADDRESS": "10.0.0.1:6379"}, "RAY_ADDRESS"),
])
def test_sizes_with_a_cluster_address_are_refused_with_the_fix(overrides, environ, source):
    config = cpu_config(overrides)
    with pytest.raises(TrajConfigError) as err:
        ray_init_address(config, environ=environ)
    message = str(err.value)
    assert "ray_kwargs.ray_init.num_cpus=16" in message and source in message and "10.0.0.1:6379" in message
    assert "ray_kwargs.ray_init.num_cpus=null" in message and "ray_kwargs.ray_init.num_gpus=null" in message


def test_a_recorded_cluster_does_not_capture_a_sized_run(monkeypatch):
    """A real head node recorded as the machine's current cluster (what ``ray start`` leaves behind): the CPU
    preset's ``ray.init`` arguments start a separate local instance instead of failing on it."""
    import ray
    from ray.cluster_utils import Cluster

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    stray = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        config = cpu_config(["ray_kwargs.ray_init.num_cpus=2", "ray_kwargs.ray_init.num_gpus=0"])
        ray_init_address(config, environ={})
        kwargs = {k: config.ray_kwargs.ray_init.get(k) for k in ("address", "num_cpus", "num_gpus", "include_dashboard")}
        ray.init(**kwargs, log_to_driver=False)
        try:
            assert ray.get_runtime_context().gcs_address != stray.address
            assert ray.cluster_resources()["CPU"] == 2
        finally:
            ray.shutdown()
    finally:
        stray.shutdown()
