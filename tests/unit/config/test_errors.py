"""Every kind of invalid config fails with a message that names the key, the value and what is allowed."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from rlmesh.config import ConfigError, load_config

WriteYaml = Callable[[str], Path]


def problems_of(overrides: Sequence[str] = (), path: Path | None = None) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    assert str(info.value) == "\n".join(f"- {p}" for p in info.value.problems)
    return info.value.problems


def only_problem(overrides: Sequence[str] = (), path: Path | None = None) -> str:
    problems = problems_of(overrides, path)
    assert len(problems) == 1, problems
    return problems[0]


def test_config_error_is_a_value_error_listing_each_problem() -> None:
    err = ConfigError(["first", "second"])
    assert isinstance(err, ValueError)
    assert err.problems == ["first", "second"]
    assert str(err) == "- first\n- second"


def test_unknown_key_names_the_full_path_and_the_closest_key() -> None:
    message = only_problem(["actor_rollout_ref.actor.clip_raito=0.2"])
    assert message.startswith(
        "unknown key 'actor_rollout_ref.actor.clip_raito'; did you mean 'actor_rollout_ref.actor.clip_ratio'?"
    )


def test_unknown_key_in_a_file_and_in_the_wrong_section(write_yaml: WriteYaml) -> None:
    path = write_yaml("actor_rollout_ref:\n  rollout:\n    clip_ratio: 0.2\ntrainr:\n  total_epochs: 1\n")
    problems = problems_of(path=path)
    assert (
        "unknown key 'actor_rollout_ref.rollout.clip_ratio'; did you mean 'actor_rollout_ref.actor.clip_ratio'?"
        in problems
    )
    assert "unknown key 'trainr'; did you mean 'trainer'?" in problems


def test_unknown_key_with_nothing_close() -> None:
    assert only_problem(["data.zzzzzzzz=1"]) == "unknown key 'data.zzzzzzzz'"


def test_all_problems_are_reported_at_once() -> None:
    problems = problems_of(
        [
            "oops",
            "data.max_prompt_length=0",
            "algorithm.kl_ctrl.type=pid",
            "critic.optim.lrr=1",
        ]
    )
    assert len(problems) == 4
    assert problems[0].startswith("override #1 'oops'")


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        (
            "algorithm.adv_estimator=ppo",
            "bad value for 'algorithm.adv_estimator': 'ppo'; allowed: 'gae', 'grpo', 'rloo', "
            "'reinforce_plus_plus', 'reinforce_plus_plus_baseline', 'remax'",
        ),
        (
            "algorithm.kl_penalty=full",
            "bad value for 'algorithm.kl_penalty': 'full'; allowed: 'kl', 'k1', 'abs', 'mse', 'k2', "
            "'low_var_kl', 'k3', 'kl+', 'k1+', 'low_var_kl+', 'k3+'",
        ),
        (
            "algorithm.kl_ctrl.type=pid",
            "bad value for 'algorithm.kl_ctrl.type': 'pid'; allowed: 'fixed', 'adaptive'",
        ),
        (
            "algorithm.rollout_correction.rollout_is=batch",
            "bad value for 'algorithm.rollout_correction.rollout_is': 'batch'; allowed: 'token', 'sequence'",
        ),
        (
            "data.truncation=cut",
            "bad value for 'data.truncation': 'cut'; allowed: 'error', 'left', 'right', 'middle'",
        ),
        (
            "trainer.resume_mode=latest",
            "bad value for 'trainer.resume_mode': 'latest'; allowed: 'auto', 'disable', 'resume_path'",
        ),
        (
            "trainer.logger=[console,swanlab]",
            "bad value for 'trainer.logger[1]': 'swanlab'; allowed: 'console', 'wandb', 'mlflow', "
            "'tensorboard', 'jsonl', 'file'",
        ),
        (
            "actor_rollout_ref.actor.loss_agg_mode=mean",
            "bad value for 'actor_rollout_ref.actor.loss_agg_mode': 'mean'; allowed: 'token-mean', "
            "'seq-mean-token-sum', 'seq-mean-token-mean', 'seq-mean-token-sum-norm'",
        ),
        (
            "rlmesh.weight_sync.transport=nfs",
            "bad value for 'rlmesh.weight_sync.transport': 'nfs'; allowed: 'distributed', 'disk'",
        ),
        ("rlmesh.log_format=xml", "bad value for 'rlmesh.log_format': 'xml'; allowed: 'json', 'text'"),
        ("data.max_prompt_length=0", "bad value for 'data.max_prompt_length': 0; must be > 0"),
        ("data.max_response_length=-5", "bad value for 'data.max_response_length': -5; must be > 0"),
        (
            "actor_rollout_ref.actor.clip_ratio=-0.1",
            "bad value for 'actor_rollout_ref.actor.clip_ratio': -0.1; must be >= 0",
        ),
        (
            "actor_rollout_ref.actor.clip_ratio_high=-1",
            "bad value for 'actor_rollout_ref.actor.clip_ratio_high': -1; must be >= 0",
        ),
        (
            "actor_rollout_ref.actor.clip_ratio_c=0.5",
            "bad value for 'actor_rollout_ref.actor.clip_ratio_c': 0.5; must be > 1",
        ),
        (
            "actor_rollout_ref.actor.ppo_epochs=0",
            "bad value for 'actor_rollout_ref.actor.ppo_epochs': 0; must be >= 1",
        ),
        ("actor_rollout_ref.rollout.n=0", "bad value for 'actor_rollout_ref.rollout.n': 0; must be >= 1"),
        ("data.val_batch_size=0", "bad value for 'data.val_batch_size': 0; must be > 0"),
        ("rlmesh.max_staleness=-1", "bad value for 'rlmesh.max_staleness': -1; must be >= 0"),
        ("rlmesh.reward.port=70000", "bad value for 'rlmesh.reward.port': 70000; must be <= 65535"),
        ("rlmesh.learner.metrics_port=-1", "bad value for 'rlmesh.learner.metrics_port': -1; must be >= 0"),
        (
            "actor_rollout_ref.actor.deepspeed_config.zero_stage=4",
            "bad value for 'actor_rollout_ref.actor.deepspeed_config.zero_stage': 4; must be <= 3",
        ),
        ("data.train_batch_size=abc", "bad value for 'data.train_batch_size': 'abc'; expected an integer"),
        ("trainer.total_epochs=1.5", "bad value for 'trainer.total_epochs': 1.5; expected an integer"),
        ("data.shuffle=maybe", "bad value for 'data.shuffle': 'maybe'; expected true or false"),
        ("data.train_files=5", "bad value for 'data.train_files': 5; expected str | list[str]"),
        (
            "actor_rollout_ref.actor.optim.betas=[0.9]",
            "bad value for 'actor_rollout_ref.actor.optim.betas': [0.9]; expected [float, float]",
        ),
        (
            "actor_rollout_ref.actor.optim=5",
            "bad value for 'actor_rollout_ref.actor.optim': 5; expected a mapping",
        ),
        (
            "actor_rollout_ref.actor.policy_loss.loss_mode=ppo",
            "bad value for 'actor_rollout_ref.actor.policy_loss.loss_mode': 'ppo'; allowed: 'vanilla', 'gspo', "
            "'sapo', 'gpg', 'clip_cov', 'kl_cov', 'geo_mean', 'cispo', 'dppo_tv', 'dppo_kl', 'dro'",
        ),
        ("algorithm.use_pf_ppo=true", "bad value for 'algorithm.use_pf_ppo': true; allowed: false"),
        (
            "rlmesh.weight_sync.load_format=flat",
            "bad value for 'rlmesh.weight_sync.load_format': 'flat'; allowed: 'auto', 'flattened_bucket', 'per_tensor'",
        ),
    ],
)
def test_bad_value_names_key_value_and_allowed(override: str, expected: str) -> None:
    assert only_problem([override]).startswith(expected)


@pytest.mark.parametrize("engine", ["lmdeploy", "tgi"])
def test_an_unknown_rollout_engine_fails_with_the_supported_ones(engine: str) -> None:
    message = only_problem([f"actor_rollout_ref.rollout.name={engine}"])
    assert message.startswith(f"bad value for 'actor_rollout_ref.rollout.name': '{engine}';")
    assert "not supported" in message and "'embedded'" in message and "'sglang'" in message


@pytest.mark.parametrize(
    ("argument", "expected"),
    [
        ("data.train_batch_size", "override #1 'data.train_batch_size' has no '='"),
        ("=5", "override #1 '=5' has an empty key"),
        ("+=5", "override #1 '+=5' has an empty key"),
        ("data..seed=1", "override #1 'data..seed=1' has an empty key"),
        ("~data.seed", "override #1 '~data.seed' has no '='"),
        ("~data.seed=1", "override #1 '~data.seed=1': deleting a key"),
        ("data.train_files=[a,", "override #1 'data.train_files=[a,': cannot parse the value '[a,'"),
    ],
)
def test_malformed_override_says_which_argument(argument: str, expected: str) -> None:
    assert only_problem([argument]).startswith(expected)


def test_malformed_override_counts_arguments_from_one() -> None:
    assert only_problem(["data.seed=1", "data.seed"]).startswith("override #2 'data.seed'")


def test_train_batch_must_divide_into_mini_batches() -> None:
    problems = problems_of(["data.train_batch_size=1000"])
    assert problems == [
        "data.train_batch_size (1000) must be divisible by actor_rollout_ref.actor.ppo_mini_batch_size (256)",
        "data.train_batch_size (1000) must be divisible by critic.ppo_mini_batch_size (256)",
    ]


def test_mini_batch_samples_must_divide_into_micro_batches() -> None:
    message = only_problem(
        [
            "algorithm.adv_estimator=grpo",
            "actor_rollout_ref.rollout.n=3",
            "actor_rollout_ref.actor.ppo_mini_batch_size=16",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=5",
        ]
    )
    assert message == (
        "actor_rollout_ref.actor.ppo_mini_batch_size * actor_rollout_ref.rollout.n (16 * 3 = 48 samples) "
        "must be divisible by actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu (5)"
    )
    # with dynamic batching the micro-batch size is not used, as in verl
    load_config(
        None,
        [
            "algorithm.adv_estimator=grpo",
            "actor_rollout_ref.rollout.n=3",
            "actor_rollout_ref.actor.ppo_mini_batch_size=16",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=5",
            "actor_rollout_ref.actor.use_dynamic_bsz=true",
        ],
    )


def test_critic_batch_rules_apply_only_with_a_critic() -> None:
    message = only_problem(["critic.ppo_mini_batch_size=128", "critic.ppo_micro_batch_size_per_gpu=3"])
    assert message == (
        "critic.ppo_mini_batch_size * actor_rollout_ref.rollout.n (128 * 1 = 128 samples) must be divisible "
        "by critic.ppo_micro_batch_size_per_gpu (3)"
    )
    assert "critic.ppo_mini_batch_size (100)" in only_problem(["critic.ppo_mini_batch_size=100"])
    # GRPO trains no critic: its batch settings are not checked
    load_config(
        None,
        ["algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2", "critic.ppo_mini_batch_size=100"],
    )


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_plus_plus_baseline"])
def test_group_estimators_need_several_samples(estimator: str) -> None:
    message = only_problem([f"algorithm.adv_estimator={estimator}"])
    assert message == (
        f"algorithm.adv_estimator={estimator} compares samples of the same prompt: "
        "actor_rollout_ref.rollout.n must be > 1 (got 1)"
    )
    load_config(None, [f"algorithm.adv_estimator={estimator}", "actor_rollout_ref.rollout.n=2"])


def test_gae_needs_its_critic() -> None:
    assert "critic.enable must not be false" in only_problem(["critic.enable=false"])


def test_resume_path_needs_a_path() -> None:
    assert only_problem(["trainer.resume_mode=resume_path"]) == (
        "trainer.resume_mode=resume_path needs trainer.resume_from_path (got null)"
    )
    load_config(None, ["trainer.resume_mode=resume_path", "trainer.resume_from_path=/ckpt/global_step_10"])


def test_validation_sampling_needs_a_temperature() -> None:
    message = only_problem(["actor_rollout_ref.rollout.val_kwargs.do_sample=true"])
    assert "val_kwargs.temperature must be > 0 (got 0.0)" in message


def test_dynamic_batch_budget_must_hold_a_sequence() -> None:
    problems = problems_of(
        [
            "actor_rollout_ref.actor.use_dynamic_bsz=true",
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=600",
        ]
    )
    assert problems[0] == (
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu (600) must hold one whole sequence: "
        "prompt_length + response_length = 512 + 512 = 1024 (use_dynamic_bsz is on)"
    )


def test_param_offload_needs_zero_3() -> None:
    message = only_problem(
        [
            "actor_rollout_ref.actor.fsdp_config.param_offload=true",
            "actor_rollout_ref.actor.deepspeed_config.zero_stage=2",
        ]
    )
    assert "fsdp_config.param_offload" in message and "zero_stage=3 (got 2)" in message
    message = only_problem(
        ["critic.deepspeed_config.offload_optimizer=true", "critic.deepspeed_config.zero_stage=0"]
    )
    assert message.startswith("critic: optimizer offload") and "zero_stage >= 1 (got 0)" in message


def test_disk_weight_sync_needs_a_directory() -> None:
    assert only_problem(["rlmesh.weight_sync.transport=disk"]) == (
        "rlmesh.weight_sync.transport=disk needs rlmesh.weight_sync.disk_dir (got null)"
    )


def test_warmup_ratio_and_its_verl_name_together_fail() -> None:
    message = only_problem(
        [
            "actor_rollout_ref.actor.optim.warmup_ratio=0.1",
            "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.2",
        ]
    )
    assert message.startswith(
        "'actor_rollout_ref.actor.optim': give either 'warmup_ratio' or 'lr_warmup_steps_ratio'"
    )
    assert "warmup_ratio=0.1" in message and "lr_warmup_steps_ratio=0.2" in message


def test_warmup_ratio_range() -> None:
    message = only_problem(["actor_rollout_ref.actor.optim.warmup_ratio=1.5"])
    assert message.startswith("bad value for 'actor_rollout_ref.actor.optim.warmup_ratio': 1.5; must be <= 1")


def test_unresolvable_interpolation(write_yaml: WriteYaml) -> None:
    path = write_yaml("trainer:\n  experiment_name: ${trainer.nope}\n  project_name: ${data.nope}\n")
    problems = problems_of(path=path)
    assert (
        "cannot resolve 'trainer.experiment_name' = '${trainer.nope}': Interpolation key 'trainer.nope' not found"
        in problems
    )
    assert (
        "cannot resolve 'trainer.project_name' = '${data.nope}': Interpolation key 'data.nope' not found"
        in problems
    )
    # verl's default_local_dir interpolates both, so it is reported too: every problem at once
    assert any(p.startswith("cannot resolve 'trainer.default_local_dir'") for p in problems)


def test_verl_required_marker_must_be_filled(write_yaml: WriteYaml) -> None:
    path = write_yaml("actor_rollout_ref:\n  model:\n    path: ???\n")
    assert only_problem(path=path).startswith("'actor_rollout_ref.model.path' is '???'")
    assert load_config(path, ["actor_rollout_ref.model.path=/m"]).actor_rollout_ref.model.path == "/m"


def test_file_problems(tmp_path: Path, write_yaml: WriteYaml) -> None:
    assert only_problem(path=tmp_path / "nope.yaml").startswith("config file not found:")
    assert only_problem(path=write_yaml("data: [1, 2\n")).startswith("cannot parse config file")
    assert "must hold a mapping" in only_problem(path=write_yaml("- a\n- b\n"))
    assert load_config(write_yaml("")) == load_config()  # an empty file is just the defaults


def test_streams_must_hold_the_batches_in_flight() -> None:
    base = [
        "data.train_batch_size=8",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "actor_rollout_ref.rollout.n=4",
        "rlmesh.max_staleness=1",
    ]
    load_config(None, [*base, "rlmesh.queue.trajectory_stream_maxlen=96"])  # 8 x 4 x (1 + 2): fits
    assert only_problem([*base, "rlmesh.queue.trajectory_stream_maxlen=95"]) == (
        "rlmesh.queue.trajectory_stream_maxlen=95 cannot hold the samples in flight: it must be >= "
        "(data.train_batch_size x (rlmesh.max_staleness + 2)) x actor_rollout_ref.rollout.n = 96"
    )
    assert only_problem([*base, "rlmesh.queue.prompt_stream_maxlen=23"]).startswith(
        "rlmesh.queue.prompt_stream_maxlen=23 cannot hold the prompts in flight: it must be >= "
    )
    # Over-provisioning keeps ceil(0.3 x 8) = 3 groups more in flight.
    over = [*base, "rlmesh.over_provision=0.3"]
    load_config(None, [*over, "rlmesh.queue.prompt_stream_maxlen=27"])
    assert only_problem([*over, "rlmesh.queue.prompt_stream_maxlen=26"]) == (
        "rlmesh.queue.prompt_stream_maxlen=26 cannot hold the prompts in flight: it must be >= "
        "data.train_batch_size x (rlmesh.max_staleness + 2) + 3 (rlmesh.over_provision) = 27"
    )


def test_over_provisioning_a_synchronous_run_warns_that_the_extra_groups_come_back_stale() -> None:
    from rlmesh.config.checks import cross_field_warnings

    sync = load_config(None, ["rlmesh.over_provision=0.5"])
    assert any(
        "rlmesh.over_provision=0.5 with rlmesh.max_staleness=0" in n for n in cross_field_warnings(sync)
    )
    ahead = load_config(
        None,
        [
            "rlmesh.over_provision=0.5",
            "rlmesh.max_staleness=1",
            "algorithm.rollout_correction.rollout_is=token",
        ],
    )
    assert not any("over_provision" in n for n in cross_field_warnings(ahead))
    assert "rlmesh.over_provision" in only_problem(["rlmesh.over_provision=-0.1"])
