"""Where step metrics and validation generations go: metrics.jsonl, the console, Prometheus, and
the trackers ``trainer.logger`` names (wandb, mlflow, tensorboard) with verl's keys; defaults and
read-back tests in docs/train.md#experiment-trackers."""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import netrc
import os
import posixpath
import re
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from prometheus_client import CollectorRegistry, Gauge

from rlmesh.config.secrets import public_config
from rlmesh.learner.run.validation import ValGeneration

log = logging.getLogger("rlmesh.learner")

CONSOLE_KEYS = (
    ("critic/score/mean", "score"),
    ("reward/failed_ratio", "rfail"),
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

VAL_GENERATIONS_FILE = "val_generations.jsonl"
VAL_GENERATIONS_KEY = "val/generations"  # verl's wandb / tensorboard key

# mlflow's limits (mlflow.utils.validation): names of letters, digits, ``_ - . / space``, at most
# 250 characters; a parameter value at most 6000; 100 parameters and 1000 metrics per batch.
_MLFLOW_NAME_MAX = 250
_MLFLOW_PARAM_MAX = 6000
_MLFLOW_PARAMS_PER_BATCH = 100
_MLFLOW_METRICS_PER_BATCH = 1000
_MLFLOW_BAD_CHARS = re.compile(r"[^\w.\- /]")

# A console line shows this much of a validation prompt and response.
_CONSOLE_TEXT = 160


def _prom_name(key: str) -> str:
    return "rlmesh_learner_" + "".join(c if c.isalnum() else "_" for c in key)


def _walk(value: Any, path: str = "", sep: str = ".") -> Iterator[tuple[str, Any]]:
    if isinstance(value, dict) and value:
        for key, sub in value.items():
            yield from _walk(sub, f"{path}{sep}{key}" if path else str(key), sep)
    else:
        yield path, value


def mlflow_name(key: str) -> str:
    """``key`` as a name mlflow accepts: ``@`` spelled ``_at_`` (verl's choice), other characters
    outside letters, digits and ``_ - . / space`` as ``_``, no empty path part nor one that
    starts with a dot (mlflow refuses names that a file path would resolve to another)."""
    name = _MLFLOW_BAD_CHARS.sub("_", key.replace("@", "_at_"))
    parts = ["_" + p[1:] if p.startswith(".") else p for p in name.split("/") if p]
    name = "/".join(parts)[:_MLFLOW_NAME_MAX].rstrip("/") or "_"
    return name if posixpath.normpath(name) == name else name.replace("/", "_")


def mlflow_params(config: dict[str, Any]) -> dict[str, str]:
    """The config flattened as verl does (``trainer/logger``), each value a string within mlflow's
    length limit (lists as JSON)."""
    params: dict[str, str] = {}
    for path, value in _walk(public_config(config), sep="/"):
        text = json.dumps(value) if isinstance(value, list | dict) else str(value)
        if len(text) > _MLFLOW_PARAM_MAX:
            text = text[: _MLFLOW_PARAM_MAX - 3] + "..."
        params[mlflow_name(path)] = text
    return params


class FileStoreNames:
    """Names for mlflow's file store, which keeps each metric (or parameter) in a file at its
    name's path: ``val/score`` and ``val/score/arithmetic`` cannot both be kept there. A name
    with a kept name as an ancestor joins at that point with ``-`` (``val/score-arithmetic``);
    one that is already a directory becomes ``<name>/value``. Names are given out in sorted
    order within a batch (parents first) and never change for the run; other stores keep every
    name as it is."""

    def __init__(self) -> None:
        self.given: dict[str, str] = {}
        self.files: set[str] = set()
        self.dirs: set[str] = set()

    def __call__(self, name: str) -> str:
        return self.given[name]

    def add(self, names: Iterator[str] | list[str]) -> None:
        for name in sorted(set(names) - self.given.keys()):
            parts = name.split("/")
            out = parts[0]
            for part in parts[1:]:
                out += ("-" if out in self.files else "/") + part
            if out in self.dirs:
                out += "/value"
            while out in self.files or out in self.dirs:
                out += "_"
            self.given[name] = out
            self.files.add(out)
            pieces = out.split("/")
            self.dirs.update("/".join(pieces[:i]) for i in range(1, len(pieces)))


def wandb_mode() -> str | None:
    """``offline`` when the environment neither picks a mode (``WANDB_MODE``) nor holds
    credentials; None (wandb's choice) otherwise."""
    if os.environ.get("WANDB_MODE"):
        return None
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return None
    host = urlparse(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname or ""
    path = os.environ.get("NETRC") or os.path.expanduser("~/.netrc")
    try:
        if netrc.netrc(path).authenticators(host):
            return None
    except (OSError, netrc.NetrcParseError):
        pass
    return "offline"


class _Tensorboard:
    def __init__(self, log_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir = log_dir
        self.writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def log_generations(self, step: int, samples: Sequence[ValGeneration]) -> None:
        parts = [f"**Validation generations, step {step}**\n"]
        for i, s in enumerate(samples, start=1):
            parts.append(
                f"### Sample {i}\n\n**Input:** {s.input}\n\n**Output:** {s.output}\n\n"
                f"**Score:** {s.score}\n\n**Ground truth:** {s.ground_truth}\n\n---\n"
            )
        self.writer.add_text(VAL_GENERATIONS_KEY, "\n".join(parts), step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class _Mlflow:
    """A run in an mlflow tracking store through ``MlflowClient``: nothing global (no active run,
    no process-wide tracking URI) is set, so other mlflow use in the process is left alone."""

    def __init__(self, uri: str, project: str, experiment: str, config: dict[str, Any]) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.file_store = urlparse(uri).scheme in ("", "file")
        if self.file_store:
            # mlflow 3 keeps its file store only when asked to (it is in maintenance mode).
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.uri = uri
        self.client = MlflowClient(tracking_uri=uri)
        found = self.client.get_experiment_by_name(project)
        experiment_id = found.experiment_id if found else self.client.create_experiment(project)
        self.run_id = self.client.create_run(experiment_id, run_name=experiment).info.run_id
        self.metric_names = FileStoreNames()
        param_names = FileStoreNames()
        values = mlflow_params(config)
        param_names.add(list(values))
        params = [Param(param_names(k) if self.file_store else k, v) for k, v in values.items()]
        for i in range(0, len(params), _MLFLOW_PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, params=params[i : i + _MLFLOW_PARAMS_PER_BATCH])

    def log(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        named = {mlflow_name(k): v for k, v in metrics.items()}
        if self.file_store:
            self.metric_names.add(list(named))
            named = {self.metric_names(k): v for k, v in named.items()}
        batch = [Metric(k, v, now, step) for k, v in named.items()]
        for i in range(0, len(batch), _MLFLOW_METRICS_PER_BATCH):
            self.client.log_batch(self.run_id, metrics=batch[i : i + _MLFLOW_METRICS_PER_BATCH])

    def log_generations(self, step: int, samples: Sequence[ValGeneration]) -> None:
        rows = [s.row() for s in samples]
        self.client.log_text(self.run_id, json.dumps(rows, indent=1), f"val_generations/step_{step}.json")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


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
        run_dir: Path | None = None,
    ) -> None:
        """``config``: the resolved run config (``cfg.model_dump(mode="json")``), given to wandb
        and mlflow with its secrets masked. ``run_dir``: where trackers write by default (the
        directory of ``jsonl_path`` when not given)."""
        self.jsonl_path = jsonl_path
        self.registry = registry
        self.console = "console" in loggers
        self._gauges: dict[str, Gauge] = {}
        self._gauge_keys: dict[str, str] = {}  # Prometheus name -> the metric key that has it
        self._collided: set[str] = set()
        self._wandb: Any = None
        self._wandb_rows: list[list[Any]] = []
        self._wandb_columns: list[str] = []
        self._mlflow: _Mlflow | None = None
        self._tensorboard: _Tensorboard | None = None
        if run_dir is None:
            run_dir = jsonl_path.parent if jsonl_path is not None else Path(".")
        if jsonl_path is not None:
            jsonl_path.parent.mkdir(parents=True, exist_ok=True)
        tracked = public_config(config)
        if "wandb" in loggers and self._installed("wandb"):
            import wandb

            mode = wandb_mode()
            kwargs: dict[str, Any] = {"mode": mode} if mode else {}
            if not os.environ.get("WANDB_DIR"):
                run_dir.mkdir(parents=True, exist_ok=True)
                kwargs["dir"] = str(run_dir)
            if mode == "offline":
                log.warning(
                    "wandb: no WANDB_API_KEY or wandb login and no WANDB_MODE: logging offline "
                    "under %s (wandb sync uploads it later)",
                    kwargs.get("dir") or os.environ.get("WANDB_DIR"),
                )
            self._wandb = wandb.init(project=project, name=experiment, config=tracked, **kwargs)
        if "mlflow" in loggers and self._installed("mlflow"):
            uri = os.environ.get("MLFLOW_TRACKING_URI") or (run_dir / "mlruns").resolve().as_uri()
            self._mlflow = _Mlflow(uri, project, experiment, tracked)
        if "tensorboard" in loggers and self._installed("tensorboard"):
            tb_dir = os.environ.get("TENSORBOARD_DIR")
            self._tensorboard = _Tensorboard(Path(tb_dir) if tb_dir else run_dir / "tensorboard")

    @staticmethod
    def _installed(name: str) -> bool:
        if importlib.util.find_spec(name) is None:
            log.warning(
                "trainer.logger names %s but it is not installed (pip install 'rlmesh[trackers]'); "
                "skipping it",
                name,
            )
            return False
        return True

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
                    name = _prom_name(key)
                    taken = self._gauge_keys.setdefault(name, key)
                    if taken != key:  # e.g. val/score/a.b and val/score/a_b: one gauge name
                        if key not in self._collided:
                            self._collided.add(key)
                            log.warning(
                                "metric %s has the Prometheus name %s of metric %s: it is logged to "
                                "metrics.jsonl and the trackers, not as a gauge",
                                key, name, taken,
                            )  # fmt: skip
                        continue
                    gauge = self._gauges[key] = Gauge(name, f"learner metric {key}", registry=self.registry)
                gauge.set(value)
        if self.console:
            parts = [f"{label} {clean[key]:.4g}" for key, label in CONSOLE_KEYS if key in clean]
            print(f"[learner] step {step}: " + "  ".join(parts), flush=True)
        if self._wandb is not None:
            self._wandb.log(clean, step=step)
        if self._mlflow is not None:
            self._mlflow.log(step, clean)
        if self._tensorboard is not None:
            self._tensorboard.log(step, clean)

    def log_generations(self, step: int, samples: Sequence[ValGeneration]) -> None:
        """The validation samples chosen to log (``validation.select_generations``) to every
        sink; nothing when there are none."""
        if not samples:
            return
        if self.jsonl_path is not None:
            rows = [s.row() for s in samples]
            with (self.jsonl_path.parent / VAL_GENERATIONS_FILE).open("a") as f:
                f.write(json.dumps({"step": step, "time": time.time(), "samples": rows}) + "\n")
        if self.console:
            print(f"[learner] validation generations after step {step}:", flush=True)
            for i, s in enumerate(samples, start=1):
                print(
                    f"  {i}. score {s.score:.4g}  input {_short(s.input)}  output {_short(s.output)}",
                    flush=True,
                )
        if self._wandb is not None:
            self._log_wandb_table(step, samples)
        if self._mlflow is not None:
            self._mlflow.log_generations(step, samples)
        if self._tensorboard is not None:
            self._tensorboard.log_generations(step, samples)

    def _log_wandb_table(self, step: int, samples: Sequence[ValGeneration]) -> None:
        """verl's table: a row per validation, ``step`` then ``input_i, output_i, score_i`` for
        each sample, every earlier row logged again (a wandb table is immutable once logged)."""
        import wandb

        if not self._wandb_columns:
            self._wandb_columns = ["step"] + [
                f"{name}_{i}" for i in range(1, len(samples) + 1) for name in ("input", "output", "score")
            ]
        row: list[Any] = [step]
        for s in samples:
            row += [s.input, s.output, s.score]
        width = len(self._wandb_columns)
        self._wandb_rows.append((row + [None] * width)[:width])
        table = wandb.Table(columns=self._wandb_columns, data=self._wandb_rows)
        self._wandb.log({VAL_GENERATIONS_KEY: table}, step=step)

    def close(self) -> None:
        """Ends the trackers' runs; what they logged is on disk when it returns."""
        if self._wandb is not None:
            import wandb

            self._wandb.finish()
            self._wandb = None
            # finish() can return before wandb's service has written an offline run's log;
            # teardown waits for the service to stop (atexit would, but only at exit).
            wandb.teardown()
        if self._mlflow is not None:
            self._mlflow.close()
            self._mlflow = None
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None


def _short(text: str) -> str:
    flat = " ".join(text.split())
    return repr(flat if len(flat) <= _CONSOLE_TEXT else flat[: _CONSOLE_TEXT - 3] + "...")
