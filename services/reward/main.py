"""Reward service: scores responses (rule-based, reward model, or user code) over gRPC `Reward.Score`.

Shell for now: it serves gRPC health, reflection and Prometheus metrics and stops cleanly on
SIGTERM, and answers the `rlmesh.v1.Reward` RPCs with UNIMPLEMENTED until issue 6 implements them.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from rlmesh.config import RLMeshConfig
from rlmesh.runtime.entry import service_main
from rlmesh.runtime.server import GrpcService
from rlmesh.v1 import reward_pb2, reward_pb2_grpc

SERVICE_NAME = reward_pb2.DESCRIPTOR.services_by_name["Reward"].full_name


async def build(service: GrpcService, cfg: RLMeshConfig) -> None:
    service.add_servicer(
        reward_pb2_grpc.add_RewardServicer_to_server, reward_pb2_grpc.RewardServicer(), SERVICE_NAME
    )


def main(argv: Sequence[str] | None = None) -> int:
    return service_main("reward", build, argv, description=__doc__.splitlines()[0])


if __name__ == "__main__":
    sys.exit(main())
