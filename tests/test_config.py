"""The traj: section: defaults, validation messages that name field, value and fix."""

import pytest
from omegaconf import OmegaConf

from verl_traj.config import TrajConfig, TrajConfigError, validate_against_verl
from verl_traj.core import loss_weight_modes


def test_defaults_are_trajectory_aware():
    cfg = TrajConfig()
    assert cfg.enable and cfg.group_by == "group" and cfg.balance_dp
    assert cfg.micro_batch_max_tokens is None and cfg.loss_agg_mode is None


def test_from_mapping_roundtrip_and_unknown_key():
    cfg = TrajConfig.from_mapping({"group_by": "trajectory", "micro_batch_max_tokens": 4096})
    assert cfg.group_by == "trajectory" and cfg.micro_batch_max_tokens == 4096
    with pytest.raises(TrajConfigError, match=r"unknown key\(s\) in traj: \['micro_batch_max_token'\]"):
        TrajConfig.from_mapping({"micro_batch_max_token": 4096})


def test_of_parses_a_whole_config_once_per_object():
    from omegaconf import OmegaConf

    config = OmegaConf.create({"traj": {"traj_id_key": "episode"}, "data": {}})
    first = TrajConfig.of(config)
    assert first.traj_id_key == "episode" and TrajConfig.of(config) is first
    assert TrajConfig.of(OmegaConf.create({"traj": {"traj_id_key": "other"}})).traj_id_key == "other"
    assert TrajConfig.of({"traj": {"group_by": "trajectory"}}).group_by == "trajectory"  # plain dict: no cache
    assert TrajConfig.of(None) == TrajConfig()
    with pytest.raises(TrajConfigError, match="unknown key"):
        TrajConfig.of(OmegaConf.create({"traj": {"nope": 1}}))


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"group_by": "prompt"}, "traj.group_by='prompt'"),
        ({"workload": "flops"}, "traj.workload='flops'"),
        ({"loss_agg_mode": "seq-mean"}, "traj.loss_agg_mode='seq-mean'"),
        ({"critic_loss_agg_mode": "x"}, "traj.critic_loss_agg_mode='x'"),
        ({"micro_batch_max_tokens": 0}, "traj.micro_batch_max_tokens=0"),
        ({"micro_batch_max_tokens": True}, "traj.micro_batch_max_tokens=True"),
        ({"micro_batch_max_tokens": 12.5}, "traj.micro_batch_max_tokens=12.5"),
        ({"traj_id_key": ""}, "traj.traj_id_key=''"),
        ({"mini_batch_balance": "prompts"}, "traj.mini_batch_balance='prompts'"),
        ({"infer_micro_batch_max_tokens": -1}, "traj.infer_micro_batch_max_tokens=-1"),
        ({"padded_cap": "rows"}, "traj.padded_cap='rows'"),
        ({"pass_cost_tokens": -5}, "traj.pass_cost_tokens=-5"),
        ({"pass_cost_tokens": 1.5}, "traj.pass_cost_tokens=1.5"),
        ({"ratio_scope": "sequence"}, "traj.ratio_scope='sequence'"),
    ],
)
def test_invalid_values_name_field_and_value(kwargs, needle):
    with pytest.raises(TrajConfigError) as err:
        TrajConfig(**kwargs)
    assert needle in str(err.value)


@pytest.mark.parametrize("use_v1", [True, False])
def test_stock_step_rows_only_on_v1(use_v1):
    """``traj.step_wise=true traj.enable=false``: stock verl trains the step rows (one per LLM call) with its own
    mini-batches, the side-by-side baseline; v0 has no step rows of its own, so it is refused there by name."""
    config = OmegaConf.create({"trainer": {"use_v1": use_v1}})
    stock = TrajConfig(step_wise=True, enable=False)
    if use_v1:
        validate_against_verl(stock, config)
        return
    with pytest.raises(TrajConfigError, match="needs the v1 trainer.*trainer.use_v1=true") as err:
        validate_against_verl(stock, config)
    assert err.value.field == "traj.step_wise"


@pytest.mark.parametrize("scope", ["trajectory", "row"])
def test_gspo_takes_either_scope_and_bypass_mode_is_refused(scope):
    """GSPO with step rows trains at either scope (at trajectory scope the actor sums each trajectory's log-ratios
    first: ``UpdateSpec.ratio_groups``); bypass mode drops verl_traj's loss weights: refused whatever the scope."""
    from verl_traj.integration.update_spec import UpdateSpec

    gspo = OmegaConf.create({"actor_rollout_ref": {"actor": {"policy_loss": {"loss_mode": "gspo"}}}})
    validate_against_verl(TrajConfig(step_wise=True, ratio_scope=scope), gspo)
    cfg = OmegaConf.create({"data": {"train_batch_size": 4, "max_response_length": 8}, "trainer": {},
                            "actor_rollout_ref": {"actor": {"ppo_mini_batch_size": 2,
                                                            "policy_loss": {"loss_mode": "gspo"}}}})
    spec = UpdateSpec.derive(cfg, TrajConfig(step_wise=True, ratio_scope=scope), None)
    assert spec.ratio_groups == (scope == "trajectory")
    assert not UpdateSpec.derive(cfg, TrajConfig(ratio_scope=scope), None).ratio_groups  # one row per trajectory
    bypass = OmegaConf.create({"algorithm": {"rollout_correction": {"bypass_mode": True}}})
    with pytest.raises(TrajConfigError, match="bypass_mode=true is not supported.*bypass_mode=false") as err:
        validate_against_verl(TrajConfig(ratio_scope=scope), bypass)
    assert err.value.field == "algorithm.rollout_correction.bypass_mode"


def test_all_loss_modes_accepted():
    """The config accepts exactly the names of the core's loss-weight registry (one list, no copy)."""
    assert set(loss_weight_modes()) >= {"token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                                          "seq-mean-token-sum-norm", "traj-mean"}
    for mode in loss_weight_modes():
        assert TrajConfig(loss_agg_mode=mode).loss_agg_mode == mode


def _verl(adv="grpo", use_v1=False, prompt=256, response=256):
    return {
        "algorithm": {"adv_estimator": adv},
        "trainer": {"use_v1": use_v1},
        "data": {"max_prompt_length": prompt, "max_response_length": response},
    }


@pytest.mark.parametrize("adv", ["optimal_token_baseline", "gdpo"])
def test_estimators_without_a_step_row_path_rejected_with_step_wise_rows(adv):
    with pytest.raises(TrajConfigError, match=f"algorithm.adv_estimator='{adv}'.*traj.step_wise"):
        validate_against_verl(TrajConfig(step_wise=True), _verl(adv=adv))
    validate_against_verl(TrajConfig(step_wise=False), _verl(adv=adv))  # concatenated rows: fine


@pytest.mark.parametrize("adv", ["gae", "reinforce_plus_plus", "reinforce_plus_plus_baseline"])
def test_temporal_estimators_run_on_step_rows(adv):
    """Credit across turns: the temporal estimators run on each trajectory's timeline of step rows."""
    validate_against_verl(TrajConfig(step_wise=True), _verl(adv=adv))


def test_both_trainers_accepted():
    validate_against_verl(TrajConfig(), _verl(use_v1=True))
    validate_against_verl(TrajConfig(), _verl(use_v1=False))


def test_token_cap_below_max_length_rejected():
    with pytest.raises(TrajConfigError, match="Raise traj.micro_batch_max_tokens to at least 512"):
        validate_against_verl(TrajConfig(micro_batch_max_tokens=300), _verl())
    validate_against_verl(TrajConfig(micro_batch_max_tokens=512), _verl())


def test_policy_loss_checked_once_with_the_config_error():
    cfg = _verl()
    cfg["actor_rollout_ref"] = {"actor": {"policy_loss": {"loss_mode": "geo_mean"}}}
    with pytest.raises(TrajConfigError, match="policy_loss.loss_mode=.geo_mean.*geometric mean of the ratios.*traj.enable=false"):
        validate_against_verl(TrajConfig(), cfg)


def test_disabled_skips_cross_checks():
    validate_against_verl(TrajConfig(enable=False, micro_batch_max_tokens=1), _verl(use_v1=True))


def test_shipped_traj_section_names_every_knob_with_its_default():
    """Regression: a TrajConfig field missing from configs/traj/default.yaml cannot be overridden on the command
    line (hydra: "Could not override ... use +traj.x"), so the README's knobs must all be in the shipped file."""
    import dataclasses
    from pathlib import Path

    from omegaconf import OmegaConf

    import verl_traj

    shipped = OmegaConf.to_container(OmegaConf.load(Path(verl_traj.__file__).parent / "configs/traj/default.yaml"))
    defaults = {f.name: f.default for f in dataclasses.fields(TrajConfig)}
    assert shipped == defaults


def test_token_cap_check_reads_ulysses_from_the_engine_config():
    """Regression: the start-up cap check read only the deprecated top-level actor key, so a cap valid per SP group
    set via ``fsdp_config.ulysses_sequence_parallel_size`` was refused."""
    cfg = {"data": {"max_prompt_length": 64, "max_response_length": 16},
           "actor_rollout_ref": {"actor": {"ppo_mini_batch_size": 4, "fsdp_config": {"ulysses_sequence_parallel_size": 4}}}}
    validate_against_verl(TrajConfig(micro_batch_max_tokens=20), {**cfg, "data": {**cfg["data"], "train_batch_size": 8}})
    with pytest.raises(TrajConfigError, match="ulysses_sequence_parallel_size=4.*at least 20"):
        validate_against_verl(TrajConfig(micro_batch_max_tokens=19), {**cfg, "data": {**cfg["data"], "train_batch_size": 8}})


@pytest.mark.parametrize(
    "section, field",
    [
        ({"enable": "false"}, "traj.enable"),  # a truthy string: training would stay on
        ({"enable": None}, "traj.enable"),  # neither on nor off: every start-up check keyed on it skipped
        ({"balance_dp": "true"}, "traj.balance_dp"),
        ({"step_wise": 1}, "traj.step_wise"),
        ({"merge_prefix": None}, "traj.merge_prefix"),
        (False, "traj"),  # the section itself a bool
        ({"seed": -1}, "traj.seed"),
        ({"seed": 2.0}, "traj.seed"),
        ({"traj_id_key": "k", "step_index_key": "k"}, "traj.step_index_key"),
        ({"step_index_key": "is_last_step"}, "traj.step_index_key"),
    ],
)
def test_wrong_types_are_refused_at_start_up(section, field):
    """Every refusal names its field (``err.field``, also in the message), the value and the fix."""
    from verl_traj.core import TrajInputError

    with pytest.raises(TrajConfigError) as err:
        TrajConfig.from_mapping(section)
    assert isinstance(err.value, TrajInputError) and err.value.field == field
    assert field in str(err.value) and ("Fix" in str(err.value) or "set" in str(err.value))


def test_v1_refuses_row_field_names_it_cannot_use():
    """On v1 a row's trajectory and step come from its TransferQueue key: a renamed field would be ignored there."""
    cfg = {"trainer": {"use_v1": True}}
    with pytest.raises(TrajConfigError, match="traj.step_index_key='step' has no effect on the v1 trainer") as err:
        validate_against_verl(TrajConfig(step_index_key="step"), cfg)
    assert err.value.field == "traj.step_index_key"
    validate_against_verl(TrajConfig(step_index_key="step"), {"trainer": {"use_v1": False}})  # v0 reads the field


def test_pf_ppo_is_refused_with_planned_batches():
    with pytest.raises(TrajConfigError, match="algorithm.use_pf_ppo=true"):
        validate_against_verl(TrajConfig(), {"algorithm": {"use_pf_ppo": True}})
