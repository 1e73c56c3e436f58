"""The control plane in a real ``rlmesh train`` job, every service a process: a hyper-parameter
changed over REST reaches the learner (its metrics show it from the step it applies to), pause and
resume hold and release the run, the history and validation read back, the replica is listed, and
the reward service is swapped mid-run for another without a sample lost (the learner's record of
what it trained on is audited against the plan: every group complete, every step once)."""

from __future__ import annotations

import re
import uuid

import httpx
import pytest

from rlmesh.job.stack import free_port_overrides
from rlmesh.runtime.health import scrape_metrics
from rlmesh.runtime.launcher import ProcessLauncher
from tests.support.jobs import Job, N, audit_groups, make_files, overrides, planned_prompts
from tests.support.polling import wait_until
from tests.support.repo import CPU_DEMO

STEPS = 300  # more than it runs: the test stops it over REST
LR = 1.25e-4  # the actor's peak lr set mid-run; constant schedule: actor/lr shows it as it is


@pytest.mark.timeout(600)
def test_a_running_job_is_driven_through_the_control_plane(tmp_path):
    files = make_files(tmp_path / "files")
    run_dir = tmp_path / "run"
    run_id = f"control-e2e-{uuid.uuid4().hex[:6]}"
    argv = [
        "-c",
        str(CPU_DEMO),
        *overrides(files, run_dir, STEPS),
        f"rlmesh.run_id={run_id}",
        "rlmesh.rollout.replicas=1",
        "trainer.test_freq=3",
        "actor_rollout_ref.actor.optim.lr_scheduler_type=constant",
        "actor_rollout_ref.actor.optim.warmup_ratio=0",
    ]
    job = Job.start(argv)
    # A second reward service for the run, started while the job starts: the swap's target.
    with ProcessLauncher(tmp_path / "reward2", stop_grace_s=10) as launcher:
        try:
            reward2 = launcher.start_service(
                "reward",
                name="reward2",
                config_path=CPU_DEMO,
                # The job's own settings (its model's tokenizer decodes responses), on free ports.
                overrides=[*argv[2:], *free_port_overrides("reward")],
            )
            url = job.wait_for(r"control plane: (http://\S+)/docs", 300)[1]
            api = httpx.Client(base_url=f"{url}/api/v1", headers={"X-Rlmesh-User": "e2e"}, timeout=120)

            def logged() -> set[int]:
                rows = api.get("/run/metrics", params={"keys": "timing_s/step"}).json()["rows"]
                return {row["step"] for row in rows}

            def wait_for_step(step: int) -> None:
                wait_until(lambda: max(logged(), default=0) >= step, 300, f"step {step}", every_s=0.2)

            # Held before its first step (a step here takes a fraction of a second), the learner
            # takes a new lr: applied from step 1.
            r = api.post("/run/pause")
            assert r.status_code == 200 and r.json()["paused"] is True, r.text
            r = api.patch("/hyperparams", json={"actor_lr": LR})
            assert r.status_code == 200, r.text
            applies = r.json()["applies_from_step"]
            assert r.json()["values"]["actor_lr"] == LR
            assert api.post("/run/resume").json()["paused"] is False
            wait_for_step(2)

            # The reward service swapped while the run goes on: replicas score its next samples there.
            r = api.put("/rewards", json={"addresses": [reward2.grpc_address]})
            assert r.status_code == 200, r.text
            assert [w["address"] for w in api.get("/rewards").json()["rewards"]] == [reward2.grpc_address]
            swapped_at = max(logged())

            def reward2_calls() -> float:
                found = re.search(
                    r"^rlmesh_reward_batch_size_count (\S+)$",
                    scrape_metrics("127.0.0.1", reward2.metrics_port),
                    re.M,
                )
                return float(found[1]) if found else 0.0

            # Replicas take the new address when they next read it: a fast machine runs several
            # steps before then, so wait for the second service's first Score calls, not for steps.
            wait_until(lambda: reward2_calls() > 0, 120, "the second reward service to score", every_s=0.2)
            wait_for_step(max(swapped_at + 3, 6))

            # Pause: the learner ends its step and holds.
            assert api.post("/run/pause").json()["paused"] is True
            wait_until(
                lambda: api.get("/run/status").json()["phase"] == "paused",
                120,
                "the learner to hold",
                every_s=0.2,
            )
            held = api.get("/run/status").json()["step"]
            [replica] = api.get("/replicas").json()["replicas"]
            assert replica["replica_id"] == "rollout-0" and replica["health"] == "SERVING"
            assert replica["tokens_per_s"] is not None and replica["tasks_in_flight"] is not None

            # The history shows the change from the step it applied to, and the validations.
            keys = {"keys": "actor/lr,hparams/actor_lr", "start": 1}
            rows = api.get("/run/metrics", params=keys).json()["rows"]
            by_step = {row["step"]: row["metrics"] for row in rows}
            assert sorted(by_step) == list(range(1, held + 1))
            applied = by_step[applies]
            assert applied["hparams/actor_lr"] == LR and applied["actor/lr"] == pytest.approx(LR)
            validation = api.get("/run/validation").json()["rows"]
            assert [row["step"] for row in validation][:2] == [3, 6] and "val/score" in validation[0][
                "metrics"
            ]
            assert api.get("/run/status").json()["step"] == held  # still held
            actions = [e["action"] for e in api.get("/audit").json()["entries"]]
            assert actions[:3] == ["pause", "swap_rewards", "resume"], actions

            # A graceful stop: the step ends, a checkpoint, and the job exits cleanly.
            assert api.post("/run/stop", json={"checkpoint": True}).status_code == 200
            assert job.finish(300) == 0, job.tail()
            scored = scrape_metrics("127.0.0.1", reward2.metrics_port)
        finally:
            if job.proc.poll() is None:
                job.finish(60)
    # The second reward service scored samples, and nothing was lost in the swap: every step the
    # learner committed trained on its planned prompts with all their samples.
    calls = re.search(r"^rlmesh_reward_batch_size_count (\S+)$", scored, re.M)  # its Score calls
    assert calls and float(calls[1]) > 0, scored
    plan = planned_prompts(files, run_dir, STEPS)
    audit_groups(run_dir / "trained_groups.jsonl", {s: plan[s] for s in range(1, held + 1)}, N)
    assert (run_dir / f"global_step_{held}").is_dir()  # the stop's checkpoint: the run resumes from it
