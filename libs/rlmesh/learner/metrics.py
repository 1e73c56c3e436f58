"""Batch metrics of a PPO step with verl's names (``compute_data_metrics`` in verl's trainer)."""

from __future__ import annotations

import torch

from rlmesh.algo import compute_data_metrics
from rlmesh.learner.batch import PPOBatch

__all__ = ["batch_metrics"]


def batch_metrics(
    batch: PPOBatch,
    token_level_rewards: torch.Tensor,
    advantages: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor | None,
    max_response_length: int,
) -> dict[str, float]:
    """``critic/{score,rewards,advantages,returns,values}/{mean,max,min}``, ``critic/vf_explained_var``,
    ``{response,prompt}_length/{mean,max,min}`` and ``response_length/clip_ratio`` (the share of
    responses that reached ``max_response_length``).

    A sequence's score (reward) is the sum of its token-level scores (rewards), as in verl.
    """
    mask = batch.response_mask
    metrics = compute_data_metrics(advantages, returns, mask, values)
    response_length = mask.sum(dim=-1).float()
    prompt_length = batch.attention_mask[:, : batch.prompt_length].sum(dim=-1).float()
    for key, x in (
        ("critic/score", batch.token_level_scores.sum(dim=-1)),
        ("critic/rewards", token_level_rewards.sum(dim=-1)),
        ("response_length", response_length),
        ("prompt_length", prompt_length),
    ):
        metrics[f"{key}/mean"] = x.mean().item()
        metrics[f"{key}/max"] = x.max().item()
        metrics[f"{key}/min"] = x.min().item()
    metrics["response_length/clip_ratio"] = (response_length >= max_response_length).float().mean().item()
    return metrics
