"""Every formula the learner computes, as pure tensor functions.

Names and argument order follow verl's ``verl/trainer/ppo/core_algos.py`` and
``verl/utils/torch_functional.py`` wherever verl has the same function, so results compare
number for number. See ``docs/algorithms.md`` for the equations and the config keys that select
them.
"""

from rlmesh.algo.advantages import (
    ADV_ESTIMATOR_REGISTRY,
    AdvantageEstimator,
    compute_advantage,
    compute_gae_advantage_return,
    compute_gae_raw_advantage_return,
    compute_grpo_outcome_advantage,
    compute_reinforce_plus_plus_baseline_outcome_advantage,
    compute_reinforce_plus_plus_outcome_advantage,
    compute_rloo_outcome_advantage,
    get_adv_estimator_fn,
    group_indices,
    register_adv_est,
)
from rlmesh.algo.kl import (
    KL_PENALTY_NAMES,
    AdaptiveKLController,
    FixedKLController,
    KLController,
    apply_kl_penalty,
    compute_rewards,
    get_kl_controller,
    kl_penalty,
    kl_penalty_forward,
    place_scores_on_last_token,
)
from rlmesh.algo.logprobs import entropy_from_logits, logprobs_from_logits, logprobs_from_logits_naive
from rlmesh.algo.losses import (
    LOSS_AGG_MODES,
    POLICY_LOSS_REGISTRY,
    agg_loss,
    compute_entropy_loss,
    compute_pg_losses,
    compute_policy_loss,
    compute_value_loss,
    get_policy_loss_fn,
    register_policy_loss,
)
from rlmesh.algo.masked import clip_by_value, masked_mean, masked_sum, masked_var, masked_whiten
from rlmesh.algo.metrics import compute_approx_kl, compute_clipfrac, compute_data_metrics, masked_stats
from rlmesh.algo.rollout_correction import (
    ROLLOUT_IS_LEVELS,
    compute_is_metrics,
    compute_offpolicy_metrics,
    compute_rollout_correction,
    compute_rollout_correction_weights,
)

__all__ = [
    "ADV_ESTIMATOR_REGISTRY",
    "KL_PENALTY_NAMES",
    "LOSS_AGG_MODES",
    "POLICY_LOSS_REGISTRY",
    "ROLLOUT_IS_LEVELS",
    "AdaptiveKLController",
    "AdvantageEstimator",
    "FixedKLController",
    "KLController",
    "agg_loss",
    "apply_kl_penalty",
    "clip_by_value",
    "compute_advantage",
    "compute_approx_kl",
    "compute_clipfrac",
    "compute_data_metrics",
    "compute_entropy_loss",
    "compute_gae_advantage_return",
    "compute_gae_raw_advantage_return",
    "compute_grpo_outcome_advantage",
    "compute_is_metrics",
    "compute_offpolicy_metrics",
    "compute_pg_losses",
    "compute_policy_loss",
    "compute_reinforce_plus_plus_baseline_outcome_advantage",
    "compute_reinforce_plus_plus_outcome_advantage",
    "compute_rewards",
    "compute_rloo_outcome_advantage",
    "compute_rollout_correction",
    "compute_rollout_correction_weights",
    "compute_value_loss",
    "entropy_from_logits",
    "get_adv_estimator_fn",
    "get_kl_controller",
    "get_policy_loss_fn",
    "group_indices",
    "kl_penalty",
    "kl_penalty_forward",
    "logprobs_from_logits",
    "logprobs_from_logits_naive",
    "masked_mean",
    "masked_stats",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "place_scores_on_last_token",
    "register_adv_est",
    "register_policy_loss",
]
