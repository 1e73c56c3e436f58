"""Rank 0's push of the policy to the live replicas' engines: over weight groups bucket by bucket,
or a snapshot on disk they load; then the policy record in Redis."""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path

import redis.asyncio as aioredis
import torch

from rlmesh.config import RLMeshConfig
from rlmesh.engine.client import EngineClient, engine_device_of
from rlmesh.learner.run.commands import RankCommand
from rlmesh.learner.run.loop_state import LoopState
from rlmesh.learner.run.trainer_thread import RankZero
from rlmesh.learner.weight_sync.links import weight_sync_backend
from rlmesh.learner.weight_sync.push import WeightPusher, WeightPushError
from rlmesh.queue import ReplicaRegistry, RunKeys, retry_redis_with_deadline
from rlmesh.queue.policy import publish_policy
from rlmesh.v1 import trajectory_pb2

log = logging.getLogger("rlmesh.learner")


class PolicyPush:
    """Pushes the trainer's weights as ``state.version`` to exactly the live replicas' engines."""

    def __init__(
        self,
        cfg: RLMeshConfig,
        keys: RunKeys,
        redis: aioredis.Redis,
        replicas: ReplicaRegistry,
        pusher: WeightPusher,
        rank_zero: RankZero,
        state: LoopState,
        checkpoint_root: Path,
    ) -> None:
        self.cfg = cfg
        self.keys = keys
        self.redis = redis
        self.replicas = replicas
        self.pusher = pusher
        self.rank_zero = rank_zero
        self.state = state
        self.checkpoint_root = checkpoint_root
        # Where the trainer's weights are, as dist.learner_device settles trainer.device.
        self.trainer_device = "cuda" if cfg.trainer.device == "cuda" and torch.cuda.is_available() else "cpu"
        self.counts: dict[str, float] = {}  # the last push's engines: a step's weight_sync/*

    async def live_engines(self) -> list[trajectory_pb2.ReplicaRegistration]:
        """Live replicas from the registry; the pusher targets exactly their engines."""
        live = [
            r
            for r in await retry_redis_with_deadline(self.replicas.live, "read the replicas")
            if r.state != "draining"
        ]
        self.state.live_replicas = len(live)
        ws = self.cfg.rlmesh.weight_sync
        token = self.cfg.rlmesh.token()
        known = {link.client.url: link.client for link in self.pusher.links}
        clients = [
            known.get(r.engine_url.rstrip("/"))
            # The config's token, not only the one the service exported: a loop built as a library.
            or EngineClient(r.engine_url, name=r.replica_id, timeout_s=ws.timeout_s, token=token)
            for r in live
        ]
        # An SGLang engine's TP workers each join its weight group (an older registry entry: 0).
        ranks = [max(1, r.weight_sync_ranks) for r in live]
        backends = [
            weight_sync_backend(
                ws.backend,
                self.trainer_device,
                r.engine_device or engine_device_of(r.engine, {}),  # an older replica names none
            )
            for r in live
        ]
        for unused in self.pusher.set_engines(clients, ranks, backends):
            await unused.aclose()
        return live

    async def push(self, only_behind: bool = False) -> float:
        """Pushes the current weights as ``state.version``; returns seconds. ``only_behind`` pushes
        only to replicas reporting an older version (one that joined while we wait for a batch)."""
        live = await self.live_engines()
        only = None
        if only_behind:
            only = {r.engine_url.rstrip("/") for r in live if r.policy_version < self.state.version}
            if not only:
                return 0.0
        t0 = time.monotonic()
        version = self.state.version
        ws = self.cfg.rlmesh.weight_sync
        path = None
        try:
            if ws.transport == "disk":
                path = await self._export_snapshot(version)
                report = await self.pusher.load_from_disk(path, version, only=only)
            else:
                buckets = self.rank_zero.weight_buckets(ws.bucket_size_mb << 20)
                report = await self.pusher.push_buckets(buckets, version, only=only)
            failed = report.failed
            self.counts = {
                "weight_sync/engines": len(report.engines),
                "weight_sync/failed_engines": len(failed),
                "weight_sync/unchecked_engines": len(report.unchecked),
                "weight_sync/groups": report.groups,
            }
        except WeightPushError as e:
            # No replica took them: each is dead, restarting or cut off. Not the run's end: the
            # live ones get them while the next batch is awaited (only_behind), a dead one leaves
            # the registry, and a restarted one joins behind and is brought up the same way.
            failed = e.failed
            self.counts = {
                "weight_sync/engines": 0,
                "weight_sync/failed_engines": len(failed),
                "weight_sync/unchecked_engines": 0,
                "weight_sync/groups": 0,
            }
        for name, why in failed.items():
            log.error("replica %s dropped from the push of v%d: %s", name, version, why)
        await retry_redis_with_deadline(
            lambda: publish_policy(self.redis, self.keys, version, path), "publish the policy"
        )
        return time.monotonic() - t0

    async def _export_snapshot(self, version: int) -> str:
        root = Path(self.cfg.rlmesh.weight_sync.disk_dir or self.checkpoint_root / "weights")
        path = root / f"v{version}"
        # Collective under ZeRO-3: every rank takes part.
        await self.rank_zero.run(RankCommand("export", path=str(path)))
        # The previous snapshot stays (a replica may be loading it); older ones go.
        await self.rank_zero.thread.call(_remove_older, root, version - 1)
        return str(path)


def _remove_older(root: Path, keep_from: int) -> None:
    for old in root.glob("v*"):
        if old.name[1:].isdigit() and int(old.name[1:]) < keep_from:
            shutil.rmtree(old, ignore_errors=True)
