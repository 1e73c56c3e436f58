"""A small job's files as a user has them (a tiny model with its tokenizer, Parquet data, a reward file,
a YAML config), for the pre-flight tests to break one at a time."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tests.support.data import row, write
from tests.support.learner import tiny_model

SOURCE = "my_task"  # no built-in reward knows it: the reward file scores it
TRAIN_ROWS = 12
VAL_ROWS = 4
MAX_PROMPT_LENGTH = 40  # the chat template's 19 tokens + the question's

REWARD = """\
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return float(solution_str.strip() == ground_truth)
"""

CONFIG = """\
data:
  train_files: {train}
  val_files: {val}
  train_batch_size: 4
  max_prompt_length: {max_prompt_length}
  max_response_length: 8
actor_rollout_ref:
  model:
    path: {model}
    enable_gradient_checkpointing: false
  actor:
    ppo_mini_batch_size: 2
    ppo_micro_batch_size_per_gpu: 2
    deepspeed_config:
      zero_stage: 0
      dtype: float32
  rollout:
    name: embedded
    n: 2
    dtype: float32
algorithm:
  adv_estimator: grpo
custom_reward_function:
  path: {reward}
trainer:
  device: cpu
  n_gpus_per_node: 0
  total_training_steps: 3
  save_freq: 1
  default_local_dir: {run_dir}
"""


@dataclass
class JobFiles:
    root: Path
    model: Path
    train: Path
    val: Path
    reward: Path
    config: Path
    run_dir: Path


def question(i: int) -> str:
    return f"what is {i}+{i}?"


def make_job(root: Path) -> JobFiles:
    """A tiny Qwen2 with the char tokenizer, 12 train and 4 val prompts of data_source ``my_task`` that
    fit ``MAX_PROMPT_LENGTH``, a reward file scoring them, and the config naming them all."""
    model = tiny_model(root / "model")
    train = write(
        root / "train.parquet", [row(question(i), gt=str(2 * i), source=SOURCE) for i in range(TRAIN_ROWS)]
    )
    val = write(
        root / "val.parquet", [row(question(i), gt=str(2 * i), source=SOURCE) for i in range(VAL_ROWS)]
    )
    reward = root / "my_reward.py"
    reward.write_text(REWARD)
    run_dir = root / "run"
    config = root / "job.yaml"
    config.write_text(
        CONFIG.format(
            train=train,
            val=val,
            model=model,
            reward=reward,
            run_dir=run_dir,
            max_prompt_length=MAX_PROMPT_LENGTH,
        )
    )
    return JobFiles(root, model, train, val, reward, config, run_dir)


def long_rows(count: int, long_every: int) -> list[dict]:
    """``count`` rows of ``my_task``; every ``long_every``-th one (rows 1, 1 + long_every, ...) has a
    question longer than ``MAX_PROMPT_LENGTH`` allows, each longer than the one before."""
    return [
        row(
            question(i) + " x" * (10 + i) if i % long_every == 1 else question(i),
            gt=str(2 * i),
            source=SOURCE,
        )
        for i in range(count)
    ]


def write_checkpoint(job: JobFiles, step: int) -> Path:
    """``<run dir>/global_step_<step>`` as the learner writes it (``PPOTrainer.save_checkpoint``, the
    tiny model's actor under ZeRO 0), a run that trained ``step`` steps."""
    from rlmesh.config import load_config
    from rlmesh.learner import PPOTrainer

    trainer = PPOTrainer(load_config(job.config, [], warn=False), total_training_steps=step)
    path = job.run_dir / f"global_step_{step}"
    trainer.save_checkpoint(str(path), {"step": step, "version": step})
    return path
