"""Reference service: per-token log-probs of responses under the frozen reference policy.
Settings are the ``rlmesh.reference.*`` config keys; a model that does not load exits 2."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence

from rlmesh.config import RLMeshConfig
from rlmesh.reference.loading import ReferenceLoadError, load_reference_model
from rlmesh.reference.servicer import SERVICE_NAME, ReferenceServicer
from rlmesh.runtime.entry import CannotStart, service_main
from rlmesh.runtime.server import GrpcService
from rlmesh.v1 import reference_pb2_grpc

DESCRIPTION = (
    f"{__doc__.splitlines()[0]} Settings: rlmesh.reference.* keys, e.g. rlmesh.reference.model_path=DIR "
    "rlmesh.reference.max_tokens=8192 rlmesh.reference.device=cuda rlmesh.reference.dtype=bfloat16."
)


async def build(service: GrpcService, cfg: RLMeshConfig) -> None:
    try:
        model = await asyncio.to_thread(load_reference_model, cfg)
    except ReferenceLoadError as e:
        raise CannotStart(str(e)) from e
    servicer = ReferenceServicer.from_config(cfg, model, service.registry)
    service.add_servicer(reference_pb2_grpc.add_ReferenceServicer_to_server, servicer, SERVICE_NAME)


def main(argv: Sequence[str] | None = None) -> int:
    return service_main("reference", build, argv, description=DESCRIPTION)


if __name__ == "__main__":
    sys.exit(main())
