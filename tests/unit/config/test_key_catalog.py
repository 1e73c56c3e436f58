"""config_keys() and keys_markdown_table(): every key, with type, default and a description."""

from __future__ import annotations

from rlmesh.config import COMPAT_DESCRIPTION, config_keys, keys_markdown_table, load_config
from rlmesh.config.base import STRATEGY_DESCRIPTION


def test_every_key_has_a_one_line_description() -> None:
    keys = config_keys()
    assert len({k.key for k in keys}) == len(keys)
    for item in keys:
        assert item.description, item.key
        assert "\n" not in item.description, item.key
        # Ignored keys share one description (their reasons are in rlmesh.config.ignored); a
        # role's strategy is ignored too but keeps its own, which names what it maps to.
        assert item.compat == (item.description in (COMPAT_DESCRIPTION, STRATEGY_DESCRIPTION)), item.key


def test_keys_cover_the_documented_sections() -> None:
    names = {k.key for k in config_keys()}
    for key in [
        "data.train_batch_size",
        "actor_rollout_ref.actor.clip_ratio",
        "actor_rollout_ref.actor.deepspeed_config.zero_stage",
        "actor_rollout_ref.rollout.sglang.url",
        "critic.deepspeed_config.offload_param",
        "algorithm.kl_ctrl.type",
        "algorithm.rollout_correction.rollout_is_threshold",
        "trainer.default_local_dir",
        "rlmesh.reward.addresses",
        "rlmesh.control.metrics_port",
        "rlmesh.weight_sync.verify_tensors",
        "rlmesh.queue.heartbeat_ttl_s",
        "actor_rollout_ref.actor.use_torch_compile",
    ]:
        assert key in names, key


def test_key_metadata() -> None:
    by_key = {k.key: k for k in config_keys()}
    clip = by_key["actor_rollout_ref.actor.clip_ratio"]
    assert (clip.type, clip.default, clip.compat) == ("float (>= 0)", 0.2, False)
    assert by_key["algorithm.kl_ctrl.type"].type == "'fixed' | 'adaptive'"
    assert by_key["rlmesh.control.port"].default == 8000
    assert by_key["actor_rollout_ref.actor.optim.lr_warmup_steps_ratio"].aliases == ("warmup_ratio",)
    assert (
        by_key["trainer.default_local_dir"].default
        == "checkpoints/${trainer.project_name}/${trainer.experiment_name}"
    )
    assert by_key["actor_rollout_ref.rollout.disable_log_stats"].compat


def test_markdown_table_lists_every_key_with_its_default() -> None:
    table = keys_markdown_table()
    lines = table.splitlines()
    assert lines[0] == "| key | type | default | description |"
    for item in config_keys():
        row = next((line for line in lines if line.startswith(f"| `{item.key}` |")), None)
        assert row is not None, item.key
    assert "| `actor_rollout_ref.actor.clip_ratio` | float (>= 0) | `0.2` | PPO clip range epsilon |" in lines
    assert "| `trainer.logger` | list['console' \\| 'wandb'" in table
    assert '`["console", "wandb"]`' in table


def test_markdown_table_without_compat_keys() -> None:
    table = keys_markdown_table(include_compat=False)
    assert "`actor_rollout_ref.actor.clip_ratio`" in table
    assert "`actor_rollout_ref.rollout.disable_log_stats`" not in table


def test_every_key_can_be_set_by_override() -> None:
    # Each listed key is a real path: setting it to its own default is accepted.
    overrides = []
    for item in config_keys():
        if item.default is None or isinstance(item.default, (bool, int, float)):
            value = "null" if item.default is None else str(item.default).lower()
            overrides.append(f"{item.key}={value}")
    load_config(None, overrides)


def test_the_reward_function_choices_are_the_built_ins() -> None:
    from typing import get_args

    from rlmesh.config.rlmesh_section import RewardServiceConfig
    from rlmesh.reward.builtin import BUILTIN_FUNCTIONS

    choices = get_args(get_args(RewardServiceConfig.model_fields["function"].annotation)[0])
    assert set(choices) == set(BUILTIN_FUNCTIONS)


def test_service_settings_have_keys_and_keep_their_ports() -> None:
    cfg = load_config(None, ["rlmesh.reward.workers=4", "rlmesh.reference.dtype=bfloat16"])
    assert cfg.rlmesh.reward.workers == 4 and cfg.rlmesh.reward.port == 50051
    assert cfg.rlmesh.reference.dtype == "bfloat16" and cfg.rlmesh.reference.max_batch_size == 1024
