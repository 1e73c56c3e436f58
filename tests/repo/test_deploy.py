"""The compose file's commands are real rlmesh commands with valid configurations (no Docker
engine runs here, so this is the check that can run)."""

import re

import yaml

from rlmesh.cli import service_entry_points
from rlmesh.config import load_config
from tests.support.repo import REPO


def expand(arg: str) -> str:
    # ${VAR:-default} as compose expands it with VAR unset.
    return re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", arg)


def test_every_compose_service_command_is_a_valid_rlmesh_serve():
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    known = set(service_entry_points())
    rlmesh_services = {
        name: svc for name, svc in compose["services"].items() if svc.get("image") == "rlmesh:latest"
    }
    assert set(rlmesh_services) == {"reward", "reference", "rollout", "learner"}
    for name, svc in rlmesh_services.items():
        command = [expand(a) for a in svc["command"]]
        assert command[:2] == ["serve", name] and name in known
        config = command[command.index("-c") + 1]
        assert (REPO / config).exists()
        overrides = command[command.index("-c") + 2 :]
        cfg = load_config(REPO / config, overrides)
        assert cfg.rlmesh.run_id == "compose" and cfg.rlmesh.redis_url == "redis://redis:6379/0"
        assert getattr(cfg.rlmesh, name).host == "0.0.0.0"
