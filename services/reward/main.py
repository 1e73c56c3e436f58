"""Reward service: scores responses (rule-based, reward model, or user code) over gRPC `Reward.Score`.
Settings are the ``rlmesh.reward.*`` config keys; a reward function that does not load exits 2."""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Sequence

from rlmesh.config import RLMeshConfig
from rlmesh.reward.function_loader import RewardFunctionLoadError
from rlmesh.reward.scorer import RewardScorer
from rlmesh.reward.servicer import SERVICE_NAME, RewardServicer
from rlmesh.runtime.entry import CannotStart, service_main
from rlmesh.runtime.server import GrpcService
from rlmesh.v1 import reward_pb2_grpc

DESCRIPTION = (
    f"{__doc__.splitlines()[0]} Settings: rlmesh.reward.* keys, e.g. rlmesh.reward.function=arithmetic "
    "rlmesh.reward.function_timeout_s=5 rlmesh.reward.max_batch_size=1024 rlmesh.reward.workers=32."
)

log = logging.getLogger("rlmesh.reward")


async def build(service: GrpcService, cfg: RLMeshConfig) -> None:
    try:
        scorer = await asyncio.to_thread(RewardScorer.from_config, cfg, registry=service.registry)
    except RewardFunctionLoadError as e:
        raise CannotStart(f"cannot load the reward function: {e}") from e
    log.info(
        "reward functions ready",
        extra={"functions": scorer.functions(), "max_batch_size": scorer.max_batch_size},
    )
    service.add_servicer(reward_pb2_grpc.add_RewardServicer_to_server, RewardServicer(scorer), SERVICE_NAME)
    service.on_shutdown(scorer.aclose)


def main(argv: Sequence[str] | None = None) -> int:
    return service_main("reward", build, argv, description=DESCRIPTION)


if __name__ == "__main__":
    sys.exit(main())
