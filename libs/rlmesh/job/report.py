"""What a finished run reports: its metrics rows, a PNG plot, per-stage token rates, and the
engines' own counters."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

PLOTTED = (
    ("critic/score/mean", "training reward (mean score)"),
    ("actor/reward_kl_penalty", "KL to the reference"),
    ("val/score", "validation accuracy"),
)


def read_metrics(path: Path) -> list[dict[str, float]]:
    """The rows of a learner's ``metrics.jsonl`` (none when it does not exist yet)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot(rows: list[dict[str, float]], out: Path) -> None:
    """Training reward, KL to the reference and validation score against the PPO step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def series(key: str) -> tuple[list[float], list[float]]:
        pts = [(r["step"], r[key]) for r in rows if key in r]
        return [p[0] for p in pts], [p[1] for p in pts]

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for ax, (key, title) in zip(axes, PLOTTED, strict=True):
        x, y = series(key)
        ax.plot(x, y, marker="o" if key == "val/score" else None, markersize=4)
        ax.set_title(title)
        ax.set_xlabel("PPO step")
        ax.grid(alpha=0.3)
    axes[2].set_ylim(0, 1)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def engine_server_info(rollout_address: str, token: str | None = None) -> dict[str, Any]:
    """The ``/get_server_info`` of a rollout replica's engine (found through ``Rollout.GetInfo``)."""
    import urllib.request

    import grpc

    from rlmesh.runtime.auth import bearer_metadata
    from rlmesh.v1 import common_pb2, rollout_pb2_grpc

    metadata = bearer_metadata(token)
    with grpc.insecure_channel(rollout_address) as channel:
        stub = rollout_pb2_grpc.RolloutStub(channel)
        url = stub.GetInfo(common_pb2.Empty(), timeout=10, metadata=metadata).engine_url
    with urllib.request.urlopen(url + "/get_server_info", timeout=30) as resp:
        return json.loads(resp.read())


def stage_rates(rows: list[dict[str, float]], engines: Sequence[dict[str, Any]] = ()) -> dict[str, float]:
    """Tokens per second per stage: generation from the engines' own counters (tokens over the time
    each spent computing; the learner's wait for a batch says nothing of it when generation runs
    ahead, asynchronously), the rest from the learner's timings."""
    train = [r for r in rows if "timing_s/step" in r]
    if not train:
        return {}

    def total(key: str) -> float:
        return sum(r.get(key, 0.0) for r in train)

    tokens = total("training/tokens")
    response_tokens = total("training/response_tokens")
    update = total("timing_s/update_actor") + total("timing_s/update_critic")
    forward = total("timing_s/old_log_prob") + total("timing_s/values")
    generated = sum(float(e.get("tokens_generated", 0)) for e in engines)
    engine_busy = sum(float(e.get("busy_s", 0.0)) for e in engines)
    return {
        "generate_tokens_per_s": generated / engine_busy
        if engine_busy > 0
        else response_tokens / max(total("timing_s/gen"), 1e-9),
        "learner_forward_tokens_per_s": tokens / max(forward, 1e-9),
        "learner_update_tokens_per_s": tokens / max(update, 1e-9),
        "step_tokens_per_s": tokens / max(total("timing_s/step"), 1e-9),
    }
