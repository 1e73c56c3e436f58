"""Learner service: PPO under DeepSpeed (actor + critic), weight push, checkpoints. Rank 0 serves
``rlmesh.v1.Learner`` over ``rlmesh.learner.run.learner_run.LearnerRun``; other ranks follow its collectives.
Exits 0 when the run is done, 1 when it failed."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from rlmesh.config import RLMeshConfig
from rlmesh.learner.dist import shutdown_distributed
from rlmesh.learner.run.learner_run import LearnerRun
from rlmesh.learner.run.ranks import LocalRanks, follower_main
from rlmesh.learner.run.servicer import LearnerServicer
from rlmesh.runtime.entry import service_main
from rlmesh.runtime.server import GrpcService
from rlmesh.v1 import learner_pb2, learner_pb2_grpc

SERVICE_NAME = learner_pb2.DESCRIPTOR.services_by_name["Learner"].full_name


def make_build(ranks: LocalRanks):  # type: ignore[no-untyped-def]
    async def build(service: GrpcService, cfg: RLMeshConfig) -> None:
        def on_end(code: int) -> None:
            ranks.run_ended()
            service.exit_code = service.exit_code or code
            service.request_stop()

        run = await LearnerRun.create(cfg, metrics_registry=service.registry, on_end=on_end)
        service.add_servicer(
            learner_pb2_grpc.add_LearnerServicer_to_server, LearnerServicer(run.loop), SERVICE_NAME
        )
        service.on_start(run.start)
        service.on_shutdown(lambda: run.stop(rank_lost=ranks.lost is not None))

    return build


def main(argv: Sequence[str] | None = None) -> int:
    # deepspeed's launcher passes --local_rank=N; the rank comes from the environment anyway.
    argv = [a for a in (sys.argv[1:] if argv is None else argv) if not a.startswith("--local_rank")]
    if int(os.environ.get("RANK", "0")) > 0:
        return follower_main(argv)
    ranks = LocalRanks.start(argv) if "RANK" not in os.environ else LocalRanks()
    code = service_main("learner", make_build(ranks), argv, description=__doc__.splitlines()[0])
    ranks.run_ended()  # also when the run never began
    shutdown_distributed()
    return ranks.join(code)


if __name__ == "__main__":
    sys.exit(main())
