"""The job `make gpu-smoke` runs on SGLang, run here on the CPU engine: its command line is a
valid `rlmesh train` that trains the steps it asks for and writes their metrics."""

import pytest

from rlmesh.job.gpu_smoke import sglang_job


@pytest.mark.timeout(600)
def test_the_smoke_job_trains_its_steps_on_the_cpu_engine(tmp_path):
    result = sglang_job(tmp_path, gpus=0, steps=2, engine="embedded", device="cpu")
    assert result["exit_code"] == 0, result
    assert result["ok"] is True and result["steps"] == 2 and result["weight_sync"] == "gloo"
    assert len(result["step_s"]) == 2 and all(s > 0 for s in result["step_s"])
