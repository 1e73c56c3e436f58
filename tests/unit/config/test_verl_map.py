"""verl's other spellings: moved keys land on rlmesh's, verl's engines on rlmesh's, keys that would
change the result if ignored are refused, and each mapping is named in one warning."""

from __future__ import annotations

import warnings

import pytest

from rlmesh.config import ConfigError, ConfigWarning, load_config, verl_map


def _notes(overrides: list[str]) -> tuple[object, str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load_config(None, overrides)
    return cfg, "\n".join(str(w.message) for w in caught if issubclass(w.category, ConfigWarning))


def test_a_moved_key_lands_on_rlmeshs_and_is_named() -> None:
    cfg, notes = _notes(["actor_rollout_ref.rollout.update_weights_bucket_megabytes=128"])
    assert cfg.rlmesh.weight_sync.bucket_size_mb == 128
    assert (
        "actor_rollout_ref.rollout.update_weights_bucket_megabytes=128 -> rlmesh.weight_sync.bucket_size_mb"
        in notes
    )


def test_verls_newer_reward_section_is_read_as_the_older_keys() -> None:
    cfg, notes = _notes(
        [
            "reward.custom_reward_function.path=/tmp/my_reward.py",
            "reward.custom_reward_function.name=score",
            "reward.reward_model.enable=false",
        ]
    )
    assert cfg.custom_reward_function.path == "/tmp/my_reward.py"
    assert cfg.custom_reward_function.name == "score"
    assert "reward.custom_reward_function.path=/tmp/my_reward.py -> custom_reward_function.path" in notes


def test_both_spellings_with_different_values_is_an_error() -> None:
    with pytest.raises(ConfigError, match=r"update_weights_bucket_megabytes.*bucket_size_mb.*set one"):
        load_config(
            None,
            [
                "actor_rollout_ref.rollout.update_weights_bucket_megabytes=128",
                "rlmesh.weight_sync.bucket_size_mb=64",
            ],
        )
    same = [
        "actor_rollout_ref.rollout.update_weights_bucket_megabytes=64",
        "rlmesh.weight_sync.bucket_size_mb=64",
    ]
    assert load_config(None, same).rlmesh.weight_sync.bucket_size_mb == 64


def test_vllm_runs_the_cpu_engine_without_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # a real way to have no GPU, on any machine
    assert not verl_map.gpu_present()
    cfg, notes = _notes(["actor_rollout_ref.rollout.name=vllm"])
    assert cfg.actor_rollout_ref.rollout.name == "embedded"
    assert "actor_rollout_ref.rollout.name=vllm -> embedded (rlmesh has no vLLM engine" in notes
    cfg, notes = _notes([])
    assert cfg.actor_rollout_ref.rollout.name == "embedded" and "rollout.name" not in notes


def test_vllm_or_no_engine_runs_sglang_on_a_gpu_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    # No GPU here: gpu_present is the one thing replaced (its real reading is tested above).
    monkeypatch.setattr(verl_map, "gpu_present", lambda: True)
    cfg, notes = _notes(["actor_rollout_ref.rollout.name=vllm"])
    assert cfg.actor_rollout_ref.rollout.name == "sglang"
    assert "name=vllm -> sglang" in notes
    cfg, notes = _notes([])
    assert cfg.actor_rollout_ref.rollout.name == "sglang"
    assert "actor_rollout_ref.rollout.name=(not set) -> sglang" in notes
    cfg, _ = _notes(["actor_rollout_ref.rollout.name=hf"])
    assert cfg.actor_rollout_ref.rollout.name == "embedded"
    cfg, notes = _notes(["actor_rollout_ref.rollout.name=embedded"])
    assert cfg.actor_rollout_ref.rollout.name == "embedded" and "rollout.name" not in notes


def test_verls_required_marker_on_the_engine_picks_one(tmp_path: object) -> None:
    from pathlib import Path

    path = Path(str(tmp_path)) / "c.yaml"
    path.write_text("actor_rollout_ref:\n  rollout:\n    name: ???\n")
    assert (
        load_config(path, ["actor_rollout_ref.rollout.name=embedded"]).actor_rollout_ref.rollout.name
        == "embedded"
    )


@pytest.mark.parametrize(
    ("override", "names"),
    [
        ("reward_model.sandbox_fusion.url=http://127.0.0.1:8080/run_code", "sandbox"),
        ("+sandbox_fusion.url=http://127.0.0.1:8080/run_code", "sandbox"),
        ("actor_rollout_ref.rollout.multi_turn.enable=true", "multi-turn"),
        ("data.tool_config_path=tools.yaml", "multi-turn"),
        ("data.custom_cls.path=my_dataset.py", "Parquet"),
        ("actor_rollout_ref.ref.model={path: other}", "reference"),
        ("algorithm.rollout_correction.rollout_token_veto_threshold=1e-4", "veto"),
        ("algorithm.rollout_correction.use_policy_gradient=true", "gpg"),
        ("distillation.enabled=true", "distillation"),
        ("actor_rollout_ref.model.lora.rank=8", "lora_rank"),
        ("trainer.v1.trainer_mode=separate_async", "max_staleness"),
        ("actor_rollout_ref.actor.qat.enable=true", "quantisation"),
    ],
)
def test_a_key_that_would_change_the_result_is_refused_unless_default(override: str, names: str) -> None:
    key = override.lstrip("+").split("=")[0].replace("sandbox_fusion", "reward_model.sandbox_fusion", 1)
    key = key.replace("reward_model.reward_model.", "reward_model.")
    with pytest.raises(ConfigError, match=f"'{key}'.*not supported.*{names}"):
        load_config(None, [override])


def test_refused_keys_load_at_their_defaults() -> None:
    load_config(
        None,
        [
            "actor_rollout_ref.rollout.multi_turn.enable=false",
            "distillation.enabled=false",
            "actor_rollout_ref.model.lora.rank=0",
            "trainer.v1.trainer_mode=sync",
            "algorithm.rollout_correction.rollout_token_veto_threshold=null",
        ],
    )


def test_vllm_engine_kwargs_are_named_not_passed() -> None:
    cfg, notes = _notes(
        [
            "+actor_rollout_ref.rollout.engine_kwargs.vllm.swap_space=32",
            "+actor_rollout_ref.rollout.engine_kwargs.sglang.attention_backend=fa3",
        ]
    )
    assert "vllm" not in cfg.actor_rollout_ref.rollout.engine_kwargs
    assert cfg.actor_rollout_ref.rollout.engine_kwargs["sglang"] == {"attention_backend": "fa3"}
    assert 'engine_kwargs.vllm={"swap_space": 32} -> nothing' in notes


def test_gen_batch_size_is_refused_unless_dynamic_sampling_or_equal() -> None:
    with pytest.raises(ConfigError, match=r"'data.gen_batch_size'=96 .*data.train_batch_size=96"):
        load_config(None, ["data.gen_batch_size=96", "data.train_batch_size=256"])
    load_config(None, ["data.gen_batch_size=256", "data.train_batch_size=256"], warn=False)
    dapo = ["data.gen_batch_size=96", "data.train_batch_size=256", "algorithm.filter_groups.enable=true"]
    assert load_config(None, dapo, warn=False).data.train_batch_size == 256


def test_verl_07s_top_level_reward_manager_name_is_the_manager() -> None:
    cfg, notes = _notes(["+reward_manager.name=dapo"])
    assert cfg.reward_model.reward_manager == "dapo"
    assert "reward_manager.name=dapo -> reward_model.reward_manager" in notes
