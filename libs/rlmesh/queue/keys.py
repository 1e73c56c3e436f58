"""Redis key names. Every key carries the run id, in a hash tag so a Redis Cluster keeps one
run's keys on one slot: two runs on one Redis never see each other's messages. ``RunKeys`` also
carries the run's signer (queue/signing.py), so whatever is built from them signs and checks."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from rlmesh.queue.signing import Signer, signer_for

_RUN_ID = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")


@dataclass(frozen=True)
class RunKeys:
    run_id: str
    # Signs what the run's services write and checks what they read; None: the run has no token.
    signer: Signer | None = field(default=None, compare=False, repr=False)

    @classmethod
    def signed(cls, run_id: str, token: str | None) -> RunKeys:
        """The run's keys with the signer ``token`` gives (``rlmesh.auth_token``; None: unsigned)."""
        return cls(run_id, signer_for(token, run_id))

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
