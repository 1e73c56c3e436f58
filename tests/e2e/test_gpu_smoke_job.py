"""The job `make gpu-smoke` runs on SGLang, run here on the CPU engine: its command line is a
valid `rlmesh train` that trains the steps it asks for and writes their metrics."""

import pytest

from rlmesh.job.gpu_smoke import deepspeed_step, sglang_job


@pytest.mark.timeout(600)
def test_the_smoke_job_trains_its_steps_on_the_cpu_engine(tmp_path):
    # As `make gpu-smoke`'s cuda_learner_job: two engines sharing one weight group.
    result = sglang_job(tmp_path, gpus=0, steps=2, engine="embedded", device="cpu", replicas=2, group_size=2)
    assert result["exit_code"] == 0, result
    assert result["ok"] is True and result["steps"] == 2 and result["weight_sync"] == "gloo"
    assert result["steps_pushed_over_shared_groups"] >= 1, result  # both engines, one group
    assert len(result["step_s"]) == 2 and all(s > 0 for s in result["step_s"])


@pytest.mark.timeout(300)
def test_the_smoke_learner_step_changes_the_weights_on_the_cpu(tmp_path):
    import multiprocessing

    # A process of its own: the step initializes torch.distributed for this process.
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        result = pool.apply(deepspeed_step, (tmp_path, "cpu", "float32"))
    assert result["ok"] is True and result["weights_changed"] is True, result
