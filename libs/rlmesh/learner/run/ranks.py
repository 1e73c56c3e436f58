"""The learner's processes: rank 0 (the service) and the followers, started by a launcher
(``torchrun``, ``deepspeed``) or by rank 0 itself from ``rlmesh.learner.ranks``.
docs/design.md#learner-ranks describes who stops whom, and when."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

import torch

from rlmesh.config import ConfigError, RLMeshConfig, load_config
from rlmesh.learner.dist import shutdown_distributed
from rlmesh.learner.run.commands import RankZeroLost, follow
from rlmesh.learner.run.loop import TrainingLoop
from rlmesh.learner.trainer import PPOTrainer
from rlmesh.runtime.affinity import apply_cpu_affinity
from rlmesh.runtime.entry import limit_torch_threads, service_arg_parser
from rlmesh.runtime.launcher import EXIT_RESTART, local_rendezvous, with_parent_death_signal
from rlmesh.runtime.logs import configure_logging
from rlmesh.runtime.net import free_port

log = logging.getLogger("rlmesh.learner")

# How long rank 0 may take to stop once a rank it started has failed, before it is ended hard: a
# collective with the dead rank may never complete (NCCL waits out its timeout), and a rank 0 that
# is PID 1 in a container ignores a SIGTERM it has no handler for yet (still starting up).
HARD_STOP_S = 120.0


def make_trainer(cfg: RLMeshConfig, total_steps: int) -> PPOTrainer:
    return PPOTrainer(cfg, total_training_steps=total_steps)


def set_torch_threads(cfg: RLMeshConfig) -> int:
    """Applies ``rlmesh.learner.torch_threads`` (0 keeps what ``OMP_NUM_THREADS`` set); returns
    the number of intra-op threads this rank now uses."""
    if cfg.rlmesh.learner.torch_threads:
        torch.set_num_threads(cfg.rlmesh.learner.torch_threads)
    return torch.get_num_threads()


def learner_env_defaults() -> None:
    """A single process is a group of one: DeepSpeed needs the env a launcher would have set."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(key, value)


def follower_main(argv: Sequence[str]) -> int:
    """Ranks > 0: build the same trainer and run the collectives rank 0 announces.

    Exits 0 when rank 0 ended its run normally, 1 when rank 0 failed or died, or a collective
    failed here (rank 0 then sees this process exit and fails too).
    """
    limit_torch_threads()
    args = service_arg_parser("learner").parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"rlmesh learner: invalid configuration:\n{e}", file=sys.stderr)
        return 2
    rank = os.environ.get("RANK")
    apply_cpu_affinity(cfg.rlmesh.learner.cpus, "rlmesh.learner.cpus")  # rank 0 checked it
    set_torch_threads(cfg)
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


class LocalRanks:
    """The ranks rank 0 started itself (none under a launcher, or with ``rlmesh.learner.ranks`` 1).

    A child that fails while the run is on stops rank 0: SIGTERM, then ``os._exit(EXIT_RESTART)``
    after ``HARD_STOP_S``; rank 0 then exits with ``EXIT_RESTART`` (`rlmesh train` starts the
    learner again, every rank). Once rank 0 calls :meth:`run_ended` (it told them to stop) an exit
    is no news.
    """

    def __init__(self, children: Sequence[subprocess.Popen[bytes]] = ()) -> None:
        self.children = list(children)
        self._run_ended = threading.Event()
        self.lost: int | None = None  # the first rank that died while the run was on
        for rank, child in enumerate(self.children, start=1):
            threading.Thread(
                target=self._watch, args=(rank, child), name=f"rank{rank}-watch", daemon=True
            ).start()

    @classmethod
    def start(cls, argv: Sequence[str]) -> LocalRanks:
        """Without a launcher's environment and with ``rlmesh.learner.ranks`` > 1: this process
        becomes rank 0 and starts ranks 1.. as children running the same command line."""
        args = service_arg_parser("learner").parse_args(argv)
        try:
            world = load_config(args.config, args.overrides).rlmesh.learner.ranks
        except ConfigError:
            return cls()  # service_main reports it
        if world == 1:
            return cls()
        os.environ.update({**local_rendezvous(world), "RANK": "0", "LOCAL_RANK": "0"})
        command = with_parent_death_signal([sys.executable, "-m", "rlmesh.cli", "serve", "learner", *argv])
        # They die with this process (PDEATHSIG), share its process group (a signal to the group
        # reaches them all) and write where it writes.
        return cls(
            [
                subprocess.Popen(
                    command,
                    env={**os.environ, "RANK": str(r), "LOCAL_RANK": str(r)},
                    stdin=subprocess.DEVNULL,
                )
                for r in range(1, world)
            ]
        )

    def run_ended(self) -> None:
        self._run_ended.set()

    def _watch(self, rank: int, child: subprocess.Popen[bytes]) -> None:
        code = child.wait()
        if code == 0 or self._run_ended.is_set():
            return
        log.error("learner rank %d exited with code %d: stopping rank 0", rank, code)
        self.lost = rank if self.lost is None else self.lost
        os.kill(os.getpid(), signal.SIGTERM)
        if not self._run_ended.wait(HARD_STOP_S):
            log.error("rank 0 did not stop within %.0f s of losing rank %d: exiting", HARD_STOP_S, rank)
            os._exit(EXIT_RESTART)

    def join(self, code: int, grace_s: float = 60.0) -> int:
        """Rank 0 is done: its run told the others to stop; wait for them (kill what outlives
        ``grace_s``). Exit code: ``EXIT_RESTART`` when a rank died while the run was on (whatever
        rank 0's run made of it), else rank 0's, or 1 when a rank failed."""
        deadline = time.monotonic() + grace_s
        for rank, child in enumerate(self.children, start=1):
            try:
                child_code = child.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.error("learner rank %d did not stop within %.0f s: killing it", rank, grace_s)
                child.kill()
                child_code = child.wait()
            if child_code != 0:
                code = code or 1
        return EXIT_RESTART if self.lost is not None else code
