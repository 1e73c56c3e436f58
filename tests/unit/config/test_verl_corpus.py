"""verl's own command lines and generated configs load as written (issue 29): every example line of
tests/support/verl_corpus/lines.yaml validates, and every leaf of verl's generated PPO config of each
release acts, is read under rlmesh's name, or is named ignored with its reason."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import yaml

from rlmesh.config import ConfigWarning, load_config
from rlmesh.config.ignored import ignored_reason
from rlmesh.config.key_catalog import config_key
from rlmesh.config.verl_map import MOVED

CORPUS = Path(__file__).parents[2] / "support" / "verl_corpus"
LINES = yaml.safe_load((CORPUS / "lines.yaml").read_text())
GENERATED = sorted((CORPUS / "generated").glob("*.yaml"))


@pytest.fixture(autouse=True)
def _no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    # The engine verl's vllm maps to depends on the machine; these tests read the CPU mapping.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")


def _load(path: str | None, args: list[str]) -> tuple[Any, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load_config(path, args)
    return cfg, [str(w.message) for w in caught if issubclass(w.category, ConfigWarning)]


def _leaves(node: Any, prefix: str = "") -> list[str]:
    if isinstance(node, dict) and node:
        return [leaf for k, v in node.items() for leaf in _leaves(v, f"{prefix}{k}.")]
    return [prefix[:-1]]


def _leaf_fate(leaf: str) -> str | None:
    """How rlmesh takes one of verl's keys: 'acts', 'mapped', 'ignored: why', or None (unknown)."""
    parts = leaf.split(".")
    if parts[-1] == "_target_":
        return "ignored: Hydra's dataclass marker"
    for src, dst in MOVED:
        if leaf == src or leaf.startswith(src + "."):
            return "mapped" if config_key(dst) or _under_section(dst) else None
    for i in range(len(parts), 0, -1):
        item = config_key(".".join(parts[:i]))
        if item is None:
            continue
        if not item.compat:
            # a mapping field (engine_kwargs, override_config) takes any entry
            return "acts" if i == len(parts) or item.type.startswith("dict") else None
        why = ignored_reason(item.key)
        return f"ignored: {why}" if why else None
    return None


def _under_section(key: str) -> bool:
    from rlmesh.config.key_catalog import known_paths

    return key in known_paths()


@pytest.mark.parametrize("line", LINES, ids=[f"{x['ref']}:{x['source']}" for x in LINES])
def test_example_line_validates(line: dict[str, Any]) -> None:
    cfg, notes = _load(None, line["args"])
    # verl's engines run on the engine rlmesh has here, and the line is told so
    if any(a.startswith("actor_rollout_ref.rollout.name=vllm") for a in line["args"]):
        assert cfg.actor_rollout_ref.rollout.name == "embedded"
        assert any("actor_rollout_ref.rollout.name=vllm -> embedded" in n for n in notes), notes
    ignored = next((n for n in notes if "accepted but ignored" in n), "")
    for arg in line["args"]:
        key = arg.partition("=")[0].lstrip("+")
        fate = _leaf_fate(key)
        assert fate is not None, f"{key}: neither acts, nor is mapped, nor is named"
        if fate.startswith("ignored") and config_key(key) is not None:
            assert f"  {key}=" in ignored, f"{key} is ignored but the warning does not name it:\n{ignored}"


@pytest.mark.parametrize("path", GENERATED, ids=[p.stem for p in GENERATED])
def test_every_leaf_of_verls_generated_config_is_known(path: Path) -> None:
    tree = yaml.safe_load(path.read_text())
    unknown = [leaf for leaf in _leaves(tree) if _leaf_fate(leaf) is None]
    assert not unknown, f"verl {path.stem}: {len(unknown)} key(s) neither act nor are named: {unknown}"


@pytest.mark.parametrize("path", GENERATED, ids=[p.stem for p in GENERATED])
def test_verls_generated_config_loads(path: Path) -> None:
    cfg, _ = _load(str(path), [])
    # verl marks the engine required ('???'); rlmesh picks the one this machine runs
    assert cfg.actor_rollout_ref.rollout.name == "embedded"


@pytest.mark.parametrize("line", LINES, ids=[f"{x['ref']}:{x['source']}" for x in LINES])
def test_example_line_validates_and_is_placed_on_a_gpu_machine(line: dict[str, Any], monkeypatch) -> None:
    """Where verl's vllm is SGLang (a GPU machine: what this one lacks is faked, nothing else), every
    line still loads and its trainer.n_gpus_per_node gives a plan: ranks and replicas on its GPUs."""
    from rlmesh.config import verl_map
    from rlmesh.config.placement import plan_gpus

    monkeypatch.setattr(verl_map, "gpu_present", lambda: True)
    cfg, _ = _load(None, line["args"])
    assert cfg.actor_rollout_ref.rollout.name == "sglang"
    plan = plan_gpus(cfg)
    assert plan is not None and {p.name for p in plan.placed} >= {"learner", "rollout-0"}
    assert max(g for p in plan.placed for g in p.gpus) < cfg.trainer.n_gpus_per_node
