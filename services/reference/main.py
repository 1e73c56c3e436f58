"""Reference service: per-token log-probs of responses under the frozen reference policy.

Shell for now: it serves gRPC health, reflection and Prometheus metrics and stops cleanly on
SIGTERM, and answers the `rlmesh.v1.Reference` RPCs with UNIMPLEMENTED until issue 6 implements them.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from rlmesh.config import RLMeshConfig
from rlmesh.runtime.entry import service_main
from rlmesh.runtime.server import GrpcService
from rlmesh.v1 import reference_pb2, reference_pb2_grpc

SERVICE_NAME = reference_pb2.DESCRIPTOR.services_by_name["Reference"].full_name


async def build(service: GrpcService, cfg: RLMeshConfig) -> None:
    service.add_servicer(
        reference_pb2_grpc.add_ReferenceServicer_to_server,
        reference_pb2_grpc.ReferenceServicer(),
        SERVICE_NAME,
    )


def main(argv: Sequence[str] | None = None) -> int:
    return service_main("reference", build, argv, description=__doc__.splitlines()[0])


if __name__ == "__main__":
    sys.exit(main())
