"""load_config: defaults <- YAML file <- overrides, interpolation, aliases, verl compatibility, dumping."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path

import pytest

from rlmesh.config import (
    ConfigError,
    ConfigWarning,
    RLMeshConfig,
    ServiceConfig,
    config_from_dict,
    dump_yaml,
    load_config,
)
from tests.support.repo import CPU_DEMO

WriteYaml = Callable[[str], Path]


def test_file_then_overrides_take_precedence(write_yaml: WriteYaml) -> None:
    path = write_yaml(
        """
actor_rollout_ref:
  actor:
    clip_ratio: 0.3
    optim:
      lr: 2.0e-6
data:
  train_batch_size: 512
"""
    )
    cfg = load_config(path, ["actor_rollout_ref.actor.clip_ratio=0.25", "data.max_prompt_length=256"])
    actor = cfg.actor_rollout_ref.actor
    assert actor.clip_ratio == 0.25  # override beats file
    assert actor.optim.lr == 2e-6  # file beats default
    assert cfg.data.train_batch_size == 512
    assert cfg.data.max_prompt_length == 256  # override beats default
    assert actor.clip_ratio_c == 3.0  # untouched default


def test_later_override_wins_and_path_may_be_str_or_pathlike(write_yaml: WriteYaml) -> None:
    path = write_yaml("trainer:\n  total_epochs: 2\n")
    cfg = load_config(str(path), ["trainer.total_epochs=3", "trainer.total_epochs=4"])
    assert cfg.trainer.total_epochs == 4


def test_override_values_parse_like_omegaconf_dotlist() -> None:
    cfg = load_config(
        None,
        [
            "actor_rollout_ref.actor.optim.lr=1e-6",
            "data.train_files=/x.parquet",
            "data.val_files=null",
            "algorithm.use_kl_in_reward=True",
            "rlmesh.queue.prompt_stream_maxlen=1e5",
        ],
    )
    assert cfg.actor_rollout_ref.actor.optim.lr == 1e-6
    assert isinstance(cfg.actor_rollout_ref.actor.optim.lr, float)
    assert cfg.data.train_files == "/x.parquet"
    assert cfg.data.val_files is None
    assert cfg.algorithm.use_kl_in_reward is True
    assert cfg.rlmesh.queue.prompt_stream_maxlen == 100_000


def test_list_overrides() -> None:
    cfg = load_config(
        None,
        [
            "trainer.logger=['console','wandb']",
            "data.train_files=[/a.parquet,/b.parquet]",
            "rlmesh.rollout.addresses=['10.0.0.1:50053','10.0.0.2:50053']",
        ],
    )
    assert cfg.trainer.logger == ["console", "wandb"]
    assert cfg.data.train_files == ["/a.parquet", "/b.parquet"]
    assert cfg.rlmesh.rollout.client_addresses() == ["10.0.0.1:50053", "10.0.0.2:50053"]
    assert load_config(None, ["trainer.logger=console"]).trainer.logger == ["console"]
    assert load_config(None, ["trainer.logger=[console]"]).trainer.logger == ["console"]


def test_hydra_plus_prefixes_are_accepted() -> None:
    cfg = load_config(None, ["+data.seed=7", "++trainer.save_freq=10", "+rlmesh.run_id=abc"])
    assert (cfg.data.seed, cfg.trainer.save_freq, cfg.rlmesh.run_id) == (7, 10, "abc")


def test_overrides_accept_a_tuple_or_a_lone_string() -> None:
    assert load_config(None, ("data.seed=3",)).data.seed == 3
    assert load_config(None, "data.seed=4").data.seed == 4  # type: ignore[arg-type]


def test_interpolation_in_yaml_file(write_yaml: WriteYaml) -> None:
    path = write_yaml(
        """
data:
  max_prompt_length: 100
  max_response_length: ${data.max_prompt_length}
trainer:
  project_name: proj
  experiment_name: bs${data.train_batch_size}-${oc.select:trainer.missing,fallback}
actor_rollout_ref:
  rollout:
    prompt_length: ${data.max_prompt_length}
"""
    )
    cfg = load_config(path)
    assert cfg.data.max_response_length == 100
    assert cfg.trainer.experiment_name == "bs1024-fallback"  # refers to a default not in the file
    assert cfg.actor_rollout_ref.rollout.prompt_length == 100
    # verl's default_local_dir interpolates the names the user chose
    assert cfg.trainer.default_local_dir == "checkpoints/proj/bs1024-fallback"


def test_interpolation_sees_overrides(write_yaml: WriteYaml) -> None:
    path = write_yaml("trainer:\n  default_local_dir: /ckpt/${trainer.experiment_name}\n")
    cfg = load_config(path, ["trainer.experiment_name=run7"])
    assert cfg.trainer.default_local_dir == "/ckpt/run7"
    cfg = load_config(None, ["trainer.default_local_dir=/data/${trainer.project_name}"])
    assert cfg.trainer.default_local_dir == "/data/verl_examples"


def test_derived_values_follow_their_source_key() -> None:
    cfg = load_config(
        None,
        [
            "data.max_prompt_length=128",
            "data.max_response_length=64",
            "data.train_batch_size=128",
            "actor_rollout_ref.actor.ppo_mini_batch_size=32",
            "actor_rollout_ref.actor.ppo_epochs=2",
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=4096",
            "actor_rollout_ref.model.path=/m",
            "critic.ppo_max_token_len_per_gpu=2048",
        ],
    )
    rollout, critic = cfg.actor_rollout_ref.rollout, cfg.critic
    assert (rollout.prompt_length, rollout.response_length) == (128, 64)
    assert rollout.log_prob_max_token_len_per_gpu == 4096
    assert cfg.actor_rollout_ref.ref.log_prob_max_token_len_per_gpu == 4096
    assert (critic.ppo_mini_batch_size, critic.ppo_epochs) == (32, 2)
    assert critic.forward_max_token_len_per_gpu == 2048
    assert critic.model.tokenizer_path == "/m"
    assert cfg.reward_model.model.input_tokenizer == "/m"
    assert cfg.tokenizer_path() == "/m"


def test_an_explicit_derived_value_wins() -> None:
    cfg = load_config(
        None,
        [
            "actor_rollout_ref.rollout.response_length=100",
            "critic.ppo_mini_batch_size=128",
            "actor_rollout_ref.actor.clip_ratio_high=0.28",
        ],
    )
    assert cfg.actor_rollout_ref.rollout.response_length == 100
    assert cfg.data.max_response_length == 512
    assert cfg.critic.ppo_mini_batch_size == 128
    assert cfg.actor_rollout_ref.actor.ppo_mini_batch_size == 256
    assert cfg.actor_rollout_ref.actor.clip_ratio_high == 0.28


def test_warmup_ratio_is_an_alias(write_yaml: WriteYaml) -> None:
    cfg = load_config(None, ["actor_rollout_ref.actor.optim.warmup_ratio=0.1"])
    assert cfg.actor_rollout_ref.actor.optim.lr_warmup_steps_ratio == 0.1
    path = write_yaml("critic:\n  optim:\n    warmup_ratio: 0.05\n")
    assert load_config(path).critic.optim.lr_warmup_steps_ratio == 0.05
    cfg = load_config(None, ["actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.2"])
    assert cfg.actor_rollout_ref.actor.optim.lr_warmup_steps_ratio == 0.2
    assert cfg.actor_rollout_ref.actor.optim.warmup_steps(100) == 20


def test_deprecated_warmup_style_sets_the_scheduler() -> None:
    optim = load_config(
        None, ["actor_rollout_ref.actor.optim.warmup_style=cosine"]
    ).actor_rollout_ref.actor.optim
    assert optim.lr_scheduler_type == "cosine"


def test_fsdp_offload_flags_map_to_zero_offload() -> None:
    cfg = load_config(
        None,
        [
            "actor_rollout_ref.actor.fsdp_config.param_offload=true",
            "actor_rollout_ref.actor.fsdp_config.optimizer_offload=true",
            "critic.model.fsdp_config.optimizer_offload=true",
            "critic.deepspeed_config.zero_stage=2",
        ],
    )
    actor = cfg.actor_rollout_ref.actor.effective_engine()
    assert (actor.zero_stage, actor.offload_param, actor.offload_optimizer) == (3, True, True)
    critic = cfg.critic.effective_engine()
    assert (critic.zero_stage, critic.offload_param, critic.offload_optimizer) == (2, False, True)


def test_deepspeed_config_beats_the_fsdp_flag_it_maps_from() -> None:
    cfg = load_config(
        None,
        [
            "actor_rollout_ref.actor.fsdp_config.param_offload=true",
            "actor_rollout_ref.actor.deepspeed_config.offload_param=false",
            "actor_rollout_ref.actor.fsdp_config.dtype=fp16",
            "actor_rollout_ref.actor.deepspeed_config.dtype=bf16",
        ],
    )
    eff = cfg.actor_rollout_ref.actor.effective_engine()
    assert (eff.offload_param, eff.dtype) == (False, "bfloat16")
    assert cfg.actor_rollout_ref.actor.fsdp_config.dtype == "float16"  # verl's short names normalised


VERL_STYLE = """
# the kind of file a verl user brings: _target_ markers, interpolations, keys rlmesh ignores
defaults:
  - ppo_trainer
  - _self_
data:
  train_files: /data/gsm8k/train.parquet
  val_files: [/data/gsm8k/test.parquet, /data/math/test.parquet]
  train_batch_size: 256
  max_prompt_length: 1024
  max_response_length: 2048
  filter_overlong_prompts: true
  truncation: left
  return_raw_chat: true
  dataloader_num_workers: 4
actor_rollout_ref:
  hybrid_engine: true
  model:
    path: Qwen/Qwen2.5-7B-Instruct
    use_remove_padding: true
    use_fused_kernels: false
  actor:
    _target_: verl.workers.config.FSDPActorConfig
    strategy: fsdp2
    ppo_mini_batch_size: 64
    ppo_micro_batch_size_per_gpu: 8
    use_kl_loss: true
    kl_loss_coef: 0.001
    kl_loss_type: low_var_kl
    entropy_coeff: 0
    use_torch_compile: false
    ulysses_sequence_parallel_size: 1
    checkpoint:
      save_contents: [model, optimizer, extra]
      load_contents: ${.save_contents}
    optim:
      _target_: verl.workers.config.FSDPOptimizerConfig
      lr: 1e-6
      clip_grad: 1.0
    fsdp_config:
      _target_: verl.workers.config.FSDPEngineConfig
      param_offload: true
      optimizer_offload: true
      wrap_policy:
        min_num_params: 0
      model_dtype: fp32
    profiler:
      tool: ${oc.select:global_profiler.tool,null}
      enable: false
  rollout:
    _target_: verl.workers.config.RolloutConfig
    name: sglang
    mode: async
    n: 5
    tensor_model_parallel_size: 2
    gpu_memory_utilization: 0.6
    enforce_eager: false
    free_cache_engine: true
    enable_chunked_prefill: true
    log_prob_micro_batch_size_per_gpu: 16
    engine_kwargs:
      sglang:
        attention_backend: flashinfer
    multi_turn:
      enable: false
      format: hermes
    agent:
      name: ???
    val_kwargs:
      _target_: verl.workers.config.SamplingConfig
      temperature: 0
      n: 1
  ref:
    log_prob_micro_batch_size_per_gpu: 16
    fsdp_config:
      param_offload: true
algorithm:
  _target_: verl.trainer.config.AlgoConfig
  adv_estimator: grpo
  use_kl_in_reward: false
  kl_ctrl:
    _target_: verl.trainer.config.KLControlConfig
    kl_coef: 0.001
trainer:
  balance_batch: true
  critic_warmup: 0
  logger: ['console', 'wandb']
  project_name: verl_grpo_example_gsm8k
  experiment_name: qwen2_7b_function_rm
  n_gpus_per_node: 8
  nnodes: 1
  save_freq: 20
  test_freq: 5
  total_epochs: 15
  val_before_train: false
  del_local_ckpt_after_load: false
global_profiler:
  tool: null
  steps: null
ray_kwargs:
  ray_init:
    num_cpus: null
"""


def test_a_verl_style_config_loads(write_yaml: WriteYaml) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load_config(write_yaml(VERL_STYLE))
    # These settings are all legal: the one warning names the keys rlmesh ignores.
    assert len(caught) == 1 and issubclass(caught[0].category, ConfigWarning), [
        str(w.message) for w in caught
    ]
    assert "accepted but ignored by rlmesh" in str(caught[0].message)
    assert "\n  actor_rollout_ref.actor.strategy=fsdp2: " in str(caught[0].message)
    arr = cfg.actor_rollout_ref
    assert arr.rollout.name == "sglang"
    assert arr.actor.strategy == "fsdp2"
    assert cfg.algorithm.adv_estimator == "grpo"
    assert not cfg.uses_critic() and cfg.uses_reference()
    assert cfg.data.val_files == ["/data/gsm8k/test.parquet", "/data/math/test.parquet"]
    assert arr.actor.effective_engine().offload_param is True
    assert arr.ref.fsdp_config.param_offload is True
    assert arr.actor.checkpoint["load_contents"] == ["model", "optimizer", "extra"]  # compat, still resolved
    assert cfg.trainer.default_local_dir == "checkpoints/verl_grpo_example_gsm8k/qwen2_7b_function_rm"


def test_megatron_strategy_loads_with_a_warning() -> None:
    with pytest.warns(ConfigWarning, match=r"actor_rollout_ref\.actor\.strategy=megatron"):
        cfg = load_config(None, ["actor_rollout_ref.actor.strategy=megatron"])
    assert cfg.actor_rollout_ref.actor.strategy == "megatron"


def test_kl_in_reward_and_kl_loss_together_warn() -> None:
    with pytest.warns(ConfigWarning, match="use_kl_in_reward and actor_rollout_ref.actor.use_kl_loss"):
        load_config(None, ["algorithm.use_kl_in_reward=true", "actor_rollout_ref.actor.use_kl_loss=true"])


def test_auth_token_from_env_when_the_key_is_null(
    monkeypatch: pytest.MonkeyPatch, write_yaml: WriteYaml
) -> None:
    assert load_config().rlmesh.auth_token is None
    monkeypatch.setenv("RLMESH_AUTH_TOKEN", "s3cret")
    assert load_config().rlmesh.token() == "s3cret"
    assert load_config(write_yaml("rlmesh:\n  auth_token: null\n")).rlmesh.token() == "s3cret"
    assert load_config(None, ["rlmesh.auth_token=from-cli"]).rlmesh.token() == "from-cli"
    monkeypatch.setenv("RLMESH_AUTH_TOKEN", "")
    assert load_config().rlmesh.auth_token is None


def test_service_sections(write_yaml: WriteYaml) -> None:
    path = write_yaml("rlmesh:\n  learner:\n    host: 0.0.0.0\n  reward:\n    port: 0\n    metrics_port: 0\n")
    cfg = load_config(path, ["rlmesh.log_level=debug"])
    learner = cfg.rlmesh.learner
    assert (learner.host, learner.port, learner.metrics_port) == ("0.0.0.0", 50054, 9104)
    assert learner.client_addresses() == ["127.0.0.1:50054"]  # a wildcard bind is dialled on loopback
    assert (cfg.rlmesh.reward.port, cfg.rlmesh.reward.metrics_port) == (0, 0)
    assert cfg.rlmesh.log_level == "DEBUG"
    assert set(cfg.rlmesh.services()) == {"reward", "reference", "rollout", "learner", "control"}
    assert ServiceConfig(host="::1", port=1, metrics_port=2).client_addresses() == ["[::1]:1"]
    # Built in Python, a partial service section keeps its own default ports too.
    assert RLMeshConfig(rlmesh={"control": {"host": "h"}}).rlmesh.control.port == 8000


def test_cpu_demo_is_valid_and_quiet() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = load_config(CPU_DEMO)
    assert cfg.actor_rollout_ref.rollout.name == "embedded"
    assert cfg.trainer.device == "cpu"
    assert cfg.trainer.default_local_dir == "runs/demo/checkpoints/cpu_demo"
    assert cfg.actor_rollout_ref.actor.optim.lr_warmup_steps_ratio == 0.1


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        ["trainer.logger=[console]", "data.train_files=[/a,/b]", "rlmesh.auth_token=tok"],
        [
            "actor_rollout_ref.actor.optim.warmup_ratio=0.3",
            "actor_rollout_ref.actor.optim.warmup_style=cosine",
        ],
        [
            "actor_rollout_ref.rollout.response_length=7",
            "rlmesh.reward.addresses=[a:1]",
            "rlmesh.max_staleness=2",
        ],
    ],
)
def test_dump_yaml_round_trips(overrides: list[str], tmp_path: Path) -> None:
    cfg = load_config(CPU_DEMO, overrides)
    path = tmp_path / "dumped.yaml"
    path.write_text(dump_yaml(cfg))
    assert load_config(path) == cfg


def test_dump_yaml_round_trips_a_full_verl_style_config(write_yaml: WriteYaml) -> None:
    cfg = load_config(write_yaml(VERL_STYLE))
    assert load_config(write_yaml(dump_yaml(cfg))) == cfg


def test_a_null_section_keeps_its_defaults(write_yaml: WriteYaml) -> None:
    cfg = load_config(write_yaml("algorithm:\n  rollout_correction: null\n  kl_ctrl:\n"))
    assert cfg.algorithm.rollout_correction.rollout_is_threshold == 2.0
    assert cfg.algorithm.kl_ctrl.kl_coef == 0.001


def test_config_from_dict() -> None:
    cfg = config_from_dict(
        {"data": {"train_batch_size": 512}, "actor_rollout_ref": {"actor": {"_target_": "x"}}}
    )
    assert cfg.data.train_batch_size == 512


def test_verls_gpu_count_sets_the_learner_ranks_when_ranks_is_not_given() -> None:
    """With the CPU engine the replicas take no GPU: the learner gets them all (the split with
    SGLang replicas: test_placement.py)."""

    def ranks(*overrides: str) -> int:
        return load_config(None, ["actor_rollout_ref.rollout.name=embedded", *overrides]).rlmesh.learner.ranks

    assert ranks("trainer.n_gpus_per_node=4") == 4
    assert ranks("trainer.n_gpus_per_node=4", "rlmesh.learner.ranks=2") == 2
    assert ranks("trainer.n_gpus_per_node=0") == 1  # a CPU run
    assert ranks() == 1  # verl's default 8 is not a request
    # verl's multi-node lines load; the warning says the launcher starts one node's ranks
    with pytest.warns(ConfigWarning, match=r"trainer\.nnodes=2: .*torchrun.*rlmesh\.learner\.ranks"):
        assert ranks("trainer.n_gpus_per_node=8", "trainer.nnodes=2") == 8
    assert ranks("trainer.n_gpus_per_node=8", "trainer.nnodes=2", "rlmesh.learner.ranks=8") == 8


def test_optim_clip_grad_is_verls_newer_name_of_grad_clip() -> None:
    actor = "actor_rollout_ref.actor"
    assert load_config(None, []).actor_rollout_ref.actor.grad_clip == 1.0
    assert load_config(None, [f"{actor}.optim.clip_grad=0.3"]).actor_rollout_ref.actor.grad_clip == 0.3
    assert load_config(None, ["critic.optim.clip_grad=0.2"]).critic.grad_clip == 0.2
    assert load_config(None, [f"{actor}.grad_clip=0.5"]).actor_rollout_ref.actor.optim.clip_grad == 0.5
    assert (
        load_config(
            None, [f"{actor}.grad_clip=0.5", f"{actor}.optim.clip_grad=0.5"]
        ).actor_rollout_ref.actor.grad_clip
        == 0.5
    )
    with pytest.raises(ConfigError, match=r"actor\.grad_clip \(0\.5\) and .*optim\.clip_grad \(0\.3\)"):
        load_config(None, [f"{actor}.grad_clip=0.5", f"{actor}.optim.clip_grad=0.3"])


def test_an_async_run_without_is_correction_is_warned() -> None:
    with pytest.warns(ConfigWarning, match=r"rlmesh\.max_staleness=1 .*rollout_is=token"):
        load_config(None, ["rlmesh.max_staleness=1"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_config(None, ["rlmesh.max_staleness=1", "algorithm.rollout_correction.rollout_is=token"])
        load_config(None, ["rlmesh.max_staleness=0"])


def test_a_home_relative_checkpoint_directory_is_expanded_for_every_process() -> None:
    cfg = load_config(
        None, ["trainer.default_local_dir=~/ckpt/${trainer.experiment_name}", "trainer.experiment_name=x"]
    )
    assert cfg.trainer.default_local_dir == str(Path.home() / "ckpt" / "x")
