"""Learner service: PPO under DeepSpeed (actor + critic), weight push, checkpoints.

Rank 0 serves ``rlmesh.v1.Learner`` and runs the training loop (``rlmesh.training.loop``): it
feeds prompt tasks, collects trajectory batches, trains, pushes weights to every live rollout
replica, checkpoints and validates. Other ranks (``deepspeed --num_gpus N`` or ``torchrun``)
run the same trainer collectives as rank 0 announces them. When the run is done the process
exits 0; a failed run exits 1 with the error logged.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

from rlmesh.config import ConfigError, RLMeshConfig, load_config
from rlmesh.runtime.entry import limit_torch_threads, service_arg_parser, service_main
from rlmesh.runtime.logs import configure_logging
from rlmesh.runtime.server import GrpcService
from rlmesh.v1 import learner_pb2, learner_pb2_grpc

SERVICE_NAME = learner_pb2.DESCRIPTOR.services_by_name["Learner"].full_name
log = logging.getLogger("rlmesh.learner")


def make_trainer(cfg: RLMeshConfig, total_steps: int) -> Any:
    from rlmesh.learner import PPOTrainer

    return PPOTrainer(cfg, total_training_steps=total_steps)


async def build(service: GrpcService, cfg: RLMeshConfig) -> None:
    from rlmesh.training.loop import TrainingLoop, learner_env_defaults
    from rlmesh_services.learner.servicer import LearnerServicer

    if not cfg.rlmesh.run_id:
        raise ValueError("rlmesh.run_id is required: the learner and its replicas share the run's queues")
    learner_env_defaults()
    loop = await asyncio.to_thread(TrainingLoop, cfg, make_trainer, registry=service.registry)
    service.add_servicer(learner_pb2_grpc.add_LearnerServicer_to_server, LearnerServicer(loop), SERVICE_NAME)

    async def run_loop() -> None:
        try:
            await loop.run()
            log.info("run finished at step %d", loop.state.step)
        except Exception as e:
            log.exception("training failed")
            loop.state.phase = "FAILED"
            loop.state.message = f"{type(e).__name__}: {e}"
            service.exit_code = 1
        finally:
            service.request_stop()

    task: list[asyncio.Task[None]] = []

    async def start() -> None:
        task.append(asyncio.create_task(run_loop()))

    async def stop() -> None:
        loop.state.stop_requested = True  # SIGTERM: finish the step, checkpoint, stop
        if task and not task[0].done():
            await task[0]

    service.on_start(start)
    service.on_shutdown(stop)


def follower_main(argv: Sequence[str] | None) -> int:
    """Ranks > 0: build the same trainer and run the collectives rank 0 announces."""
    from rlmesh.training.loop import TrainingLoop, follow

    limit_torch_threads()
    args = service_arg_parser("learner").parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"rlmesh learner: invalid configuration:\n{e}", file=sys.stderr)
        return 2
    configure_logging(
        f"learner-rank{os.environ.get('RANK')}",
        cfg.rlmesh.run_id,
        cfg.rlmesh.log_level,
        cfg.rlmesh.log_format,
    )
    loop = TrainingLoop(cfg, make_trainer, follower=True)
    follow(loop.trainer)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    # deepspeed's launcher passes --local_rank=N; the rank comes from the environment anyway.
    argv = [a for a in (sys.argv[1:] if argv is None else argv) if not a.startswith("--local_rank")]
    if int(os.environ.get("RANK", "0")) > 0:
        return follower_main(argv)
    return service_main("learner", build, argv, description=__doc__.splitlines()[0])


if __name__ == "__main__":
    sys.exit(main())
