"""The traj: section: defaults, validation messages that name field, value and fix."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from verl_traj.config import TrajConfig, TrajConfigError
from verl_traj.core import loss_weight_modes
from verl_traj.integration.startup.verl_checks import validate_against_verl


def test_defaults_are_trajectory_aware():
    cfg = TrajConfig()
    assert cfg.enable and cfg.group_by == "group" and cfg.balance_dp
    assert cfg.micro_batch_max_tokens is None and cfg.loss_agg_mode is None


def test_from_mapping_roundtrip_and_unknown_key():
    cfg = TrajConfig.from_mapping({"group_by": "trajectory", "micro_batch_max_tokens": 4096})
    assert cfg.group_by == "trajectory" and cfg.micro_batch_max_tokens == 4096
    with pytest.raises(TrajConfigError, match=r"unknown key\(s\) in traj: \['micro_batch_max_token'\]"):
        TrajConfig.from_mapping({"micro_batch_max_token": 4096})


def _verl_config(traj: dict):
    """verl's own whole trainer config (what an agent-loop worker holds) with a ``traj:`` section."""
    import os

    import verl

    config = OmegaConf.load(os.path.join(os.path.dirname(verl.__file__), "trainer/config/_generated_ppo_trainer.yaml"))
    config.traj = traj
    return config


def test_a_lookup_per_session_never_hashes_or_compares_verls_config(monkeypatch):
    """Issue 40: ``TrajConfig.of`` runs per agent session; its cache once hashed and deep-compared verl's whole config
    on every hit (0.1-0.5 s each). Counted, not timed: 1,000 lookups parse once and touch the config's ``__hash__`` /
    ``__eq__`` never."""
    from omegaconf import DictConfig

    import verl_traj.config as config_module

    config = _verl_config({"traj_id_key": "episode", "step_wise": True})
    calls = {"hash": 0, "eq": 0, "parse": 0}
    for name, key in (("__hash__", "hash"), ("__eq__", "eq")):
        original = getattr(DictConfig, name)
        monkeypatch.setattr(DictConfig, name, lambda self, *a, _o=original, _k=key: calls.__setitem__(
            _k, calls[_k] + 1) or _o(self, *a))
    parse = TrajConfig.from_mapping.__func__
    monkeypatch.setattr(TrajConfig, "from_mapping", classmethod(
        lambda cls, section: calls.__setitem__("parse", calls["parse"] + 1) or parse(cls, section)))
    first = TrajConfig.of(config)
    assert all(TrajConfig.of(config) is first for _ in range(1000))
    assert first.traj_id_key == "episode" and first.step_wise
    assert calls == {"hash": 0, "eq": 0, "parse": 1}
    # an equal but distinct config is its own entry; a collected config leaves the cache
    other = _verl_config({"traj_id_key": "other"})
    assert TrajConfig.of(other).traj_id_key == "other" and calls["parse"] == 2
    import gc

    gc.collect()  # configs of earlier tests in reference cycles leave first
    before = len(config_module._PARSED)
    del other
    gc.collect()
    assert len(config_module._PARSED) == before - 1 and TrajConfig.of(config) is first


def test_of_parses_plain_dicts_and_none_each_time_and_refuses_unknown_keys():
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
        ({"replay_poll_s": 0}, "traj.replay_poll_s=0"),
        ({"replay_poll_s": "fast"}, "traj.replay_poll_s='fast'"),
        ({"replay_poll_s": 600}, "traj.replay_poll_s=600"),
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
    from verl_traj.integration.config.update_spec import UpdateSpec

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
    assert shipped == {**defaults, "credit_rule_modules": []}  # a YAML list; TrajConfig keeps a tuple
    assert TrajConfig.from_mapping(shipped) == TrajConfig()


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


# ---------------------------------------------------------------------------------------------------------------------
# Property test: random, partly malformed traj: sections and verl settings through the start-up checks
# ---------------------------------------------------------------------------------------------------------------------
NAN = float("nan")
BAD_VALUES = [None, "", "true", "false", "1", "abc", 1.5, 2.0, NAN, float("inf"), -1, -7, 0, 10**12, True, False,
              [], ["x"], {}, {"a": 1}]
VALID_TRAJ = {
    "enable": [True, False], "group_by": ["group", "trajectory"], "mini_batch_balance": ["tokens", "units"],
    "balance_dp": [True, False], "workload": ["verl", "tokens"], "micro_batch_max_tokens": [None, 64, 512, 4096],
    "infer_micro_batch_max_tokens": [None, 128], "padded_cap": ["tokens", "area"], "pass_cost_tokens": [None, 0, 1024],
    "loss_agg_mode": [None, "token-mean", "traj-mean"], "critic_loss_agg_mode": [None, "token-mean"],
    "traj_id_key": ["traj_id", "episode"], "step_index_key": ["step_index", "step"], "step_wise": [True, False],
    "merge_prefix": [True, False], "seed": [0, 3], "ratio_scope": ["trajectory", "row"],
}
# the verl settings the start-up checks read, each with valid values
VALID_VERL = {
    "algorithm.adv_estimator": ["grpo", "gae", "rloo", "reinforce_plus_plus", "gdpo", "remax"],
    "algorithm.use_pf_ppo": [False, True], "algorithm.use_kl_in_reward": [False, True],
    "algorithm.rollout_correction.bypass_mode": [False, True], "critic.enable": [None, True, False],
    "trainer.use_v1": [True, False], "trainer.v1.trainer_mode": ["sync", "separate_async"],
    "trainer.v1.sync.parameter_sync_step": [1, 2], "data.train_batch_size": [0, 4, 8, 6],
    "data.max_prompt_length": [32, 256], "data.max_response_length": [16, 256],
    "actor_rollout_ref.actor.ppo_mini_batch_size": [2, 4, 3], "critic.ppo_mini_batch_size": [4, 8, 3],
    "actor_rollout_ref.actor.policy_loss.loss_mode": ["vanilla", "gspo", "sapo"],
    "actor_rollout_ref.actor.use_kl_loss": [False, True], "actor_rollout_ref.actor.use_prefix_grouper": [False, True],
    "actor_rollout_ref.actor.ulysses_sequence_parallel_size": [1, 2],
    "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size": [1, 2],
    "critic.fsdp.ulysses_sequence_parallel_size": [1, 2], "actor_rollout_ref.model.use_remove_padding": [False, True],
    "critic.model.use_remove_padding": [False, True], "actor_rollout_ref.actor.calculate_sum_pi_squared": [False, True],
    "distillation.enabled": [False, True], "trainer.device": ["cpu", "cuda"],
    "actor_rollout_ref.model.lora_rank": [0, 8], "actor_rollout_ref.model.lora.merge": [False, True],
    "actor_rollout_ref.rollout.name": ["cpu", "vllm"],
    "actor_rollout_ref.model.override_config.attn_implementation": [None, "sdpa", "eager", "cpu_varlen"],
    "critic.model.override_config.attn_implementation": [None, "sdpa", "flash_attention_2"],
}


def _misspell(draw, name: str) -> str:
    """``name`` with one character dropped, doubled or swapped (or a suffix): a key a user could type."""
    i = draw(st.integers(0, len(name) - 1))
    how = draw(st.sampled_from(["drop", "double", "swap", "suffix", "case"]))
    if how == "drop":
        return name[:i] + name[i + 1:]
    if how == "double":
        return name[:i] + name[i] + name[i:]
    if how == "swap" and i < len(name) - 1:
        return name[:i] + name[i + 1] + name[i] + name[i + 2:]
    return name.upper() if how == "case" else name + "s"


@st.composite
def traj_sections(draw):
    """A ``traj:`` mapping of valid values with a few corruptions: wrong types, unknown choices, misspelled keys."""
    section = {k: draw(st.sampled_from(v)) for k, v in VALID_TRAJ.items() if draw(st.booleans())}
    for _ in range(draw(st.integers(0, 2))):
        key = draw(st.sampled_from(sorted(VALID_TRAJ)))
        kind = draw(st.sampled_from(["value", "choice", "key"]))
        if kind == "value":
            section[key] = draw(st.sampled_from(BAD_VALUES))
        elif kind == "choice":
            section[key] = draw(st.sampled_from(["prompt", "seq-mean", "rows", "Trajectory", "sequence"]))
        else:
            section[_misspell(draw, key)] = section.pop(key, draw(st.sampled_from(VALID_TRAJ[key])))
    return section


@st.composite
def verl_configs(draw):
    """verl's sections (as OmegaConf) holding valid values of the settings the checks read, a few corrupted."""
    config = OmegaConf.create({})
    for path, values in VALID_VERL.items():
        if draw(st.booleans()) or path == "algorithm.adv_estimator":
            OmegaConf.update(config, path, draw(st.sampled_from(values)), force_add=True)
    for _ in range(draw(st.integers(0, 2))):
        path = draw(st.sampled_from(sorted(VALID_VERL)))
        bad = draw(st.sampled_from(BAD_VALUES + ["simply", "GRPO", "grpo "]))
        OmegaConf.update(config, path, bad, merge=False, force_add=True)
    return config


def _assert_names_field_and_fix(err: TrajConfigError) -> None:
    """A refusal names its field (``.field``, also in the message) and the fix."""
    import re

    message = str(err)
    assert err.field, f"no field on: {message}"
    assert err.field in message, (err.field, message)
    assert re.search(r"Fix|\b[Ss]et |\b[Uu]se |\b[Rr]aise |\b[Aa]dd |\b[Rr]emove ", message), message


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(section=traj_sections())
def test_fuzzed_traj_sections_parse_or_name_field_and_fix(section):
    """``TrajConfig.from_mapping`` on random, partly malformed sections: a valid config, or a refusal naming the
    field and the fix (never another exception)."""
    try:
        parsed = TrajConfig.from_mapping(section)
    except TrajConfigError as err:
        _assert_names_field_and_fix(err)
        return
    assert {k: getattr(parsed, k) for k in section} == section  # every given value kept as given


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(section=traj_sections(), config=verl_configs())
def test_fuzzed_verl_settings_pass_or_name_field_and_fix(section, config):
    """The cross-checks, the verl-settings checks and the CPU platform's settings on random, partly malformed verl
    sections (strings for bools and ints, NaN, negative numbers, unknown estimators and attentions): they pass, or
    refuse naming the field and the fix."""
    from verl_traj.integration.startup.cpu_settings import check_cpu_rollout_lora, select_cpu_attention
    from verl_traj.integration.startup.checks import check_adv_estimator, check_sequence_parallel

    try:
        traj_config = TrajConfig.from_mapping(section)
    except TrajConfigError:
        traj_config = TrajConfig()
    for check in (lambda: validate_against_verl(traj_config, config), lambda: check_adv_estimator(config),
                  lambda: check_sequence_parallel(config), lambda: select_cpu_attention(config),
                  lambda: check_cpu_rollout_lora(config)):
        try:
            check()
        except TrajConfigError as err:
            _assert_names_field_and_fix(err)


def test_defer_without_a_staleness_bound_is_refused_and_the_bound_is_checked():
    with pytest.raises(TrajConfigError, match=r"traj.stale_groups='defer' without traj.max_staleness.*Fix") as err:
        TrajConfig(stale_groups="defer")
    assert err.value.field == "traj.stale_groups"
    with pytest.raises(TrajConfigError, match=r"traj.max_staleness=0.5.*at least 1"):
        TrajConfig(max_staleness=0.5)
    assert TrajConfig(max_staleness=2, stale_groups="defer").max_staleness == 2
