"""What a finished run reports: its metrics rows, a PNG plot, per-stage token rates, the engines'
own counters, and the pieces of `make bench`'s per-step accounting (phases, counter deltas)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
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

    from rlmesh.runtime.http_auth import bearer_headers

    request = urllib.request.Request(
        engine_url(rollout_address, token) + "/get_server_info", headers=bearer_headers(token)
    )
    with urllib.request.urlopen(request, timeout=30) as resp:
        return json.loads(resp.read())


def engine_url(rollout_address: str, token: str | None = None) -> str:
    """The URL of a rollout replica's engine, as its ``Rollout.GetInfo`` gives it."""
    from rlmesh.runtime.auth import bearer_metadata
    from rlmesh.runtime.tls import sync_channel
    from rlmesh.v1 import common_pb2, rollout_pb2_grpc

    with sync_channel(rollout_address) as channel:
        stub = rollout_pb2_grpc.RolloutStub(channel)
        return stub.GetInfo(common_pb2.Empty(), timeout=10, metadata=bearer_metadata(token)).engine_url


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


# ----- make bench's per-step accounting -----------------------------------------------------------

# The learner's timed phases of a step, in the order they run (``timing_s/<phase>`` of its rows):
# the wait for the batch, the forwards (``ref``: a colocated reference's), the advantages, the
# updates, the weight push.
LEARNER_PHASES = (
    "gen",
    "ref",
    "old_log_prob",
    "values",
    "adv",
    "update_critic",
    "update_actor",
    "push_weights",
)
# Served at under this share of its ceiling, a step's generation is flagged.
FAR_BELOW_CEILING = 0.25


def phase_names(rows: Sequence[Mapping[str, float]]) -> list[str]:
    """The timed phases any of ``rows`` has: those of ``LEARNER_PHASES`` in their order, then any
    other ``timing_s/<name>`` (a phase added later shows as its own column, not inside "other")."""
    timed = {k.removeprefix("timing_s/") for r in rows for k in r if k.startswith("timing_s/")} - {"step"}
    return [p for p in LEARNER_PHASES if p in timed] + sorted(timed - set(LEARNER_PHASES))


def step_phases(row: Mapping[str, float], names: Sequence[str] | None = None) -> dict[str, float]:
    """One step's wall time (``timing_s/step``) split into its timed phases (``names``, 0 for one
    it lacks; default: its own), then ``other``: the rest of the wall time, so the parts sum to it
    (negative only if timed phases overlap)."""
    names = phase_names([row]) if names is None else names
    wall = float(row["timing_s/step"])
    parts = {name: float(row.get(f"timing_s/{name}", 0.0)) for name in names}
    return {"wall": wall, **parts, "other": wall - sum(parts.values())}


def metric_sum(text: str, name: str, **labels: str) -> float:
    """The sum of the samples named ``name`` (``..._total``, ``..._count``) in Prometheus exposition
    ``text`` whose labels include ``labels``; 0 when there are none."""
    from prometheus_client.parser import text_string_to_metric_families

    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def redis_info(text: str) -> dict[str, str]:
    """The ``key: value`` lines of a Redis ``INFO`` answer (section headers and blanks left out)."""
    out = {}
    for line in text.splitlines():
        key, sep, value = line.strip().partition(":")
        if sep and not key.startswith("#"):
            out[key] = value
    return out


def command_calls(info: Mapping[str, str]) -> dict[str, int]:
    """Calls per command from the ``cmdstat_<command>: calls=N,usec=...`` lines of ``INFO
    commandstats`` (subcommands as ``client|setname``)."""
    out = {}
    for key, value in info.items():
        if key.startswith("cmdstat_"):
            fields = dict(f.split("=", 1) for f in value.split(",") if "=" in f)
            out[key.removeprefix("cmdstat_")] = int(fields.get("calls", 0))
    return out


def counter_deltas(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    """``after - before`` for every counter in ``after`` (one new since counts from 0). A counter
    that went down was reset (its process restarted): its whole ``after`` value counts."""
    out = {}
    for key, value in after.items():
        old = before.get(key, 0.0)
        out[key] = value - old if value >= old else value
    return out


def served_share(tokens: float, window_s: float, ceiling_tokens_per_s: float) -> tuple[float, float]:
    """Tokens per second served over ``window_s``, and that rate as a share of the ceiling."""
    rate = tokens / window_s if window_s > 0 else 0.0
    return rate, rate / ceiling_tokens_per_s if ceiling_tokens_per_s > 0 else 0.0


def far_below(share: float, threshold: float = FAR_BELOW_CEILING) -> bool:
    """Whether work served at ``share`` of its ceiling is far below it."""
    return share < threshold
