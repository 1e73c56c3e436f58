"""The experiment trackers of ``trainer.logger`` for real, each read back from what it wrote: wandb
offline (its ``.wandb`` log parsed), mlflow's file store (through ``MlflowClient``) and a
tensorboard event file (through tensorboard's ``EventAccumulator``). Run config, step metrics and
validation generations arrive; the auth token does not."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from rlmesh.learner.run.sinks import FileStoreNames, MetricsSinks, mlflow_name, public_config, wandb_mode
from rlmesh.learner.run.validation import ValGeneration

SECRET = "s3cret-t0ken-value"
CONFIG = {
    "trainer": {"project_name": "proj", "experiment_name": "exp", "logger": ["console", "wandb"]},
    "data": {"train_batch_size": 4, "long": "x" * 7000},
    "rlmesh": {"auth_token": SECRET, "redis_url": f"redis://:{SECRET}@127.0.0.1:6379/0"},
}


def generations(step: int) -> list[ValGeneration]:
    return [
        ValGeneration(
            input=f"What is {i} + {step}?",
            output=f"{i + step}",
            score=float(i % 2),
            ground_truth=str(i + step),
            data_source="arithmetic",
            index=i,
            sample_index=0,
        )
        for i in range(2)
    ]


def log_a_run(sinks: MetricsSinks) -> None:
    """Two steps, each with a validation; a timestamp (JSONL only), a name mlflow refuses and
    one under another's name (a file store keeps each in a file at its name)."""
    for step in (1, 2):
        sinks.log_generations(step, generations(step))
        sinks.log(
            step,
            {
                "actor/pg_loss": 0.5 * step,
                "val/pass@1": 0.25 * step,
                "val/score": 0.5,
                "val/score/arithmetic": 0.5,
                "timing_start/step": 1.7e9,
                "actor/entropy": float("nan"),
            },
        )
    sinks.close()


def files_hold(root: Path, text: str) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and text.encode() in p.read_bytes()]


# ----- wandb -----

_BLOCK = 32768  # the .wandb log: LevelDB's log format, 32 KiB blocks, 7-byte record headers
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def wandb_records(path: Path):
    """The protobuf records of a run's ``.wandb`` file (wandb's transaction log)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a wandb log"
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        if _BLOCK - pos % _BLOCK < 7:  # a block's tail too short for a header is padding
            pos += _BLOCK - pos % _BLOCK
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == _FIRST:
            pending = chunk
        elif kind == _MIDDLE:
            pending += chunk
        elif kind in (_FULL, _LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending + chunk if kind == _LAST else chunk)
            pending = b""
            yield record


def wandb_history(run_dir: Path) -> tuple[dict, dict[int, dict]]:
    """(run config, {step: logged values}) from an offline run directory."""
    (log_file,) = run_dir.glob("run-*.wandb")
    config: dict = {}
    history: dict[int, dict] = {}
    for record in wandb_records(log_file):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            config = {u.key: json.loads(u.value_json) for u in record.run.config.update}
        elif kind == "history":
            row = history.setdefault(record.history.step.num, {})
            for item in record.history.item:
                keys = [item.key] if item.key else list(item.nested_key)
                node = row
                for key in keys[:-1]:
                    node = node.setdefault(key, {})
                node[keys[-1]] = json.loads(item.value_json)
    return config, history


@pytest.fixture
def wandb_env(monkeypatch, tmp_path):
    """No credentials, no mode: wandb's own files under tmp_path, not in ~."""
    pytest.importorskip("wandb", reason="wandb is not installed (pip install 'rlmesh[trackers]')")
    for var in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_MODE", "WANDB_DIR", "WANDB_BASE_URL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    for var, sub in (
        ("WANDB_CONFIG_DIR", "config"),
        ("WANDB_CACHE_DIR", "cache"),
        ("WANDB_DATA_DIR", "data"),
    ):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home" / sub))
    monkeypatch.setenv("WANDB_SILENT", "true")


def tracker_sinks(logger: str, run_root: Path) -> MetricsSinks:
    """The sinks of a run under ``run_root`` with one tracker and the test's config."""
    return MetricsSinks(
        [logger],
        jsonl_path=run_root / "metrics.jsonl",
        registry=None,
        project="proj",
        experiment="exp",
        config=CONFIG,
    )


def test_wandb_without_credentials_logs_offline_config_metrics_and_a_cumulative_table(wandb_env, tmp_path):
    assert wandb_mode() == "offline"
    run_root = tmp_path / "run"
    sinks = tracker_sinks("wandb", run_root)
    log_a_run(sinks)
    (run_dir,) = (run_root / "wandb").glob("offline-run-*")
    config, history = wandb_history(run_dir)
    assert config["trainer"] == CONFIG["trainer"] and config["data"]["train_batch_size"] == 4
    assert config["rlmesh"]["auth_token"] == "***"
    assert config["rlmesh"]["redis_url"] == "redis://:***@127.0.0.1:6379/0"
    assert not files_hold(run_root, SECRET)
    assert sorted(history) == [1, 2]
    for step in (1, 2):
        assert history[step]["actor/pg_loss"] == 0.5 * step
        assert history[step]["val/pass@1"] == 0.25 * step
        assert "timing_start/step" not in history[step] and "actor/entropy" not in history[step]
    # verl's table: a row per validation, every earlier one again; step, then input/output/score.
    table = json.loads((run_dir / "files" / history[2]["val/generations"]["path"]).read_text())
    assert table["columns"] == ["step", "input_1", "output_1", "score_1", "input_2", "output_2", "score_2"]
    assert table["data"] == [
        [1, "What is 0 + 1?", "1", 0.0, "What is 1 + 1?", "2", 1.0],
        [2, "What is 0 + 2?", "2", 0.0, "What is 1 + 2?", "3", 1.0],
    ]
    first = json.loads((run_dir / "files" / history[1]["val/generations"]["path"]).read_text())
    assert first["data"] == table["data"][:1]


def test_wandb_mode_is_wandbs_own_choice_when_the_environment_makes_one(wandb_env, monkeypatch, tmp_path):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert wandb_mode() is None
    monkeypatch.delenv("WANDB_MODE")
    (tmp_path / "netrc").write_text("machine api.wandb.ai\n  login user\n  password " + "k" * 40 + "\n")
    (tmp_path / "netrc").chmod(0o600)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    assert wandb_mode() is None  # a wandb login: online, as wandb does
    monkeypatch.setenv("WANDB_BASE_URL", "https://wandb.example.org")
    assert wandb_mode() == "offline"  # that login is for another host
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    assert wandb_mode() is None


# ----- mlflow -----


def test_mlflow_file_store_gets_params_metrics_and_a_generations_artifact_per_validation(
    monkeypatch, tmp_path
):
    pytest.importorskip("mlflow", reason="mlflow is not installed (pip install 'rlmesh[trackers]')")
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)  # restored after the test
    run_root = tmp_path / "run"
    sinks = tracker_sinks("mlflow", run_root)
    log_a_run(sinks)

    client = MlflowClient(tracking_uri=(run_root / "mlruns").as_uri())
    experiment = client.get_experiment_by_name("proj")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "exp" and run.info.status == "FINISHED"
    params = run.data.params
    assert params["trainer/project_name"] == "proj" and params["data/train_batch_size"] == "4"
    assert json.loads(params["trainer/logger"]) == ["console", "wandb"]
    assert params["rlmesh/auth_token"] == "***"
    assert len(params["data/long"]) == 6000  # mlflow's limit on a parameter's value
    assert not files_hold(run_root, SECRET)
    history = {
        name: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, name)]
        for name in ("actor/pg_loss", "val/pass_at_1")
    }
    assert sorted(history["actor/pg_loss"]) == [(1, 0.5), (2, 1.0)]
    assert sorted(history["val/pass_at_1"]) == [(1, 0.25), (2, 0.5)]
    # No timestamp, no NaN; val/score/arithmetic cannot be a file under the file val/score.
    assert set(run.data.metrics) == {"actor/pg_loss", "val/pass_at_1", "val/score", "val/score-arithmetic"}
    assert run.data.metrics["val/score-arithmetic"] == 0.5
    artifacts = [a.path for a in client.list_artifacts(run.info.run_id, "val_generations")]
    assert sorted(artifacts) == ["val_generations/step_1.json", "val_generations/step_2.json"]
    local = client.download_artifacts(run.info.run_id, "val_generations/step_2.json", str(tmp_path))
    rows = json.loads(Path(local).read_text())
    assert [(r["input"], r["output"], r["score"], r["ground_truth"]) for r in rows] == [
        ("What is 0 + 2?", "2", 0.0, "2"),
        ("What is 1 + 2?", "3", 1.0, "3"),
    ]


def test_mlflow_names_are_ones_mlflow_accepts():
    assert mlflow_name("val/pass@1") == "val/pass_at_1"  # verl's spelling
    assert mlflow_name("val/score/lighteval:MATH") == "val/score/lighteval_MATH"
    assert mlflow_name("a//b/") == "a/b"
    assert mlflow_name("val/score/../x") == "val/score/_./x"
    assert len(mlflow_name("k" * 300)) == 250


def test_file_store_names_never_put_a_metric_under_another():
    names = FileStoreNames()
    names.add(["val/score/arithmetic", "val/score", "a/b"])  # one batch: parents go first
    assert [names(n) for n in ("val/score", "val/score/arithmetic", "a/b")] == [
        "val/score",
        "val/score-arithmetic",
        "a/b",
    ]
    names.add(["a"])  # a later name that is already a directory
    names.add(["a/b/c", "val/score/arithmetic"])
    assert names("a") == "a/value" and names("a/b/c") == "a/b-c"
    assert names("val/score/arithmetic") == "val/score-arithmetic"  # given once for the run


def test_the_tracked_config_masks_secrets_and_keeps_token_counts():
    tracked = public_config(
        {
            "rlmesh": {"auth_token": SECRET, "x": {"api_key": "k", "password": None}},
            "rollout": {"max_num_batched_tokens": 8192, "url": ["http://u:pw@h:1"]},
        }
    )
    assert tracked == {
        "rlmesh": {"auth_token": "***", "x": {"api_key": "***", "password": None}},
        "rollout": {"max_num_batched_tokens": 8192, "url": ["http://u:***@h:1"]},
    }


# ----- tensorboard -----


def test_tensorboard_gets_scalars_per_step_and_generations_as_text(monkeypatch, tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard is not installed (pip install 'rlmesh[trackers]')")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.delenv("TENSORBOARD_DIR", raising=False)
    run_root = tmp_path / "run"
    sinks = MetricsSinks(
        ["tensorboard"], jsonl_path=run_root / "metrics.jsonl", registry=None, project="p", experiment="e"
    )
    log_a_run(sinks)
    events = EventAccumulator(str(run_root / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == [
        "actor/pg_loss",
        "val/pass@1",
        "val/score",
        "val/score/arithmetic",
    ]
    assert [(e.step, e.value) for e in events.Scalars("actor/pg_loss")] == [(1, 0.5), (2, 1.0)]
    texts = {
        e.step: e.tensor_proto.string_val[0].decode() for e in events.Tensors("val/generations/text_summary")
    }
    assert sorted(texts) == [1, 2]
    assert "What is 1 + 2?" in texts[2] and "**Output:** 3" in texts[2] and "What is 0 + 1?" not in texts[2]
