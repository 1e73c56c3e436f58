"""Learner service: PPO under DeepSpeed (actor + critic), weight push, checkpoints.

Shell for now: it serves gRPC health, reflection and Prometheus metrics and stops cleanly on
SIGTERM, and answers the `rlmesh.v1.Learner` RPCs with UNIMPLEMENTED until issue 7 implements them.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from rlmesh.config import RLMeshConfig
from rlmesh.runtime.entry import service_main
from rlmesh.runtime.server import GrpcService
from rlmesh.v1 import learner_pb2, learner_pb2_grpc

SERVICE_NAME = learner_pb2.DESCRIPTOR.services_by_name["Learner"].full_name


async def build(service: GrpcService, cfg: RLMeshConfig) -> None:
    service.add_servicer(
        learner_pb2_grpc.add_LearnerServicer_to_server, learner_pb2_grpc.LearnerServicer(), SERVICE_NAME
    )


def main(argv: Sequence[str] | None = None) -> int:
    return service_main("learner", build, argv, description=__doc__.splitlines()[0])


if __name__ == "__main__":
    sys.exit(main())
