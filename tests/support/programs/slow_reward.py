"""A real service process for the shutdown tests: `Reward.Score` blocks until the file named by
the first sample's uid exists, so a test controls exactly when the in-flight call may finish."""

import asyncio
import sys
from pathlib import Path

from rlmesh.runtime.logs import configure_logging
from rlmesh.runtime.server import GrpcService
from rlmesh.v1 import reward_pb2, reward_pb2_grpc


class BlockingReward(reward_pb2_grpc.RewardServicer):
    async def Score(self, request, context):
        release = Path(request.samples[0].uid)
        while not release.exists():
            await asyncio.sleep(0.01)
        return reward_pb2.ScoreResponse(
            results=[reward_pb2.RewardResult(uid=s.uid, score=1.0) for s in request.samples]
        )


async def main(ready_file: str, grace_s: float) -> None:
    service = GrpcService("reward", port=0, metrics_port=0, ready_file=ready_file, shutdown_grace_s=grace_s)
    service.add_servicer(reward_pb2_grpc.add_RewardServicer_to_server, BlockingReward(), "rlmesh.v1.Reward")
    await service.serve()


if __name__ == "__main__":
    configure_logging("reward", "test-run", fmt="json")
    asyncio.run(main(sys.argv[1], float(sys.argv[2])))
