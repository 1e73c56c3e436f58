"""Learner service: PPO under DeepSpeed (actor + critic), weight push, checkpoints.

Rank 0 serves ``rlmesh.v1.Learner`` and runs the training loop (``rlmesh.learner.loop``): it
feeds prompt tasks, collects trajectory batches, trains, pushes weights to every live rollout
replica, checkpoints and validates. Other ranks run the same trainer collectives as rank 0
announces them. The ranks come from a launcher (``torchrun``, ``deepspeed``: its environment
names them), or else from ``rlmesh.learner.ranks``: the process started becomes rank 0 and
starts the others as its children. Followers outlive a SIGTERM until rank 0, which finishes its
step and final checkpoint with them, says stop; they exit 1 if rank 0 dies.
When the run is done the process exits 0; a failed run exits 1 with the error logged.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import threading
import time
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
    from rlmesh.learner.loop import TrainingLoop, learner_env_defaults
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
            _RUN_ENDED.set()  # the other ranks have been told: their exit is expected now
            service.request_stop()

    task: list[asyncio.Task[None]] = []

    async def start() -> None:
        task.append(asyncio.create_task(run_loop()))

    async def stop() -> None:
        loop.state.stop_requested = True  # SIGTERM: finish the step, checkpoint, stop
        if task and not task[0].done():
            await task[0]
        # The run tells the other ranks to stop when it ends; one that never began (the server
        # failed to start) must still release them from their wait for its first command.
        loop.followers.finish("" if task else "the learner service stopped before its run began")

    service.on_start(start)
    service.on_shutdown(stop)


def follower_main(argv: Sequence[str] | None) -> int:
    """Ranks > 0: build the same trainer and run the collectives rank 0 announces.

    Exits 0 when rank 0 ended its run normally, 1 when rank 0 failed or died, or a collective
    failed here (rank 0 then sees this process exit and fails too).
    """
    from rlmesh.learner.dist import shutdown_distributed
    from rlmesh.learner.loop import RankZeroLost, TrainingLoop, follow

    limit_torch_threads()
    args = service_arg_parser("learner").parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"rlmesh learner: invalid configuration:\n{e}", file=sys.stderr)
        return 2
    rank = os.environ.get("RANK")
    configure_logging(f"learner-rank{rank}", cfg.rlmesh.run_id, cfg.rlmesh.log_level, cfg.rlmesh.log_format)
    parent = os.getppid()

    def on_signal(signum: int, frame: object) -> None:
        if os.getppid() != parent:
            # Our parent died: rank 0 itself for ranks it started (its PDEATHSIG), or the launcher.
            # Rank 0 can no longer say stop, and this rank may be inside a collective that never
            # completes (on NCCL, for its whole timeout): leave now.
            log.error("%s: rank %s's parent is gone, stopping", signal.Signals(signum).name, rank)
            os._exit(1)
        # Launchers (torchrun, compose) signal every rank at once. Rank 0 then finishes its step
        # and writes the final checkpoint, collectives this rank must take part in: dying now would
        # break them. It stops when rank 0 says so, or when rank 0 is gone.
        log.info("%s: rank %s stops when rank 0 ends the run", signal.Signals(signum).name, rank)

    try:
        loop = TrainingLoop(cfg, make_trainer, follower=True)
        # Only now: during start-up a signal must still stop this rank (rank 0 may never come up).
        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        failure = follow(loop.trainer, loop.followers)
    except RankZeroLost as e:
        log.error("rank %s: rank 0 is gone, stopping: %s", rank, e)
        # Not a normal exit: tearing down groups whose peer is gone can hang or abort.
        logging.shutdown()
        os._exit(1)
    except Exception:
        log.exception("rank %s failed", rank)
        return 1
    shutdown_distributed()
    if failure:
        log.error("rank %s: rank 0's run failed (%s), stopping", rank, failure)
        return 1
    log.info("rank %s: rank 0 ended the run", rank)
    return 0


# Set once rank 0's run has ended (it told the other ranks so): a rank exiting after that is no news.
_RUN_ENDED = threading.Event()
# How long rank 0 may take to stop once a rank it started has failed, before it is ended hard: a
# collective with the dead rank may never complete (NCCL waits out its timeout), and a rank 0 that
# is PID 1 in a container ignores a SIGTERM it has no handler for yet (still starting up).
HARD_STOP_S = 120.0


def start_local_ranks(argv: Sequence[str]) -> list[subprocess.Popen[bytes]]:
    """Without a launcher's environment and with ``rlmesh.learner.ranks`` > 1: this process becomes
    rank 0 and starts the other ranks as its children. A child that fails while the run is on stops
    this process: SIGTERM, then ``os._exit(1)`` after ``HARD_STOP_S``."""
    from rlmesh.runtime.launcher import spawn_local_ranks

    args = service_arg_parser("learner").parse_args(argv)
    try:
        ranks = load_config(args.config, args.overrides).rlmesh.learner.ranks
    except ConfigError:
        return []  # service_main reports it
    if ranks == 1:
        return []
    children = spawn_local_ranks([sys.executable, "-m", "rlmesh.cli", "serve", "learner", *argv], ranks)

    def watch(rank: int, child: subprocess.Popen[bytes]) -> None:
        code = child.wait()
        if code == 0 or _RUN_ENDED.is_set():
            return
        log.error("learner rank %d exited with code %d: stopping rank 0", rank, code)
        os.kill(os.getpid(), signal.SIGTERM)
        if not _RUN_ENDED.wait(HARD_STOP_S):
            log.error("rank 0 did not stop within %.0f s of losing rank %d: exiting", HARD_STOP_S, rank)
            os._exit(1)

    for rank, child in enumerate(children, start=1):
        threading.Thread(target=watch, args=(rank, child), name=f"rank{rank}-watch", daemon=True).start()
    return children


def join_local_ranks(children: Sequence[subprocess.Popen[bytes]], code: int, grace_s: float = 60.0) -> int:
    """Rank 0 is done: its run told the others to stop; wait for them (kill what outlives
    ``grace_s``). Exit code: rank 0's, or 1 when a rank failed."""
    deadline = time.monotonic() + grace_s
    for rank, child in enumerate(children, start=1):
        try:
            child_code = child.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.error("learner rank %d did not stop within %.0f s: killing it", rank, grace_s)
            child.kill()
            child_code = child.wait()
        if child_code != 0:
            code = code or 1
    return code


def main(argv: Sequence[str] | None = None) -> int:
    # deepspeed's launcher passes --local_rank=N; the rank comes from the environment anyway.
    argv = [a for a in (sys.argv[1:] if argv is None else argv) if not a.startswith("--local_rank")]
    if int(os.environ.get("RANK", "0")) > 0:
        return follower_main(argv)
    children = start_local_ranks(argv) if "RANK" not in os.environ else []
    code = service_main("learner", build, argv, description=__doc__.splitlines()[0])
    _RUN_ENDED.set()  # also when the run never began
    from rlmesh.learner.dist import shutdown_distributed

    shutdown_distributed()
    return join_local_ranks(children, code)


if __name__ == "__main__":
    sys.exit(main())
