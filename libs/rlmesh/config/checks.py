"""Cross-field rules, verl's and rlmesh's own, each a sentence naming the keys and their numbers.

docs/internals.md#rlmeshconfigchecks"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlmesh.config.optim import EngineSettings
from rlmesh.config.sections import GROUP_ESTIMATORS

if TYPE_CHECKING:
    from rlmesh.config.schema import RLMeshConfig

ACTOR = "actor_rollout_ref.actor"
ROLLOUT = "actor_rollout_ref.rollout"


def _batch_problems(cfg: RLMeshConfig) -> list[str]:
    problems: list[str] = []
    train = cfg.data.train_batch_size
    n = cfg.actor_rollout_ref.rollout.n
    actor = cfg.actor_rollout_ref.actor
    sections = [(ACTOR, actor.ppo_mini_batch_size, actor.ppo_micro_batch_size_per_gpu, actor.use_dynamic_bsz)]
    if cfg.uses_critic():
        critic = cfg.critic
        sections.append(
            (
                "critic",
                critic.ppo_mini_batch_size,
                critic.ppo_micro_batch_size_per_gpu,
                critic.use_dynamic_bsz,
            )
        )
    for name, mini, micro, dynamic in sections:
        # Both counted in prompts: a step is train_batch_size prompts cut into mini-batches.
        if train % mini:
            problems.append(
                f"data.train_batch_size ({train}) must be divisible by {name}.ppo_mini_batch_size ({mini})"
            )
        # A mini-batch holds mini * n samples, cut into micro-batches for gradient accumulation.
        if micro is not None and not dynamic and (mini * n) % micro:
            problems.append(
                f"{name}.ppo_mini_batch_size * {ROLLOUT}.n ({mini} * {n} = {mini * n} samples) must be divisible "
                f"by {name}.ppo_micro_batch_size_per_gpu ({micro})"
            )
    return problems


def _token_budget_problems(cfg: RLMeshConfig) -> list[str]:
    # verl's dynamic batching packs whole sequences: one full-length sequence must fit the budget.
    rollout = cfg.actor_rollout_ref.rollout
    seq = (rollout.prompt_length or 0) + (rollout.response_length or 0)
    actor = cfg.actor_rollout_ref.actor
    ref = cfg.actor_rollout_ref.ref
    budgets = [
        (actor.use_dynamic_bsz, f"{ACTOR}.ppo_max_token_len_per_gpu", actor.ppo_max_token_len_per_gpu),
        (
            rollout.log_prob_use_dynamic_bsz,
            f"{ROLLOUT}.log_prob_max_token_len_per_gpu",
            rollout.log_prob_max_token_len_per_gpu,
        ),
        (
            ref.log_prob_use_dynamic_bsz,
            "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu",
            ref.log_prob_max_token_len_per_gpu,
        ),
    ]
    if cfg.uses_critic():
        critic = cfg.critic
        budgets.append(
            (critic.use_dynamic_bsz, "critic.ppo_max_token_len_per_gpu", critic.ppo_max_token_len_per_gpu)
        )
        budgets.append(
            (
                critic.use_dynamic_bsz,
                "critic.forward_max_token_len_per_gpu",
                critic.forward_max_token_len_per_gpu,
            )
        )
    return [
        f"{key} ({budget}) must hold one whole sequence: prompt_length + response_length = "
        f"{rollout.prompt_length} + {rollout.response_length} = {seq} (use_dynamic_bsz is on)"
        for dynamic, key, budget in budgets
        if dynamic and budget is not None and budget < seq
    ]


def sequence_packing_problems(cfg: RLMeshConfig) -> list[str]:
    """``data.use_sequence_packing`` packs every forward; a role's packing key set to false beside
    it contradicts it. Checked before the derived values are filled in, which would hide it."""
    if not cfg.data.use_sequence_packing:
        return []
    arr = cfg.actor_rollout_ref
    keys = [
        key
        for key, value in (
            ("actor_rollout_ref.model.use_remove_padding", arr.model.use_remove_padding),
            (f"{ACTOR}.use_remove_padding", arr.actor.use_remove_padding),
        )
        if value is False
    ]
    return [
        f"data.use_sequence_packing=true packs every forward, but {key}=false turns it off: drop one of them"
        for key in keys
    ]


def clip_grad_problems(cfg: RLMeshConfig) -> list[str]:
    """verl's two names for one setting (``grad_clip``, ``optim.clip_grad``) must agree; checked
    before the derived values are filled in, which would hide it."""
    problems = []
    for name, role in ((ACTOR, cfg.actor_rollout_ref.actor), ("critic", cfg.critic)):
        old, new = role.grad_clip, role.optim.clip_grad
        if old is not None and new is not None and old != new:
            problems.append(
                f"{name}.grad_clip ({old}) and {name}.optim.clip_grad ({new}) are one setting under two "
                "names: give one of them"
            )
    return problems


def _engine_problems(name: str, fsdp_key: str, eff: EngineSettings) -> list[str]:
    problems = []
    if eff.offload_param and eff.zero_stage != 3:
        problems.append(
            f"{name}: parameter offload (deepspeed_config.offload_param or {fsdp_key}.param_offload) needs "
            f"{name}.deepspeed_config.zero_stage=3 (got {eff.zero_stage})"
        )
    if eff.offload_optimizer and eff.zero_stage == 0:
        problems.append(
            f"{name}: optimizer offload (deepspeed_config.offload_optimizer or {fsdp_key}.optimizer_offload) "
            f"needs {name}.deepspeed_config.zero_stage >= 1 (got 0)"
        )
    return problems


def _queue_problems(cfg: RLMeshConfig) -> list[str]:
    """The streams must hold what the learner keeps in flight: batches for ``max_staleness + 1``
    steps, the ``over_provision`` groups beyond them, and one more batch of requeued or late groups.
    Smaller, replicas would wait on a full trajectory stream that the learner never drains, because
    it waits for a batch stuck in it."""
    batch, n = cfg.data.train_batch_size, cfg.actor_rollout_ref.rollout.n
    extra = cfg.rlmesh.extra_groups(batch)
    groups = batch * (cfg.rlmesh.max_staleness + 2) + extra
    formula = "data.train_batch_size x (rlmesh.max_staleness + 2)"
    if extra:
        formula += f" + {extra} (rlmesh.over_provision)"
    queue = cfg.rlmesh.queue
    problems = []
    if queue.prompt_stream_maxlen < groups:
        problems.append(
            f"rlmesh.queue.prompt_stream_maxlen={queue.prompt_stream_maxlen} cannot hold the prompts in "
            f"flight: it must be >= {formula} = {groups}"
        )
    if queue.trajectory_stream_maxlen < groups * n:
        problems.append(
            f"rlmesh.queue.trajectory_stream_maxlen={queue.trajectory_stream_maxlen} cannot hold the "
            f"samples in flight: it must be >= ({formula}) x {ROLLOUT}.n = {groups * n}"
        )
    return problems


def cross_field_problems(cfg: RLMeshConfig) -> list[str]:
    """Every violated cross-field rule, as readable sentences; empty when the config is consistent."""
    problems = _batch_problems(cfg) + _token_budget_problems(cfg)
    algo = cfg.algorithm
    rollout = cfg.actor_rollout_ref.rollout
    if algo.adv_estimator in GROUP_ESTIMATORS and rollout.n < 2:
        problems.append(
            f"algorithm.adv_estimator={algo.adv_estimator} compares samples of the same prompt: "
            f"{ROLLOUT}.n must be > 1 (got {rollout.n})"
        )
    if algo.adv_estimator == "gae" and cfg.critic.enable is False:
        problems.append("algorithm.adv_estimator=gae needs a value function: critic.enable must not be false")
    if rollout.val_kwargs.do_sample and rollout.val_kwargs.temperature <= 0:
        problems.append(
            f"{ROLLOUT}.val_kwargs.do_sample is true, so {ROLLOUT}.val_kwargs.temperature must be > 0 "
            f"(got {rollout.val_kwargs.temperature})"
        )
    if cfg.trainer.val_only and not cfg.data.val_files:
        problems.append("trainer.val_only=true validates and exits: it needs data.val_files (got null)")
    if cfg.trainer.resume_mode == "resume_path" and not cfg.trainer.resume_from_path:
        problems.append("trainer.resume_mode=resume_path needs trainer.resume_from_path (got null)")
    problems += _engine_problems(
        ACTOR, f"{ACTOR}.fsdp_config", cfg.actor_rollout_ref.actor.effective_engine()
    )
    if cfg.uses_critic():
        problems += _engine_problems("critic", "critic.model.fsdp_config", cfg.critic.effective_engine())
    problems += _queue_problems(cfg)
    sync = cfg.rlmesh.weight_sync
    if sync.transport == "disk" and not sync.disk_dir:
        problems.append("rlmesh.weight_sync.transport=disk needs rlmesh.weight_sync.disk_dir (got null)")
    return problems


def cross_field_warnings(cfg: RLMeshConfig) -> list[str]:
    """Legal but suspicious combinations (verl prints a notice for the first)."""
    notes = []
    if cfg.algorithm.use_kl_in_reward and cfg.actor_rollout_ref.actor.use_kl_loss:
        notes.append(
            "algorithm.use_kl_in_reward and actor_rollout_ref.actor.use_kl_loss are both true: "
            "the KL to the reference is penalised twice"
        )
    corr = cfg.algorithm.rollout_correction
    if cfg.rlmesh.max_staleness > 0 and corr.rollout_is is None and not corr.bypass_mode:
        notes.append(
            f"rlmesh.max_staleness={cfg.rlmesh.max_staleness} trains samples up to that many policy versions "
            "old with no importance-sampling correction: set algorithm.rollout_correction.rollout_is=token "
            "(or sequence) to correct for it"
        )
    if cfg.rlmesh.over_provision > 0 and cfg.rlmesh.max_staleness == 0:
        notes.append(
            f"rlmesh.over_provision={cfg.rlmesh.over_provision} with rlmesh.max_staleness=0: the extra groups "
            "begun under a step's weights come back one version stale and are generated again; set "
            "rlmesh.max_staleness >= 1 to train them in the next step (APRIL's recycling)"
        )
    if cfg.trainer.critic_warmup > 1 and not cfg.uses_critic():
        notes.append(
            f"trainer.critic_warmup={cfg.trainer.critic_warmup} without a critic: steps 1 to "
            f"{cfg.trainer.critic_warmup - 1} train nothing (the actor trains from step critic_warmup on)"
        )
    return notes
