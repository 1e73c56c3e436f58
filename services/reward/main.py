"""Reward service: scores responses (rule-based, reward model, or user code) over gRPC `Reward.Score`.

A thin shell over ``rlmesh.reward.RewardScorer``. What scores: ``reward_model.enable`` → the reward
model at ``reward_model.model.path``; else ``custom_reward_function.path`` (+ ``.name``); else the
built-in verl picks by ``data_source``. A function that does not load stops the service at start
(exit 2) with a message saying why.

Service settings: config keys under ``rlmesh.reward``, each overridden by a flag (before or after
the overrides) or, failing that, its environment variable:
  --reward-function NAME        force a built-in (gsm8k, math, math_dapo, arithmetic) for every sample
                                [rlmesh.reward.function, RLMESH_REWARD_FUNCTION]
  --function-timeout-s S        per-sample deadline of a reward function; default rlmesh.reward.timeout_s
                                [rlmesh.reward.function_timeout_s, RLMESH_REWARD_FUNCTION_TIMEOUT_S]
  --max-batch-size N            larger batches get INVALID_ARGUMENT (default 1024)
                                [rlmesh.reward.max_batch_size, RLMESH_REWARD_MAX_BATCH_SIZE]
  --workers N                   threads running sync reward functions (default 32)
                                [rlmesh.reward.workers, RLMESH_REWARD_WORKERS]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Sequence

import grpc

from rlmesh.config import RLMeshConfig
from rlmesh.reward import InvalidRequestError, RewardFunctionLoadError, RewardScorer
from rlmesh.runtime.entry import service_main
from rlmesh.runtime.server import GrpcService
from rlmesh.v1 import common_pb2, reward_pb2, reward_pb2_grpc

DESCRIPTION = (
    f"{__doc__.splitlines()[0]} Settings: rlmesh.reward.* keys, overridden by flags (or env RLMESH_REWARD_*): --reward-function NAME, "
    "--function-timeout-s S, --max-batch-size N, --workers N."
)
SERVICE_NAME = reward_pb2.DESCRIPTOR.services_by_name["Reward"].full_name
# Answer this much before the caller's deadline, so late samples come back as TIMEOUT errors.
DEADLINE_MARGIN_S = 0.05

log = logging.getLogger("rlmesh.reward")


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


def option_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    env = os.environ.get
    parser.add_argument("--reward-function", default=env("RLMESH_REWARD_FUNCTION") or None)
    parser.add_argument(
        "--function-timeout-s", type=float, default=_float(env("RLMESH_REWARD_FUNCTION_TIMEOUT_S"))
    )
    parser.add_argument("--max-batch-size", type=int, default=_int(env("RLMESH_REWARD_MAX_BATCH_SIZE")))
    parser.add_argument("--workers", type=int, default=_int(env("RLMESH_REWARD_WORKERS")))
    return parser


def _int(value: str | None) -> int | None:
    return int(value) if value else None


def _float(value: str | None) -> float | None:
    return float(value) if value else None


def make_build(options: argparse.Namespace):  # type: ignore[no-untyped-def]
    async def build(service: GrpcService, cfg: RLMeshConfig) -> None:
        section = cfg.rlmesh.reward  # a flag (or its env var) wins over the config key
        try:
            scorer = await asyncio.to_thread(
                RewardScorer.from_config,
                cfg,
                registry=service.registry,
                forced=options.reward_function or section.function,
                timeout_s=options.function_timeout_s or section.function_timeout_s,
                max_batch_size=options.max_batch_size or section.max_batch_size,
                max_workers=options.workers or section.workers,
            )
        except RewardFunctionLoadError as e:
            log.error("cannot start: %s", e)
            print(f"rlmesh reward: cannot load the reward function: {e}", file=sys.stderr, flush=True)
            raise SystemExit(2) from None
        log.info(
            "reward functions ready",
            extra={"functions": scorer.functions(), "max_batch_size": scorer.max_batch_size},
        )
        service.add_servicer(
            reward_pb2_grpc.add_RewardServicer_to_server, RewardServicer(scorer), SERVICE_NAME
        )
        service.on_shutdown(scorer.aclose)

    return build


def main(argv: Sequence[str] | None = None) -> int:
    options, rest = option_parser().parse_known_args(list(sys.argv[1:] if argv is None else argv))
    return service_main("reward", make_build(options), rest, description=DESCRIPTION)


if __name__ == "__main__":
    sys.exit(main())
