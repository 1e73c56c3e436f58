"""What the run loop shows of itself (``LoopState``: step, phase, pause, pending requests), which
the ``Learner`` servicer reads and writes, and the two waits between steps that only it drives."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

PHASES = (
    "STARTING",
    "VALIDATING",
    "WAITING_FOR_ROLLOUTS",
    "TRAINING",
    "PUSHING_WEIGHTS",
    "CHECKPOINTING",
    "PAUSED",
    "STOPPING",
    "FINISHED",
    "FAILED",
)


# Who paused the run (``LoopState.paused_by``), as the learner's message names it.
START_PAUSED = "start_paused"
PAUSE_REQUEST = "pause_request"
PAUSED_MESSAGES = {
    START_PAUSED: "paused since start (rlmesh.learner.start_paused=true): `rlmesh ctl resume` starts training",
    PAUSE_REQUEST: "paused from the control plane (rlmesh ctl pause): `rlmesh ctl resume` goes on",
}


@dataclass
class LoopState:
    step: int = 0
    total_steps: int = 0
    version: int = 0
    phase: str = "STARTING"
    paused: bool = False
    paused_by: str = ""  # START_PAUSED or PAUSE_REQUEST while paused, else ""
    stop_requested: bool = False
    stop_checkpoint: bool = True
    # The run is left to a successor when this learner ends: a rank of it died. Otherwise its end
    # (finished, stopped, failed) is the run's, and a standby does not take over.
    replaceable: bool = False
    last_metrics: dict[str, float] = field(default_factory=dict)
    last_checkpoint: str = ""
    live_replicas: int = 0
    message: str = ""
    pending_hparams: dict[str, float] = field(default_factory=dict)
    # The last step whose hyper-parameters were taken (mid-step, before its training): a change
    # made after that applies from the step after it.
    hparams_step: int = 0
    checkpoint_requests: list[tuple[str, asyncio.Future[str]]] = field(default_factory=list)

    def pause(self, by: str = PAUSE_REQUEST) -> None:
        """Holds at the next step boundary; a pause already under way keeps who made it."""
        if not self.paused:
            self.paused, self.paused_by = True, by

    def resume(self) -> None:
        self.paused, self.paused_by = False, ""

    @property
    def paused_message(self) -> str:
        """What the learner says while it holds paused: who paused it and how it goes on."""
        return PAUSED_MESSAGES.get(self.paused_by, "paused")


async def wait_for_replicas(st: LoopState, live_engines: Callable[[], Awaitable[list]]) -> None:
    """Until a live replica is registered (or a stop is requested), saying what holds the run."""
    while not await live_engines():
        # Paused, it says so (and who paused it): the replicas are not what holds it then.
        st.phase = "PAUSED" if st.paused else "PUSHING_WEIGHTS"
        st.message = st.paused_message if st.paused else "no rollout replica registered yet"
        if st.stop_requested:
            return
        await asyncio.sleep(0.5)
    st.phase, st.message = "PUSHING_WEIGHTS", ""


async def hold_while_paused(st: LoopState, checkpoint: Callable[[int], Awaitable[str]]) -> None:
    """Until resumed (or stopped); a checkpoint requested meanwhile is written at once."""
    if not st.paused:
        return
    while st.paused and not st.stop_requested:
        st.phase, st.message = "PAUSED", st.paused_message
        if st.checkpoint_requests and st.step > 0:
            await checkpoint(st.step)
            st.phase = "PAUSED"
        await asyncio.sleep(0.2)
    st.message = ""
