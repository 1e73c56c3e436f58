"""The demo's prepare step keeps ``<workdir>/model`` and ``<workdir>/data`` pointing at what it
prepared last: the paths examples/cpu_demo.yaml and docker-compose.yml read by default."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import yaml

from rlmesh.config import load_config
from rlmesh.job import demo
from tests.support.repo import CPU_DEMO, REPO


def tiny_prepare(workdir: Path, seed: int) -> demo.Prepared:
    """The real prepare step at a size that takes seconds: one warm-up epoch of one optimizer
    step, a band of 0 so it counts as reached."""
    return demo.prepare(
        workdir,
        seed=seed,
        sft_max_epochs=1,
        sft_lr=1e-3,
        warmup_band=0.0,
        train_size=8,
        dev_size=2,
        val_size=2,
        max_operand=9,
        ops="+",
        hidden_size=16,
        num_layers=1,
    )


def fake_prepared(root: Path) -> demo.Prepared:
    """A Prepared whose directories exist, without building anything."""
    (root / "sft-model").mkdir(parents=True)
    (root / "data").mkdir()
    data = root / "data"
    return demo.Prepared(
        root / "base-model",
        root / "sft-model",
        data / "train.parquet",
        data / "dev.parquet",
        data / "test.parquet",
        {},
        0.0,
    )


def test_prepare_links_model_and_data_to_the_latest_preparation(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    workdir = Path(demo.build_parser().parse_args([]).workdir)  # the default, runs/demo
    first = tiny_prepare(workdir, seed=0)
    model, data = workdir / demo.LATEST_MODEL, workdir / demo.LATEST_DATA
    assert model.is_symlink() and data.is_symlink()
    assert model.resolve() == first.sft_model.resolve()
    assert data.resolve() == first.train.parent.resolve()

    # examples/cpu_demo.yaml, run from the repository root, now trains on what the demo prepared.
    cfg = load_config(CPU_DEMO)
    assert Path(cfg.actor_rollout_ref.model.path).resolve() == first.sft_model.resolve()
    assert (Path(cfg.actor_rollout_ref.model.path) / "config.json").is_file()
    assert Path(cfg.data.train_files).resolve() == first.train.resolve()
    assert Path(cfg.data.val_files).resolve() == first.test.resolve()
    assert Path(cfg.data.train_files).is_file() and Path(cfg.data.val_files).is_file()

    second = tiny_prepare(workdir, seed=1)
    assert second.sft_model != first.sft_model
    assert model.resolve() == second.sft_model.resolve()
    assert data.resolve() == second.train.parent.resolve()

    # A cached preparation (nothing rebuilt) moves the links back.
    again = tiny_prepare(workdir, seed=0)
    assert again.warmup_s == 0.0 and again.sft_model == first.sft_model
    assert model.resolve() == first.sft_model.resolve()
    assert sorted(p.name for p in workdir.iterdir() if p.name.startswith(".")) == []


def test_links_are_relative_so_a_moved_or_mounted_workdir_keeps_them(tmp_path):
    workdir = tmp_path / "runs" / "demo"
    prepared = fake_prepared(workdir / "prepared-abc")
    demo.link_latest(workdir, prepared)
    assert os.readlink(workdir / "model") == os.path.join("prepared-abc", "sft-model")
    assert os.readlink(workdir / "data") == os.path.join("prepared-abc", "data")
    moved = tmp_path / "elsewhere"
    (tmp_path / "runs").rename(moved)
    assert (moved / "demo" / "model").resolve() == (moved / "demo" / "prepared-abc" / "sft-model").resolve()
    assert (moved / "demo" / "data").is_dir()


def test_a_dangling_link_is_replaced(tmp_path):
    workdir = tmp_path / "demo"
    prepared = fake_prepared(workdir / "prepared-new")
    (workdir / "model").symlink_to("prepared-gone/sft-model")
    demo.link_latest(workdir, prepared)
    assert (workdir / "model").resolve() == prepared.sft_model.resolve()


def test_a_real_directory_is_left_alone(tmp_path, capsys):
    workdir = tmp_path / "demo"
    prepared = fake_prepared(workdir / "prepared-abc")
    own = workdir / "model"
    own.mkdir()
    (own / "config.json").write_text("{}")
    demo.link_latest(workdir, prepared)
    assert not own.is_symlink() and (own / "config.json").read_text() == "{}"
    assert "not a link: left as it is" in capsys.readouterr().out
    assert (workdir / "data").resolve() == prepared.train.parent.resolve()


@pytest.mark.parametrize("service", ["reference", "rollout", "learner"])
def test_compose_defaults_are_the_demo_links(service):
    # ${VAR:-default} with VAR unset, as compose expands it.
    command = yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"][service]["command"]
    defaults = {
        m.group(1): m.group(2) for arg in command for m in re.finditer(r"\$\{([A-Z_]+):-([^}]*)\}", arg)
    }
    workdir = Path(demo.build_parser().parse_args([]).workdir)
    assert defaults.get("MODEL") == str(workdir / demo.LATEST_MODEL)
    if service == "learner":
        assert defaults.get("DATA") == str(workdir / demo.LATEST_DATA)


def test_prepare_only_needs_no_redis_and_starts_no_run(tmp_path, monkeypatch, capsys):
    # docker-compose.yml's prepare service: an image with no redis-server builds the model and data.
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))
    argv = ["--prepare-only", "--workdir", str(tmp_path / "w"), "--sft-max-epochs", "1", "--warmup-band", "0"]
    small = ["--train-size", "8", "--dev-size", "2", "--val-size", "2", "--max-operand", "9"]
    assert demo.main([*argv, *small, "--hidden-size", "16", "--num-layers", "1"]) == 0
    assert (tmp_path / "w" / demo.LATEST_MODEL / "config.json").is_file()
    assert (tmp_path / "w" / demo.LATEST_DATA / "train.parquet").is_file()
    out = capsys.readouterr().out
    assert "prepared: model" in out and not list((tmp_path / "w").glob("demo-*"))
