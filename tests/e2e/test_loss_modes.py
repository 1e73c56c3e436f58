"""A policy loss other than vanilla through a real ``rlmesh train`` job: GSPO
(``policy_loss.loss_mode=gspo``), as verl's GSPO examples set it up (GRPO advantages,
``seq-mean-token-mean``, tight clip ranges).

GSPO clips a sequence as a whole: every token of a response shares the sequence-level ratio (the
geometric mean of its token ratios), and with GRPO every token of a response shares its
advantage, so the clip decision is the same for all of them. With ``ignore_eos`` every response
has LENGTH tokens, so each micro-batch's clip fraction is its share of clipped responses, and
``actor/pg_clipfrac`` (verl's: the mean of the micro-batches' clip fractions, here all of
RESPONSES / 2 responses) times the responses trained (RESPONSES x EPOCHS) is a whole number. Vanilla PPO clips token by token: on the same steps its
clipped tokens would be any number. The second PPO epoch of each step trains off-policy, so
clipping happens (a tight clip range makes sure of it), and GSPO's lower clip fraction is 0
(verl reports no dual clip for it).

The reward is the test's own (the share of a response's characters with an even code point), so a
random tiny model's responses score all over [0, 1] and the advantages are not zero.
"""

from __future__ import annotations

import json
import math

import pytest

from tests.support.jobs import Job, make_files
from tests.support.repo import CPU_DEMO

STEPS = 3
PROMPTS, N, LENGTH, EPOCHS = 4, 4, 6, 2
RESPONSES = PROMPTS * N  # per step, one mini-batch
CLIP = 0.002  # tight: every step's second epoch moves some responses' ratios past it

REWARD_FILE = '''"""The share of characters with an even code point: scores spread over [0, 1]."""


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return sum(ord(c) % 2 == 0 for c in solution_str) / len(solution_str) if solution_str else 0.0
'''


@pytest.mark.timeout(420)
def test_gspo_job_clips_whole_sequences(tmp_path):
    files = make_files(tmp_path / "files")
    reward = tmp_path / "reward.py"
    reward.write_text(REWARD_FILE)
    run_dir = tmp_path / "run"
    job = Job.start(
        [
            "-c",
            str(CPU_DEMO),
            f"actor_rollout_ref.model.path={files.model}",
            f"data.train_files={files.train}",
            f"data.val_files={files.val}",
            f"custom_reward_function.path={reward}",
            f"trainer.default_local_dir={run_dir}",
            f"trainer.total_training_steps={STEPS}",
            "trainer.save_freq=-1",
            "trainer.test_freq=-1",
            "trainer.val_before_train=false",
            "algorithm.adv_estimator=grpo",
            "algorithm.use_kl_in_reward=false",
            f"data.train_batch_size={PROMPTS}",
            f"actor_rollout_ref.rollout.n={N}",
            f"actor_rollout_ref.rollout.response_length={LENGTH}",
            "actor_rollout_ref.rollout.ignore_eos=true",  # every response LENGTH tokens
            f"actor_rollout_ref.actor.ppo_mini_batch_size={PROMPTS}",
            f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={RESPONSES // 2}",  # 2 per mini-batch
            f"actor_rollout_ref.actor.ppo_epochs={EPOCHS}",
            "actor_rollout_ref.actor.optim.lr=1e-3",
            "actor_rollout_ref.actor.optim.warmup_ratio=0.0",
            # verl's examples/gspo_trainer settings
            "actor_rollout_ref.actor.policy_loss.loss_mode=gspo",
            "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean",
            f"actor_rollout_ref.actor.clip_ratio_low={CLIP}",
            f"actor_rollout_ref.actor.clip_ratio_high={CLIP}",
            "rlmesh.rollout.replicas=1",
            "rlmesh.control.enabled=false",
        ]
    )
    assert job.finish(timeout_s=360) == 0, job.tail(60)
    summary = json.loads(job.lines[-2])  # the last line is the reader's <eof>
    assert summary["steps"] == STEPS, job.tail(60)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [int(r["step"]) for r in rows] == list(range(1, STEPS + 1))

    for row in rows:
        step = int(row["step"])
        assert row["response_length/min"] == row["response_length/max"] == LENGTH, row
        for key in ("actor/pg_loss", "actor/ppo_kl", "actor/grad_norm"):
            assert math.isfinite(row[key]), (step, key)
        assert row["critic/advantages/max"] - row["critic/advantages/min"] > 0.1, row  # something to clip
        # Whole sequences clipped: clipfrac x (responses x epochs) is the number of clipped
        # (response, epoch) pairs, an integer; and some were clipped.
        clipped = row["actor/pg_clipfrac"] * RESPONSES * EPOCHS
        assert clipped == pytest.approx(round(clipped), abs=1e-4), (step, row["actor/pg_clipfrac"])
        assert round(clipped) >= 1, (step, row["actor/pg_clipfrac"])
        assert row["actor/pg_clipfrac_lower"] == 0.0, step
        # Every push reached the one replica and was read back from it (the embedded engine can).
        pushes = (
            row["weight_sync/engines"],
            row["weight_sync/failed_engines"],
            row["weight_sync/unchecked_engines"],
        )
        assert pushes == (1, 0, 0), (step, pushes)
