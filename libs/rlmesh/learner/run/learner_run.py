"""Rank 0's run as a service: the training loop as a task that starts when the server serves,
and stops (finishing its step and final checkpoint) on SIGTERM."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from prometheus_client import CollectorRegistry

from rlmesh.config import RLMeshConfig
from rlmesh.learner.run.loop import TrainingLoop
from rlmesh.learner.run.ranks import learner_env_defaults, make_trainer, set_torch_threads
from rlmesh.learner.run.trainer_thread import TrainerThread

log = logging.getLogger("rlmesh.learner")


class LearnerRun:
    """``on_end(exit_code)`` is called once when the run ends, however it ends."""

    def __init__(self, loop: TrainingLoop, on_end: Callable[[int], None]) -> None:
        self.loop = loop
        self.on_end = on_end
        self._task: asyncio.Task[None] | None = None

    @classmethod
    async def create(
        cls, cfg: RLMeshConfig, *, metrics_registry: CollectorRegistry, on_end: Callable[[int], None]
    ) -> LearnerRun:
        if not cfg.rlmesh.run_id:
            raise ValueError("rlmesh.run_id is required: the learner and its replicas share the run's queues")
        learner_env_defaults()
        threads = set_torch_threads(cfg)
        log.info("learner rank 0 uses %d torch thread(s)", threads)
        # Built on the trainer thread, where every later trainer call runs too.
        thread = TrainerThread()
        loop = await thread.call(
            TrainingLoop, cfg, make_trainer, registry=metrics_registry, trainer_thread=thread
        )
        return cls(loop, on_end)

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        code = 0
        try:
            await self.loop.run()
            log.info("run finished at step %d", self.loop.state.step)
        except Exception as e:
            log.exception("training failed")
            self.loop.state.phase = "FAILED"
            self.loop.state.message = f"{type(e).__name__}: {e}"
            code = 1
        finally:
            self.on_end(code)  # the other ranks have been told: their exit is expected now

    async def stop(self, rank_lost: bool = False) -> None:
        """SIGTERM: finish the step, checkpoint, stop. With a rank lost no checkpoint could be
        whole, and the run is left to a successor (a standby, or a learner started again)."""
        st = self.loop.state
        st.stop_requested = True
        st.stop_checkpoint = st.stop_checkpoint and not rank_lost
        st.replaceable = rank_lost
        if self._task is not None and not self._task.done():
            await self._task
        # The run tells the other ranks to stop when it ends; one that never began (the server
        # failed to start) must still release them from their wait for its first command.
        await self.loop.rank_zero.finish(
            "" if self._task else "the learner service stopped before its run began"
        )
