"""The colocated reference (``rlmesh.reference.colocated``): the learner's reference log-probs equal
the reference service's for the same trajectories (the service a real process, called per prompt
group as replicas call it), a step trains as it would on the service's log-probs, whatever the
trajectories carry, and 2 ranks (torchrun, gloo) each score only their own share."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections import defaultdict

import pytest
import torch

from rlmesh.learner import PPOTrainer, build_batch
from rlmesh.reference import ReferenceClient
from rlmesh.runtime.launcher import ProcessLauncher
from rlmesh.runtime.net import free_port
from rlmesh.v1 import reference_pb2
from tests.support.learner import PAD, TIMING_PREFIXES, make_config, make_trajectories
from tests.support.processes import PROGRAMS, child_env
from tests.support.repo import REPO

ATOL = 1e-5
# Both KL terms at once, on purpose: the config warns that it penalises the KL twice.
pytestmark = pytest.mark.filterwarnings("ignore:.*penalised twice")
# KL in the reward and as a loss, a temperature other than 1 (both sides divide the logits by it)
# and reference micro-batches of 3 samples.
KL = (
    "algorithm.use_kl_in_reward=true",
    "actor_rollout_ref.actor.use_kl_loss=true",
    "actor_rollout_ref.rollout.temperature=0.7",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=3",
)


@pytest.fixture(scope="module")
def service_log_probs(tiny_model_dir, tmp_path_factory):
    """Each trajectory's reference log-probs from the reference service, by uid."""
    trajectories = make_trajectories(n_prompts=4, n=2, seed=11, with_ref=False)
    groups = defaultdict(list)
    for t in trajectories:
        groups[t.group_uid].append(t)
    overrides = [
        "rlmesh.reference.port=0",
        "rlmesh.reference.metrics_port=0",
        f"actor_rollout_ref.model.path={tiny_model_dir}",
        *KL,
    ]

    async def score(address: str) -> dict[str, list[float]]:
        out = {}
        async with ReferenceClient([address], timeout_s=60) as client:
            for group in groups.values():  # one call per prompt group, as a replica's task
                samples = [
                    reference_pb2.LogProbsSample(
                        uid=t.uid, prompt_ids=t.prompt_ids, response_ids=t.response_ids
                    )
                    for t in group
                ]
                out.update({r.uid: list(r.log_probs) for r in await client.log_probs(samples)})
        return out

    with ProcessLauncher(tmp_path_factory.mktemp("ref-svc"), stop_grace_s=10) as launcher:
        service = launcher.start_service("reference", overrides=overrides)
        return asyncio.run(score(service.grpc_address))


def with_ref(trajectories, values: dict[str, list[float]]):
    for t in trajectories:
        del t.ref_log_probs[:]
        t.ref_log_probs.extend(values[t.uid])
    return trajectories


def test_log_probs_equal_the_reference_service(tiny_model_dir, service_log_probs):
    cfg = make_config(tiny_model_dir, *KL, "rlmesh.reference.colocated=true")
    trainer = PPOTrainer(cfg, total_training_steps=10)
    assert trainer.reference is not None
    ref = trainer.reference.model
    assert ref.model.training is False and not any(p.requires_grad for p in ref.model.parameters())
    assert ref.dtype == torch.float32 and ref.temperature == 0.7 and trainer.reference.micro_batch_size == 3
    trajectories = make_trajectories(n_prompts=4, n=2, seed=11, with_ref=False)
    batch = build_batch(trajectories, PAD, max_prompt_length=12, max_response_length=8)
    got = trainer.reference.log_probs(batch)
    assert got.shape == (len(batch), 8) and got.dtype == torch.float32
    for i, t in enumerate(trajectories):
        n = len(t.response_ids)
        assert got[i, :n].tolist() == pytest.approx(service_log_probs[t.uid], abs=ATOL), t.uid
        assert not got[i, n:].any()  # zero past each response, as every (bs, R) tensor of a batch


def test_a_step_trains_as_on_the_service_log_probs_whatever_the_batch_carries(
    tiny_model_dir, service_log_probs
):
    trajectories = make_trajectories(n_prompts=4, n=2, seed=11, with_ref=False)
    service = PPOTrainer(make_config(tiny_model_dir, *KL), total_training_steps=10)
    assert service.reference is None
    want = service.train_step(build_batch(with_ref(trajectories, service_log_probs), PAD))
    assert "timing_s/ref" not in want

    # Colocated: no ref_log_probs at all, or stale ones (a replica of an older config): always
    # recomputed, so both train exactly alike, and like the service's.
    carried = with_ref(make_trajectories(n_prompts=4, n=2, seed=11, with_ref=False), defaultdict(list))
    for t in carried:
        t.ref_log_probs.extend([-30.0] * len(t.response_ids))
    results = []
    for batch in (build_batch(trajectories, PAD, with_ref=False), build_batch(carried, PAD)):
        colocated = PPOTrainer(
            make_config(tiny_model_dir, *KL, "rlmesh.reference.colocated=true"), total_training_steps=10
        )
        results.append(colocated.train_step(batch))
    for got in results:
        assert got["timing_s/ref"] > 0 and got["timing_start/ref"] <= got["timing_start/old_log_prob"]
        for key, value in want.items():
            if not key.startswith(TIMING_PREFIXES):
                assert got[key] == pytest.approx(value, rel=1e-4, abs=ATOL), key
    assert results[0]["actor/reward_kl_penalty"] == results[1]["actor/reward_kl_penalty"]
    assert results[0]["actor/kl_loss"] == results[1]["actor/kl_loss"]


def test_without_kl_nothing_is_loaded(tiny_model_dir):
    trainer = PPOTrainer(
        make_config(tiny_model_dir, "rlmesh.reference.colocated=true"), total_training_steps=1
    )
    assert trainer.reference is None
    metrics = trainer.train_step(build_batch(make_trajectories(seed=2, with_ref=False), PAD))
    assert "timing_s/ref" not in metrics


@pytest.mark.slow
def test_two_ranks_each_score_their_own_share(tiny_model_dir, service_log_probs, tmp_path):
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
        "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
        "-m", f"{PROGRAMS}.colocated_reference_ranks", str(tiny_model_dir), str(tmp_path), *KL,
    ]  # fmt: skip
    proc = subprocess.run(
        cmd, cwd=REPO, env=child_env(DS_ACCELERATOR="cpu"), capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    # 7 samples: rank 0 scores rows 0-3, rank 1 rows 4-6 (shard_rows), each only its own.
    assert [r["rows"] for r in ranks] == [4, 3]
    trajectories = make_trajectories(n_prompts=4, n=2, seed=11, with_ref=False)[:7]
    for r in ranks:  # and every rank holds the whole batch's
        for t, values in zip(trajectories, r["log_probs"], strict=True):
            n = len(t.response_ids)
            assert values[:n] == pytest.approx(service_log_probs[t.uid], abs=ATOL), t.uid
            assert not any(values[n:])
