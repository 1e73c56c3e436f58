"""Rollout service: turns prompt tasks into scored trajectories with an SGLang-API engine.

Shell for now: it serves gRPC health, reflection and Prometheus metrics and stops cleanly on
SIGTERM, and answers the `rlmesh.v1.Rollout` RPCs with UNIMPLEMENTED until issue 5 implements them.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from rlmesh.config import RLMeshConfig
from rlmesh.runtime.entry import service_main
from rlmesh.runtime.server import GrpcService
from rlmesh.v1 import rollout_pb2, rollout_pb2_grpc

SERVICE_NAME = rollout_pb2.DESCRIPTOR.services_by_name["Rollout"].full_name


async def build(service: GrpcService, cfg: RLMeshConfig) -> None:
    service.add_servicer(
        rollout_pb2_grpc.add_RolloutServicer_to_server, rollout_pb2_grpc.RolloutServicer(), SERVICE_NAME
    )


def main(argv: Sequence[str] | None = None) -> int:
    return service_main("rollout", build, argv, description=__doc__.splitlines()[0])


if __name__ == "__main__":
    sys.exit(main())
