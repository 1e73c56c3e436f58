"""``rlmesh train`` with ``rlmesh.reference.colocated=true``: a short job (tiny model, 3 steps, KL in
the reward) runs to the end with no reference process, its replicas calling none, and the KL to a
reference that stays frozen while the actor moves in every step's metrics."""

from __future__ import annotations

import json
import re

import pytest

from tests.support.jobs import Job, make_files, overrides
from tests.support.repo import CPU_DEMO

STEPS = 3


@pytest.mark.timeout(300)
def test_a_job_with_a_colocated_reference_runs_without_a_reference_service(tmp_path):
    files = make_files(tmp_path / "files")
    run_dir = tmp_path / "run"
    job = Job.start(
        [
            "-c",
            str(CPU_DEMO),
            *overrides(files, run_dir, STEPS),
            "algorithm.use_kl_in_reward=true",  # the demo's adaptive controller
            "rlmesh.rollout.replicas=1",
            "rlmesh.reference.colocated=true",
        ]
    )
    assert job.finish(timeout_s=240) == 0, job.tail()
    assert job.count(r"^\[train\] reference +colocated in the learner") == 1, job.tail()
    started = [line.split()[1] for line in job.lines if re.search(r"\(pid \d+", line)]
    # Printed as each comes up: Redis first, the control plane after the learner; reward, rollout
    # and learner start at once, in whichever order they come up (a loaded machine swaps them).
    assert started[0] == "redis" and started[-1] == "control", job.tail()
    assert sorted(started) == ["control", "learner", "redis", "reward", "rollout-0"], job.tail()
    summary = json.loads(job.lines[-2])  # the last line is the reader's <eof>
    logs = run_dir / "services" / summary["run_id"] / "logs"
    assert sorted(p.stem for p in logs.glob("*.log") if not p.stem.startswith("redis")) == [
        "control",
        "learner",
        "reward",
        "rollout-0",
    ]
    assert "colocated reference on rank 0" in (logs / "learner.log").read_text()

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["step"] > 0]
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    for r in train:
        for key in ("actor/reward_kl_penalty", "actor/reward_kl_penalty_coeff", "timing_s/ref"):
            assert key in r, (r["step"], key)
        assert r["rollout/reference_s/mean"] == 0  # no replica asked a reference
        assert r["timing_start/ref"] <= r["timing_start/old_log_prob"]
    # Step 1's policy is the reference (KL 0 up to float noise); after updates it is not (the
    # sampled estimate of the KL can be either sign).
    noise = abs(train[0]["actor/reward_kl_penalty"])
    assert noise < 1e-4
    # (one step's sampled estimate may land near 0 by chance: the largest of the later ones does
    # not, though how far the tiny policy moves varies, 5e-5 to 1e-3: well above float noise,
    # which is all a reference that moved with the policy would give)
    assert max(abs(r["actor/reward_kl_penalty"]) for r in train[1:]) > max(1e-6, 10 * noise)
