"""``rlmesh train`` with ``actor_rollout_ref.model.lora_adapter_path``: the replicas (two, started
from ``model.path``) sample the first step from base + adapter already, so the learner's log-probs
of step 1's samples are the rollout's own, and every sample is of the version being trained."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from tests.support.jobs import Job, make_files, overrides
from tests.support.repo import CPU_DEMO

STEPS = 2


@pytest.mark.timeout(300)
def test_replicas_sample_the_first_step_from_base_plus_adapter(tmp_path):
    files = make_files(tmp_path / "files")
    adapter = tmp_path / "adapter"
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # peft asks transformers 5 a deprecated question
        torch.manual_seed(3)
        config = LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
        get_peft_model(AutoModelForCausalLM.from_pretrained(files.model), config).save_pretrained(
            str(adapter)
        )
    run_dir = tmp_path / "run"
    job = Job.start(
        [
            "-c",
            str(CPU_DEMO),
            *overrides(files, run_dir, STEPS),
            f"actor_rollout_ref.model.lora_adapter_path={adapter}",  # LoRA on, as in verl's example
        ]
    )
    assert job.finish(timeout_s=240) == 0, job.tail()
    summary = json.loads(job.lines[-2])  # the last line is the reader's <eof>
    learner_log = (run_dir / "services" / summary["run_id"] / "logs" / "learner.log").read_text()
    assert f"LoRA adapter {adapter}: rank 4" in learner_log

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["step"] > 0]
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    # Version 0 is model.path; base + adapter is version 1, the first trained.
    assert [r["training/policy_version"] for r in train] == [2.0, 3.0]
    first = train[0]
    assert first["training/staleness/max"] == 0, first
    # The learner scores step 1's samples with base + adapter: the rollout engines sampled them
    # with those very weights (a base-weight engine would differ by the adapter's whole effect).
    assert first["rollout_corr/logprob_abs_diff_max"] < 1e-4, first
