"""Defaults equal verl's ppo_trainer.yaml (as composed by Hydra; values read from verl's
verl/trainer/config/*.yaml and its flattened _generated_ppo_trainer.yaml)."""

from __future__ import annotations

from typing import Any

import pytest

from rlmesh.config import SERVICE_PORTS, RLMeshConfig, load_config

# key -> verl's default, with the file it comes from.
VERL_DEFAULTS: dict[str, Any] = {
    # data/legacy_data.yaml
    "data.tokenizer": None,
    "data.train_files": "~/data/rlhf/gsm8k/train.parquet",
    "data.val_files": "~/data/rlhf/gsm8k/test.parquet",
    "data.prompt_key": "prompt",
    "data.reward_fn_key": "data_source",
    "data.max_prompt_length": 512,
    "data.max_response_length": 512,
    "data.train_batch_size": 1024,
    "data.val_batch_size": None,
    "data.shuffle": True,
    "data.seed": None,
    "data.filter_overlong_prompts": False,
    "data.truncation": "error",
    "data.train_max_samples": -1,
    "data.val_max_samples": -1,
    # model/hf_model.yaml
    "actor_rollout_ref.model.path": "~/models/deepseek-llm-7b-chat",
    "actor_rollout_ref.model.trust_remote_code": False,
    "actor_rollout_ref.model.override_config": {},
    "actor_rollout_ref.model.enable_gradient_checkpointing": True,
    "actor_rollout_ref.model.use_remove_padding": True,
    "actor_rollout_ref.model.lora_rank": 0,
    "actor_rollout_ref.model.lora_alpha": 16,
    "actor_rollout_ref.model.target_modules": "all-linear",
    # actor/actor.yaml + actor/dp_actor.yaml
    "actor_rollout_ref.actor.strategy": "fsdp",
    "actor_rollout_ref.actor.ppo_mini_batch_size": 256,
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": None,
    "actor_rollout_ref.actor.use_dynamic_bsz": False,
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": 16384,
    "actor_rollout_ref.actor.clip_ratio": 0.2,
    "actor_rollout_ref.actor.clip_ratio_low": 0.2,
    "actor_rollout_ref.actor.clip_ratio_high": 0.2,
    "actor_rollout_ref.actor.clip_ratio_c": 3.0,
    "actor_rollout_ref.actor.loss_agg_mode": "token-mean",
    "actor_rollout_ref.actor.entropy_coeff": 0,
    "actor_rollout_ref.actor.use_kl_loss": False,
    "actor_rollout_ref.actor.kl_loss_coef": 0.001,
    "actor_rollout_ref.actor.kl_loss_type": "low_var_kl",
    "actor_rollout_ref.actor.ppo_epochs": 1,
    "actor_rollout_ref.actor.shuffle": False,
    "actor_rollout_ref.actor.grad_clip": 1.0,
    "actor_rollout_ref.actor.policy_loss.loss_mode": "vanilla",
    # actor/actor.yaml optim over optim/fsdp.yaml
    "actor_rollout_ref.actor.optim.lr": 1e-6,
    "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio": 0.0,
    "actor_rollout_ref.actor.optim.lr_warmup_steps": -1,
    "actor_rollout_ref.actor.optim.weight_decay": 0.01,
    "actor_rollout_ref.actor.optim.betas": (0.9, 0.999),
    "actor_rollout_ref.actor.optim.min_lr_ratio": 0.0,
    "actor_rollout_ref.actor.optim.num_cycles": 0.5,
    "actor_rollout_ref.actor.optim.lr_scheduler_type": "constant",
    "actor_rollout_ref.actor.optim.warmup_style": None,
    # engine/fsdp.yaml
    "actor_rollout_ref.actor.fsdp_config.param_offload": False,
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload": False,
    "actor_rollout_ref.actor.fsdp_config.dtype": "bfloat16",
    "actor_rollout_ref.ref.fsdp_config.param_offload": False,
    # rollout/rollout.yaml (prompt/response_length: ${oc.select:data.max_*_length,512})
    "actor_rollout_ref.rollout.temperature": 1.0,
    "actor_rollout_ref.rollout.top_k": -1,
    "actor_rollout_ref.rollout.top_p": 1.0,
    "actor_rollout_ref.rollout.prompt_length": 512,
    "actor_rollout_ref.rollout.response_length": 512,
    "actor_rollout_ref.rollout.dtype": "bfloat16",
    "actor_rollout_ref.rollout.gpu_memory_utilization": 0.5,
    "actor_rollout_ref.rollout.ignore_eos": False,
    "actor_rollout_ref.rollout.tensor_model_parallel_size": 2,
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": None,
    "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz": False,
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu": 16384,
    "actor_rollout_ref.rollout.do_sample": True,
    "actor_rollout_ref.rollout.n": 1,
    "actor_rollout_ref.rollout.val_kwargs.top_k": -1,
    "actor_rollout_ref.rollout.val_kwargs.top_p": 1.0,
    "actor_rollout_ref.rollout.val_kwargs.temperature": 0,
    "actor_rollout_ref.rollout.val_kwargs.n": 1,
    "actor_rollout_ref.rollout.val_kwargs.do_sample": False,
    # ref/ref.yaml
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": None,
    "actor_rollout_ref.ref.log_prob_use_dynamic_bsz": False,
    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu": 16384,
    # critic/critic.yaml + critic/dp_critic.yaml (mini-batch, epochs, … follow the actor)
    "critic.enable": None,
    "critic.optim.lr": 1e-5,
    "critic.optim.weight_decay": 0.01,
    "critic.model.path": "~/models/deepseek-llm-7b-chat",
    "critic.model.tokenizer_path": "~/models/deepseek-llm-7b-chat",
    "critic.model.enable_gradient_checkpointing": True,
    "critic.model.fsdp_config.param_offload": False,
    "critic.ppo_mini_batch_size": 256,
    "critic.ppo_micro_batch_size_per_gpu": None,
    "critic.use_dynamic_bsz": False,
    "critic.ppo_max_token_len_per_gpu": 32768,
    "critic.forward_max_token_len_per_gpu": 32768,
    "critic.forward_micro_batch_size_per_gpu": None,
    "critic.ppo_epochs": 1,
    "critic.shuffle": False,
    "critic.cliprange_value": 0.5,
    "critic.loss_agg_mode": "token-mean",
    "critic.grad_clip": 1.0,
    # reward_model/reward_model.yaml + dp_reward_loop.yaml
    "reward_model.enable": False,
    "reward_model.model.path": "~/models/FsfairX-LLaMA3-RM-v0.1",
    "reward_model.model.input_tokenizer": "~/models/deepseek-llm-7b-chat",
    "reward_model.micro_batch_size_per_gpu": None,
    "reward_model.max_length": None,
    "reward_model.reward_manager": "naive",
    # ppo_trainer.yaml
    "custom_reward_function.path": None,
    "custom_reward_function.name": "compute_score",
    "algorithm.gamma": 1.0,
    "algorithm.lam": 1.0,
    "algorithm.adv_estimator": "gae",
    "algorithm.norm_adv_by_std_in_grpo": True,
    "algorithm.use_kl_in_reward": False,
    "algorithm.kl_penalty": "kl",
    "algorithm.kl_ctrl.type": "fixed",
    "algorithm.kl_ctrl.kl_coef": 0.001,
    "algorithm.kl_ctrl.horizon": 10000,
    "algorithm.kl_ctrl.target_kl": 0.1,
    "algorithm.use_pf_ppo": False,
    # algorithm/rollout_correction.yaml
    "algorithm.rollout_correction.rollout_is": None,
    "algorithm.rollout_correction.rollout_is_threshold": 2.0,
    # ppo_trainer.yaml trainer
    "trainer.total_epochs": 30,
    "trainer.total_training_steps": None,
    "trainer.project_name": "verl_examples",
    "trainer.experiment_name": "gsm8k",
    "trainer.logger": ["console", "wandb"],
    "trainer.nnodes": 1,
    "trainer.n_gpus_per_node": 8,
    "trainer.save_freq": -1,
    "trainer.resume_mode": "auto",
    "trainer.resume_from_path": None,
    "trainer.val_before_train": True,
    "trainer.test_freq": -1,
    "trainer.critic_warmup": 0,
    "trainer.default_local_dir": "checkpoints/verl_examples/gsm8k",
    "trainer.max_actor_ckpt_to_keep": None,
    "trainer.device": "cuda",
    "trainer.balance_batch": True,
    # verl 0.9.1's _generated_ppo_trainer.yaml: the keys issue 29 made act
    "actor_rollout_ref.rollout.enforce_eager": False,
    "actor_rollout_ref.rollout.max_num_batched_tokens": 8192,
    "actor_rollout_ref.rollout.max_model_len": None,
    "actor_rollout_ref.rollout.max_num_seqs": 256,
    "actor_rollout_ref.rollout.enable_chunked_prefill": True,
    "actor_rollout_ref.rollout.enable_prefix_caching": True,
    "actor_rollout_ref.actor.policy_loss.clip_cov_ratio": 0.0002,
    "actor_rollout_ref.actor.policy_loss.clip_cov_lb": 1.0,
    "actor_rollout_ref.actor.policy_loss.clip_cov_ub": 5.0,
    "actor_rollout_ref.actor.policy_loss.kl_cov_ratio": 0.0002,
    "actor_rollout_ref.actor.policy_loss.ppo_kl_coef": 0.1,
    "actor_rollout_ref.actor.policy_loss.dro_beta": None,
    "actor_rollout_ref.actor.tau_pos": 1.0,
    "actor_rollout_ref.actor.tau_neg": 1.05,
    "actor_rollout_ref.actor.loss_scale_factor": None,
    "actor_rollout_ref.actor.data_loader_seed": 42,
    "algorithm.filter_groups.enable": False,
    "algorithm.filter_groups.metric": "reward",
    "algorithm.filter_groups.max_num_gen_batches": 0,
}


def _get(cfg: RLMeshConfig, key: str) -> Any:
    value: Any = cfg
    for part in key.split("."):
        value = getattr(value, part)
    return value


@pytest.fixture(scope="module")
def defaults() -> RLMeshConfig:
    return load_config()


@pytest.mark.parametrize("key", sorted(VERL_DEFAULTS))
def test_default_equals_verl(defaults: RLMeshConfig, key: str) -> None:
    assert _get(defaults, key) == VERL_DEFAULTS[key]


def test_python_construction_gives_the_same_defaults(defaults: RLMeshConfig) -> None:
    assert RLMeshConfig() == defaults


def test_rlmesh_section_defaults(defaults: RLMeshConfig) -> None:
    r = defaults.rlmesh
    assert (r.run_id, r.redis_url, r.auth_token, r.max_staleness) == (
        None,
        "redis://127.0.0.1:6379/0",
        None,
        0,
    )
    assert (r.log_level, r.log_format) == ("INFO", "json")
    expected_ports = {
        "reward": (50051, 9101),
        "reference": (50052, 9102),
        "rollout": (50053, 9103),
        "learner": (50054, 9104),
        "control": (8000, 9105),
    }
    assert expected_ports == SERVICE_PORTS
    for name, (port, metrics_port) in expected_ports.items():
        service = getattr(r, name)
        assert (service.host, service.port, service.metrics_port) == ("127.0.0.1", port, metrics_port)
        assert (service.addresses, service.timeout_s, service.max_concurrency) == ([], 60.0, 64)
        assert service.client_addresses() == [f"127.0.0.1:{port}"]
    ws = r.weight_sync
    assert (ws.transport, ws.backend, ws.master_address, ws.master_port) == ("distributed", "auto", None, 0)
    assert (ws.bucket_size_mb, ws.timeout_s, ws.verify_tensors, ws.disk_dir) == (256, 300.0, 4, None)
    assert ws.load_format == "auto"
    assert (r.runtime.shutdown_grace_s, r.runtime.health_timeout_s) == (30.0, 120.0)
    q = r.queue
    assert (q.prompt_stream_maxlen, q.trajectory_stream_maxlen) == (100_000, 100_000)
    assert (q.claim_idle_ms, q.max_deliveries, q.heartbeat_ttl_s) == (60_000, 3, 15.0)


def test_default_engine_maps_like_verl_fsdp(defaults: RLMeshConfig) -> None:
    eff = defaults.actor_rollout_ref.actor.effective_engine()
    assert (eff.zero_stage, eff.offload_param, eff.offload_optimizer, eff.dtype) == (
        3,
        False,
        False,
        "bfloat16",
    )


def test_critic_follows_gae_like_verl(defaults: RLMeshConfig) -> None:
    assert defaults.uses_critic()
    assert not defaults.uses_reference()
