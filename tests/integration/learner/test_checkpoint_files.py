"""What a learner checkpoint holds on disk: no secret in its config, no pickle anywhere (RNG state as
JSON, every tensor file loadable with weights_only=True), and it resumes from that."""

from __future__ import annotations

import json
import random

import torch

from rlmesh.config import load_config
from rlmesh.learner import PPOTrainer, build_batch
from rlmesh.learner.checkpoints.export import export_checkpoint
from rlmesh.learner.checkpoints.store import load_tensors
from tests.support.learner import PAD, make_config, make_trajectories

TOKEN = "tok-checkpoint-0123456789"
REDIS_PW = "redis-pw-checkpoint"
PROM_PW = "prom-pw-checkpoint"
SECRETS = [
    f"rlmesh.auth_token={TOKEN}",
    f"rlmesh.redis_url=redis://rlmesh:{REDIS_PW}@127.0.0.1:6379/0",
    f"rlmesh.control.prometheus_url=http://admin:{PROM_PW}@127.0.0.1:9090",
]


def test_a_zero2_checkpoint_holds_no_secret_and_no_pickle_and_resumes(tiny_model_dir, tmp_path):
    cfg = make_config(tiny_model_dir, *SECRETS, estimator="gae", stage=2)
    trainer = PPOTrainer(cfg, total_training_steps=10)
    trainer.train_step(build_batch(make_trajectories(seed=11), PAD))
    path = tmp_path / "global_step_1"
    trainer.save_checkpoint(str(path), {"step": 1})
    want = (random.random(), torch.rand(3).tolist())

    for f in path.rglob("*"):
        if f.is_file():
            data = f.read_bytes()
            for secret in (TOKEN, REDIS_PW, PROM_PW):
                assert secret.encode() not in data, f"{secret} in {f}"
    saved = load_config(path / "config.yaml", [])  # `rlmesh export` loads it
    assert saved.rlmesh.token() == "***" and saved.rlmesh.redis_url == "redis://rlmesh:***@127.0.0.1:6379/0"
    assert saved.rlmesh.control.prometheus_url == "http://admin:***@127.0.0.1:9090"
    assert sorted(p.name for p in (path / "rng").iterdir()) == ["rank_0.json"]
    assert set(json.loads((path / "rng" / "rank_0.json").read_text())) >= {"python", "numpy", "torch"}
    tensor_files = sorted(path.rglob("*.pt"))
    assert any("optim_states" in f.name for f in tensor_files)  # ZeRO-2 partitions
    for f in tensor_files:
        load_tensors(f)

    resumed = PPOTrainer(cfg, total_training_steps=10)
    assert resumed.load_checkpoint(str(path)) == {"step": 1}
    assert (random.random(), torch.rand(3).tolist()) == want
    exported = export_checkpoint(path, tmp_path / "hf")
    assert (exported / "config.json").is_file()
