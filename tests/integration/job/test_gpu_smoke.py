"""`make gpu-smoke` where there is no GPU: it says so in its one JSON line and fails, checking nothing."""

import json
import subprocess
import sys

import pytest


def test_without_cuda_it_reports_the_machine_and_skips_every_check(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device: `make gpu-smoke` runs the checks for real")
    out = subprocess.run(
        [sys.executable, "-m", "rlmesh.job.gpu_smoke", "--keep", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 1, out.stderr
    report = json.loads(out.stdout.strip().splitlines()[-1])
    env = report["environment"]
    assert env["cuda_available"] is False and env["gpus"] == [] and env["torch"].startswith("2.13.0")
    skipped = {"ok": None, "skipped": "no CUDA device"}
    assert report["deepspeed_step"] == report["cuda_learner_job"] == report["sglang_job"] == skipped
    assert report["ok"] is False
