"""Rollout service: one replica turning prompt tasks into scored trajectories, serving
``rlmesh.v1.Rollout``. A shell over ``rlmesh.rollout.RolloutReplica``; exits 3 when its engine is
lost or its loop fails, for its supervisor to start a new one."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from rlmesh.config import RLMeshConfig
from rlmesh.rollout.replica import RolloutReplica
from rlmesh.runtime.entry import service_main
from rlmesh.runtime.server import GrpcService
from rlmesh.v1 import rollout_pb2, rollout_pb2_grpc

SERVICE_NAME = rollout_pb2.DESCRIPTOR.services_by_name["Rollout"].full_name
LEFT_THE_RUN_EXIT = 3


async def build(service: GrpcService, cfg: RLMeshConfig) -> None:
    async def on_lost(why: str) -> None:
        await service.end_with(LEFT_THE_RUN_EXIT)

    replica = await RolloutReplica.create(cfg, metrics_registry=service.registry, on_lost=on_lost)
    service.add_servicer(rollout_pb2_grpc.add_RolloutServicer_to_server, replica.servicer, SERVICE_NAME)
    service.on_start(lambda: replica.start(service.advertised_address))
    service.on_shutdown(replica.stop)


def main(argv: Sequence[str] | None = None) -> int:
    return service_main("rollout", build, argv, description=__doc__.splitlines()[0])


if __name__ == "__main__":
    sys.exit(main())
