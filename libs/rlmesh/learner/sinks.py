"""Where step metrics go: a JSONL file, the console, Prometheus, and wandb / mlflow when they are
installed and named in ``trainer.logger`` (verl's names and the same key per step)."""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import time
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Gauge

log = logging.getLogger("rlmesh.learner")

CONSOLE_KEYS = (
    ("critic/score/mean", "score"),
    ("val/score", "val"),
    ("actor/reward_kl_penalty", "kl"),
    ("actor/pg_loss", "pg"),
    ("critic/vf_loss", "vf"),
    ("actor/entropy", "ent"),
    ("response_length/mean", "len"),
    ("perf/throughput", "tok/s"),
    ("timing_s/step", "s"),
)


# Wall-clock timestamps (Unix seconds) of when each phase began: for offline analysis of a run's
# timeline (``make bench`` reads them from metrics.jsonl), meaningless as a plotted series.
JSONL_ONLY_PREFIXES = ("timing_start/",)


def _prom_name(key: str) -> str:
    return "rlmesh_learner_" + "".join(c if c.isalnum() else "_" for c in key)


class MetricsSinks:
    def __init__(
        self,
        loggers: list[str],
        *,
        jsonl_path: Path | None,
        registry: CollectorRegistry | None,
        project: str,
        experiment: str,
        config: dict[str, Any] | None = None,
    ) -> None:
        self.jsonl_path = jsonl_path
        self.registry = registry
        self.console = "console" in loggers
        self._gauges: dict[str, Gauge] = {}
        self._wandb = self._mlflow = None
        if jsonl_path is not None:
            jsonl_path.parent.mkdir(parents=True, exist_ok=True)
        if "wandb" in loggers:
            if importlib.util.find_spec("wandb") is None:
                log.warning("trainer.logger names wandb but it is not installed; skipping it")
            else:
                import wandb

                self._wandb = wandb.init(project=project, name=experiment, config=config or {})
        if "mlflow" in loggers:
            if importlib.util.find_spec("mlflow") is None:
                log.warning("trainer.logger names mlflow but it is not installed; skipping it")
            else:
                import mlflow

                mlflow.set_experiment(project)
                self._mlflow = mlflow.start_run(run_name=experiment)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        clean = {
            k: float(v) for k, v in metrics.items() if isinstance(v, int | float) and math.isfinite(float(v))
        }
        if self.jsonl_path is not None:
            with self.jsonl_path.open("a") as f:
                f.write(json.dumps({"step": step, "time": time.time(), **clean}) + "\n")
        clean = {k: v for k, v in clean.items() if not k.startswith(JSONL_ONLY_PREFIXES)}
        if self.registry is not None:
            for key, value in clean.items():
                gauge = self._gauges.get(key)
                if gauge is None:
                    gauge = self._gauges[key] = Gauge(
                        _prom_name(key), f"learner metric {key}", registry=self.registry
                    )
                gauge.set(value)
        if self.console:
            parts = [f"{label} {clean[key]:.4g}" for key, label in CONSOLE_KEYS if key in clean]
            print(f"[learner] step {step}: " + "  ".join(parts), flush=True)
        if self._wandb is not None:
            self._wandb.log(clean, step=step)
        if self._mlflow is not None:
            import mlflow

            mlflow.log_metrics({k.replace("@", "_at_"): v for k, v in clean.items()}, step=step)

    def close(self) -> None:
        if self._wandb is not None:
            self._wandb.finish()
        if self._mlflow is not None:
            import mlflow

            mlflow.end_run()
