"""docs/train.md's walkthrough to its end: the reader's files and commands, then its
``rlmesh train`` for two steps as a subprocess. The reward's extra values reach ``metrics.jsonl``
under verl's validation names and as ``reward_extra/<key>/mean`` every step."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.support.processes import child_env
from tests.support.walkthrough import follow


def test_the_walkthrough_trains_and_logs_the_rewards_extra_values(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    runs: list[subprocess.CompletedProcess[str]] = []

    def train(argv: list[str]) -> None:
        short = ["trainer.total_training_steps=2", "trainer.test_freq=2", "trainer.save_freq=2"]
        runs.append(
            subprocess.run(
                [sys.executable, "-m", "rlmesh.cli", *argv, *short],
                cwd=tmp_path,
                env=child_env(),
                capture_output=True,
                text=True,
                timeout=420,
            )
        )

    follow(tmp_path, train=train)
    (run,) = runs
    assert run.returncode == 0, f"{run.stdout[-4000:]}\n{run.stderr[-4000:]}"
    rows = {
        r["step"]: r
        for r in map(json.loads, (tmp_path / "byo_run" / "metrics.jsonl").read_text().splitlines())
    }
    assert set(rows) == {0, 1, 2}
    for step in (1, 2):
        assert 0.0 <= rows[step]["reward_extra/well_formed/mean"] <= 1.0
        assert 0.0 <= rows[step]["reward_extra/length/mean"] <= 8.0  # at most max_response_length words
    for step in (0, 2):
        row = rows[step]
        assert row["val-core/sort_digits/reward/mean@1"] == row["val/score"]
        assert 0.0 <= row["val-aux/sort_digits/well_formed/mean@1"] <= 1.0
        assert "val-aux/sort_digits/length/mean@1" in row
    assert (tmp_path / "byo_run" / "actor-hf" / "model.safetensors").exists()
