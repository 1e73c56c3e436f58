"""gRPC ``rlmesh.v1.Learner``: status, pause/resume, checkpoints, hyper-parameters, stop."""

from __future__ import annotations

import asyncio
import logging

import grpc

from rlmesh.config.hparams import HPARAMS, in_range, range_text
from rlmesh.learner.run.loop import TrainingLoop
from rlmesh.v1 import common_pb2, learner_pb2, learner_pb2_grpc

log = logging.getLogger("rlmesh.learner")


class LearnerServicer(learner_pb2_grpc.LearnerServicer):
    def __init__(self, loop: TrainingLoop) -> None:
        self.loop = loop

    def status(self) -> learner_pb2.LearnerStatus:
        st = self.loop.state
        return learner_pb2.LearnerStatus(
            run_id=self.loop.keys.run_id,
            step=st.step,
            total_steps=st.total_steps,
            policy_version=st.version,
            phase=learner_pb2.LearnerPhase.Value(f"LEARNER_PHASE_{st.phase}"),
            paused=st.paused,
            metrics=st.last_metrics,
            live_replicas=st.live_replicas,
            last_checkpoint=st.last_checkpoint,
            message=st.message,
            hyperparams=self.loop.current_hparams(),
        )

    async def GetStatus(
        self, request: common_pb2.Empty, context: grpc.aio.ServicerContext
    ) -> learner_pb2.LearnerStatus:
        return self.status()

    async def Pause(
        self, request: common_pb2.Empty, context: grpc.aio.ServicerContext
    ) -> learner_pb2.LearnerStatus:
        self.loop.state.pause()
        log.info("pause requested: holding after the current step")
        return self.status()

    async def Resume(
        self, request: common_pb2.Empty, context: grpc.aio.ServicerContext
    ) -> learner_pb2.LearnerStatus:
        self.loop.state.resume()
        log.info("resumed")
        return self.status()

    async def SaveCheckpoint(
        self, request: learner_pb2.SaveCheckpointRequest, context: grpc.aio.ServicerContext
    ) -> learner_pb2.SaveCheckpointResponse:
        if request.path:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                "SaveCheckpointRequest.path is not supported; checkpoints go under trainer.default_local_dir",
            )
        if self.loop.state.step == 0:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, "no step trained yet: nothing to checkpoint"
            )
        # Taken at the next step boundary (or at once while paused), never in the middle of a step.
        fut: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self.loop.state.checkpoint_requests.append(("", fut))
        path = await fut
        return learner_pb2.SaveCheckpointResponse(path=path, step=self.loop.state.step)

    async def UpdateHyperparams(
        self, request: learner_pb2.UpdateHyperparamsRequest, context: grpc.aio.ServicerContext
    ) -> learner_pb2.UpdateHyperparamsResponse:
        # UpdateHyperparamsRequest's fields are the table's names; their ranges are the control
        # plane's (a value the REST API refuses is refused here too, whoever sends it).
        given = {k: getattr(request, k) for k in HPARAMS if request.HasField(k)}
        for key, value in given.items():
            h = HPARAMS[key]
            if not in_range(h, value):
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"{key}={value}: must be a finite number in {range_text(h)} ({h.key})",
                )
            if key == "critic_lr" and self.loop.trainer.critic is None:
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "critic_lr: this run has no critic (algorithm.adv_estimator is not gae)",
                )
        self.loop.state.pending_hparams.update(given)
        st = self.loop.state
        applies = max(st.step, st.hparams_step) + 1  # the step under way took its values already
        log.info("hyper-parameters updated from step %d: %s", applies, given)
        return learner_pb2.UpdateHyperparamsResponse(
            applies_from_step=applies,
            values={HPARAMS[k].key: v for k, v in self.loop.current_hparams().items()},
        )

    async def Stop(
        self, request: learner_pb2.StopRequest, context: grpc.aio.ServicerContext
    ) -> learner_pb2.LearnerStatus:
        self.loop.state.stop_requested = True
        self.loop.state.stop_checkpoint = request.checkpoint
        log.info("stop requested (checkpoint=%s)", request.checkpoint)
        return self.status()
