"""The gRPC face of ``RewardScorer``: ``Reward.Score`` and ``Reward.GetInfo``."""

from __future__ import annotations

import grpc

from rlmesh.reward.scorer import RewardScorer
from rlmesh.runtime.invalid_request import InvalidRequestError
from rlmesh.v1 import common_pb2, reward_pb2, reward_pb2_grpc

SERVICE_NAME = reward_pb2.DESCRIPTOR.services_by_name["Reward"].full_name
# Answer this much before the caller's deadline, so late samples come back as TIMEOUT errors.
DEADLINE_MARGIN_S = 0.05


class RewardServicer(reward_pb2_grpc.RewardServicer):
    def __init__(self, scorer: RewardScorer) -> None:
        self.scorer = scorer

    async def Score(
        self, request: reward_pb2.ScoreRequest, context: grpc.aio.ServicerContext
    ) -> reward_pb2.ScoreResponse:
        remaining = context.time_remaining()
        budget = None if remaining is None else max(remaining * 0.95 - DEADLINE_MARGIN_S, 0.0)
        try:
            results = await self.scorer.score(request.samples, timeout_s=budget)
        except InvalidRequestError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return reward_pb2.ScoreResponse(results=results)

    async def GetInfo(
        self, request: common_pb2.Empty, context: grpc.aio.ServicerContext
    ) -> reward_pb2.RewardInfo:
        return self.scorer.info()
