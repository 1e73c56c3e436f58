"""Every key of the schema either is read by the code or is in the ignored list with a reason, and
a config that sets ignored keys is told which, once (issue: no silently ignored key)."""

from __future__ import annotations

import ast
import subprocess
import sys
import warnings
from functools import cache
from pathlib import Path

from rlmesh.config import ConfigWarning, config_keys, ignored_keys, load_config
from rlmesh.config.ignored import IGNORED, ignored_reason
from tests.support.processes import child_env
from tests.support.repo import REPO

# Where a key is only validated, not acted on: reading it there does not count.
NOT_USES = {
    "libs/rlmesh/config/checks.py",
    "libs/rlmesh/config/docs.py",
    "libs/rlmesh/config/ignored.py",
    "libs/rlmesh/config/key_catalog.py",
}
# Keys read under a composed name, with where (a test of that code covers each).
READ_BY_COMPOSED_NAME = {
    "data.train_max_samples": "rlmesh.data.dataset.PromptDataset.from_config: f'{split}_max_samples'",
    "data.val_max_samples": "rlmesh.data.dataset.PromptDataset.from_config: f'{split}_max_samples'",
}


@cache
def names_read() -> frozenset[str]:
    """Attribute names loaded and string constants used anywhere in libs/ and services/."""
    names: set[str] = set()
    for root in ("libs/rlmesh", "services"):
        for path in (REPO / root).rglob("*.py"):
            rel = path.relative_to(REPO).as_posix()
            if rel in NOT_USES or "/v1/" in rel:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                    names.add(node.attr)
                elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                    names.add(node.value)
    return frozenset(names)


def only_the_default_is_accepted(type_str: str) -> bool:
    # e.g. algorithm.use_pf_ppo: false, rollout_rs: null: anything else is refused at load time.
    return type_str in ("null", "false", "'vanilla'")


def test_every_key_is_read_by_the_code_or_ignored_with_a_reason():
    unread, unexplained = [], []
    for item in config_keys():
        if item.compat:
            if ignored_reason(item.key) is None:
                unexplained.append(item.key)
            continue
        leaf = item.key.rsplit(".", 1)[1]
        if (
            leaf in names_read()
            or item.key in READ_BY_COMPOSED_NAME
            or only_the_default_is_accepted(item.type)
        ):
            continue
        unread.append(item.key)
    assert not unread, f"keys no code reads; implement them or mark them compat with a reason: {unread}"
    assert not unexplained, f"ignored keys without a reason in rlmesh.config.ignored.IGNORED: {unexplained}"


def test_the_ignored_list_names_only_ignored_keys():
    # A pattern that matches no ignored key is stale: the key was implemented or renamed.
    compat = [item.key for item in config_keys() if item.compat]
    import fnmatch

    stale = [p for p, _ in IGNORED if not any(fnmatch.fnmatchcase(k, p) for k in compat)]
    assert not stale, stale


def test_a_verl_command_line_gets_one_warning_naming_exactly_its_ignored_keys():
    line = [
        "trainer.n_gpus_per_node=1",
        "actor_rollout_ref.actor.strategy=fsdp2",
        "actor_rollout_ref.rollout.mode=async",
        "actor_rollout_ref.model.use_remove_padding=true",
        "actor_rollout_ref.actor.ulysses_sequence_parallel_size=1",
        "actor_rollout_ref.rollout.disable_log_stats=false",
        "critic.model.fsdp_config.wrap_policy.min_num_params=100",
    ]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_config(None, line)
    ignored = [
        w for w in caught if issubclass(w.category, ConfigWarning) and "ignored by rlmesh" in str(w.message)
    ]
    assert len(ignored) == 1
    listed = [ln.split("=", 1)[0].strip() for ln in str(ignored[0].message).splitlines()[1:]]
    assert listed == [
        "actor_rollout_ref.actor.strategy",
        "actor_rollout_ref.actor.ulysses_sequence_parallel_size",
        "actor_rollout_ref.rollout.disable_log_stats",
        "actor_rollout_ref.rollout.mode",
        "critic.model.fsdp_config.wrap_policy",
    ]
    assert [k for k, _, _ in ignored_keys(None, line)] == listed


def test_a_config_without_ignored_keys_gets_no_such_warning():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_config(None, ["trainer.critic_warmup=0", "trainer.save_freq=5"])
    assert not [w for w in caught if "ignored by rlmesh" in str(w.message)]


def test_the_resolved_config_a_service_loads_repeats_no_default_ignored_key(tmp_path: Path):
    from rlmesh.config import dump_yaml

    cfg = load_config(None, ["actor_rollout_ref.rollout.disable_log_stats=false"], warn=False)
    path = tmp_path / "resolved.yaml"
    path.write_text(dump_yaml(cfg))
    assert [k for k, _, _ in ignored_keys(path)] == ["actor_rollout_ref.rollout.disable_log_stats"]
    assert load_config(path, warn=False) == cfg


def test_config_validate_prints_the_ignored_keys(tmp_path: Path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlmesh.cli",
            "config",
            "validate",
            "--schema-only",  # the defaults name files this machine does not have
            "actor_rollout_ref.rollout.disable_log_stats=false",
        ],
        cwd=REPO,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert "configuration is valid" in proc.stdout
    assert "rlmesh: warning: 1 verl key(s) set here are accepted but ignored by rlmesh:" in proc.stderr
    assert "  actor_rollout_ref.rollout.disable_log_stats=false: an inference-server option" in proc.stderr
