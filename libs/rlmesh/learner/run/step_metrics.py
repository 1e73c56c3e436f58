"""A step's metrics beside the trainer's: its timings, throughput and what its batch was made of,
under verl's names (compute_timing_metrics, compute_throughout_metrics) where verl has them."""

from __future__ import annotations

from dataclasses import dataclass

from rlmesh.config import RLMeshConfig
from rlmesh.learner.run.collect import StepBatch
from rlmesh.v1 import trajectory_pb2


def job_gpus(cfg: RLMeshConfig, cuda: bool) -> int:
    """The GPUs this job's config starts, perf/throughput's divisor as verl's n_gpus: the learner's
    ranks on CUDA plus each SGLang replica's tensor-parallel GPUs; 1 when it starts none."""
    learner = cfg.rlmesh.learner.ranks if cuda and cfg.trainer.device != "cpu" else 0
    rollout = cfg.actor_rollout_ref.rollout
    replicas = (
        cfg.rlmesh.rollout.replicas * rollout.tensor_model_parallel_size if rollout.name == "sglang" else 0
    )
    return max(1, learner + replicas)


def timing_per_token_ms(metrics: dict[str, float], response_tokens: int, tokens: int) -> dict[str, float]:
    """verl's ``timing_per_token_ms/<phase>``: gen per response token, the learner's phases per
    prompt + response token (0 when there are none)."""
    per = {
        "gen": response_tokens,
        **dict.fromkeys(("ref", "values", "adv", "update_critic", "update_actor"), tokens),
    }
    return {
        f"timing_per_token_ms/{name}": metrics[f"timing_s/{name}"] * 1000 / n if n > 0 else 0.0
        for name, n in per.items()
        if f"timing_s/{name}" in metrics
    }


@dataclass(frozen=True)
class StepClock:
    """When a step's phases ran: ``*_s`` durations (monotonic), ``*_start`` wall-clock starts, so
    benchmarks can line phases up across processes."""

    gen_s: float
    gen_start: float
    push_s: float
    push_start: float
    step_s: float
    step_start: float


def step_metrics(
    trained: dict[str, float],
    *,
    step: int,
    version: int,
    epoch: int,
    collected: StepBatch,
    clock: StepClock,
    push_counts: dict[str, float],
    recovered: dict[str, int],
    job_gpus: int,
    num_gen_batches: int | None,
) -> dict[str, float]:
    """The step's row: what the trainer returned (``trained``) and the loop's own metrics.
    ``num_gen_batches``: DAPO's dynamic sampling's draws (None when it is off)."""
    trajs = collected.trajectories
    response_tokens = sum(len(t.response_ids) for t in trajs)
    tokens = response_tokens + sum(len(t.prompt_ids) for t in trajs)
    metrics = {
        **trained,
        "timing_s/gen": clock.gen_s,
        "timing_s/push_weights": clock.push_s,
        **push_counts,
        "timing_s/step": clock.step_s,
        "timing_start/gen": clock.gen_start,
        "timing_start/push_weights": clock.push_start,
        "timing_start/step": clock.step_start,
        # verl's compute_throughout_metrics: per GPU of the job (1 on a CPU-only run)
        "perf/total_num_tokens": tokens,
        "perf/time_per_step": clock.step_s,
        "perf/throughput": tokens / (max(clock.step_s, 1e-9) * job_gpus),
        "training/global_step": step,
        "training/tokens": tokens,
        "training/response_tokens": response_tokens,
        "training/policy_version": version,
        "training/epoch": epoch,
        **{f"training/dropped_{k}": float(v) for k, v in collected.counts.items()},
        **collected.rewards.metrics("reward"),
        **{f"training/{k}": float(v) for k, v in recovered.items()},
        **rollout_metrics(trajs),
    }
    metrics.update(timing_per_token_ms(metrics, response_tokens, tokens))
    if num_gen_batches is not None:  # verl's DAPO recipe's and its V1 trainer's names
        metrics.update(
            {
                "train/num_gen_batches": float(num_gen_batches),
                "training/filter_groups/evicted_samples": float(len(collected.filtered)),
                "training/filter_groups/kept_groups": float(len(collected.groups)),
            }
        )
    return metrics


def rollout_metrics(trajs: list[trajectory_pb2.Trajectory]) -> dict[str, float]:
    """Stage times of the batch's samples, and the tokens they took over from an interrupted
    generation (partial rollouts: docs/reliability.md#partial-rollouts)."""
    if not trajs:
        return {}
    n = len(trajs)
    return {
        "rollout/generate_s/mean": sum(t.timings.generate_s for t in trajs) / n,
        "rollout/reward_s/mean": sum(t.timings.reward_s for t in trajs) / n,
        "rollout/reference_s/mean": sum(t.timings.reference_s for t in trajs) / n,
        "rollout/queue_wait_s/mean": sum(t.timings.queue_wait_s for t in trajs) / n,
        "rollout/resumed_tokens": float(sum(t.resumed_tokens for t in trajs)),
    }
