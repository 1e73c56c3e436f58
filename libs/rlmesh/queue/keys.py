"""Redis key names. Every key carries the run id, in a hash tag so a Redis Cluster keeps one
run's keys on one slot: two runs on one Redis never see each other's messages."""

from __future__ import annotations

import re
from dataclasses import dataclass

_RUN_ID = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")


@dataclass(frozen=True)
class RunKeys:
    run_id: str

    def __post_init__(self) -> None:
        if not _RUN_ID.match(self.run_id):
            raise ValueError(
                f"run id {self.run_id!r} must be 1-128 characters of letters, digits, '_', '.', ':' or '-'"
            )

    @property
    def prefix(self) -> str:
        return f"rlmesh:{{{self.run_id}}}"

    @property
    def prompts(self) -> str:
        return f"{self.prefix}:prompts"

    @property
    def trajectories(self) -> str:
        return f"{self.prefix}:trajectories"

    @property
    def dead_letters(self) -> str:
        return f"{self.prefix}:dead"

    @property
    def used_uids(self) -> str:
        """Trajectory uids the learner already trained on (committed steps)."""
        return f"{self.prefix}:used_uids"

    @property
    def replicas(self) -> str:
        """Index set of replica ids; each replica's registration lives at ``replica(id)`` with a TTL."""
        return f"{self.prefix}:replicas"

    def replica(self, replica_id: str) -> str:
        return f"{self.prefix}:replica:{replica_id}"

    def scoped(self, name: str) -> str:
        return f"{self.prefix}:{name}"
