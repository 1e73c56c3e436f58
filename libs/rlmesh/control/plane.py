"""``ControlPlane``: what the REST routes do, on the run's Redis and the learner's gRPC service;
every change goes through it and into the audit log. docs/control.md"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import yaml

from rlmesh.config import RLMeshConfig
from rlmesh.config.hparams import BY_KEY, HPARAMS, known_values, problems
from rlmesh.config.loader import dump_public_yaml
from rlmesh.config.secrets import public_config
from rlmesh.control.audit import AuditLog
from rlmesh.control.auto_response import AutoResponder, Remedy
from rlmesh.control.autoscale import Autoscaler, FleetReading, ScaleDecision, read_fleet
from rlmesh.control.errors import ControlError
from rlmesh.control.learner_link import LearnerLink
from rlmesh.queue import ReplicaRegistry, RunKeys, connect
from rlmesh.queue.connection import TRANSIENT_ERRORS
from rlmesh.queue.fleet_target import FleetTarget, publish_fleet_target
from rlmesh.queue.run_info import (
    latest_per_step,
    metrics_key,
    read_config,
    read_recent_metrics,
    read_step_metrics,
)
from rlmesh.v1 import learner_pb2

log = logging.getLogger("rlmesh.control")

ETA_WINDOW = 10  # the last this many steps' times give the ETA


def phase_name(status: learner_pb2.LearnerStatus) -> str:
    return learner_pb2.LearnerPhase.Name(status.phase).removeprefix("LEARNER_PHASE_").lower()


class ControlPlane:
    def __init__(self, cfg: RLMeshConfig, *, learner_address: str | None = None) -> None:
        self.cfg = cfg
        self.keys = RunKeys.signed(cfg.rlmesh.run_id or "default", cfg.rlmesh.token())
        self.token = cfg.rlmesh.token()
        self.redis = connect(cfg.rlmesh.redis_url)
        control = cfg.rlmesh.control
        self.audit = AuditLog(self.redis, self.keys, control.audit_max_entries)
        self.registry = ReplicaRegistry(self.redis, self.keys, ttl_s=cfg.rlmesh.queue.heartbeat_ttl_s)
        address = learner_address or cfg.rlmesh.learner.client_addresses()[0]
        self.learner = LearnerLink(address, self.token, timeout_s=cfg.rlmesh.learner.timeout_s)
        self.responder = AutoResponder(control.auto)
        self._auto_task: asyncio.Task[None] | None = None
        scale = control.autoscale
        backlog_limit = scale.learner_backlog_samples or (
            2 * cfg.data.train_batch_size * cfg.actor_rollout_ref.rollout.n
        )
        self.autoscaler = Autoscaler(scale, backlog_limit)
        self.last_scale: tuple[FleetReading, ScaleDecision, float] | None = (
            None  # reading, decision, unix time
        )
        self._scale_task: asyncio.Task[None] | None = None
        self._on_action: Callable[[Remedy], None] | None = None
        self._seen_id = "-"
        self.auto_actions = 0  # counted by the metrics too; here for the API

    async def close(self) -> None:
        for task in (self._auto_task, self._scale_task):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        await self.learner.close()
        await self.redis.aclose()

    # ----- the run -----
    async def history(
        self, keys: list[str] | None = None, start: int = 0, end: int | None = None, prefix: str | None = None
    ) -> list[dict[str, Any]]:
        """One row per step in ``[start, end]`` (the last written when a resumed run redid it),
        with the metrics named in ``keys`` (all when None) or starting with ``prefix``."""
        rows = latest_per_step(await read_step_metrics(self.redis, self.keys))
        out = []
        for row in rows:
            if row["step"] < start or (end is not None and row["step"] > end):
                continue
            metrics = row["metrics"]
            if keys is not None:
                metrics = {k: metrics[k] for k in keys if k in metrics}
            if prefix is not None:
                metrics = {k: v for k, v in metrics.items() if k.startswith(prefix)}
                if not metrics:
                    continue
            out.append({"step": row["step"], "time": row["time"], "metrics": metrics})
        return out

    async def status(self) -> dict[str, Any]:
        st = await self.learner.status()
        recent = latest_per_step(await read_recent_metrics(self.redis, self.keys, 2 * ETA_WINDOW))
        times = [r["metrics"]["timing_s/step"] for r in recent if "timing_s/step" in r["metrics"]][
            -ETA_WINDOW:
        ]
        remaining = max(0, st.total_steps - st.step)
        eta = sum(times) / len(times) * remaining if times else None
        return {
            "run_id": st.run_id,
            "step": st.step,
            "total_steps": st.total_steps,
            "policy_version": st.policy_version,
            "phase": phase_name(st),
            "paused": st.paused,
            "live_replicas": st.live_replicas,
            "last_checkpoint": st.last_checkpoint,
            "message": st.message,
            "eta_s": None if eta is None else round(eta, 1),
            "mean_step_s": round(sum(times) / len(times), 3) if times else None,
            "hyperparams": known_values(dict(st.hyperparams)),
            "metrics": dict(st.metrics),
        }

    async def resolved_config(self) -> dict[str, Any]:
        """The config the learner published (what it runs with), else this service's own."""
        text = await read_config(self.redis, self.keys)
        source = "learner"
        if text is None:
            text, source = dump_public_yaml(self.cfg), "control"
        # Masked again: the copy in Redis may come from a learner that published more.
        config = yaml.safe_load(text)
        return {"source": source, "config": public_config(config) if isinstance(config, dict) else None}

    # ----- actions -----
    async def action(self, who: str, action: str, **kw: Any) -> dict[str, Any]:
        """pause, resume, checkpoint or stop; recorded in the audit log once the learner took it."""
        before = await self.learner.status()
        if action == "pause":
            st = await self.learner.pause()
        elif action == "resume":
            st = await self.learner.resume()
        elif action == "stop":
            st = await self.learner.stop(checkpoint=bool(kw.get("checkpoint", True)))
        elif action == "checkpoint":
            saved = await self.learner.checkpoint()
            await self.audit.record(
                who, "checkpoint", target="learner", new=saved.path, detail=f"step {saved.step}"
            )
            return {"path": saved.path, "step": saved.step}
        else:  # the routes name only the four above
            raise ControlError(404, f"action: unknown {action!r}")
        await self.audit.record(
            who,
            action,
            target="learner",
            old={"phase": phase_name(before), "paused": before.paused},
            new={"phase": phase_name(st), "paused": st.paused},
            detail=f"checkpoint={kw.get('checkpoint', True)}" if action == "stop" else "",
        )
        return {"step": st.step, "phase": phase_name(st), "paused": st.paused}

    async def hyperparams(self) -> dict[str, Any]:
        st = await self.learner.status()
        current = known_values(dict(st.hyperparams))
        return {
            "values": current,
            "fields": {
                name: {
                    "key": h.key,
                    "description": h.what,
                    "min": h.low,
                    "min_exclusive": h.low_open,
                    "max": h.high,
                }
                for name, h in HPARAMS.items()
                if name in current or name != "critic_lr"
            },
        }

    async def set_hyperparams(
        self, who: str, values: dict[str, float], *, source: str = "api", reason: str = ""
    ) -> dict[str, Any]:
        """Validates, sends to the learner (applied at its next step boundary), audits each field
        with its old and new value."""
        bad = problems(values)
        if bad:
            raise ControlError(422, "; ".join(bad))
        if not values:
            raise ControlError(422, "hyper-parameters: give at least one field")
        before = known_values(dict((await self.learner.status()).hyperparams))
        missing = [n for n in values if n not in before]
        if missing:
            raise ControlError(409, f"{missing[0]}: this run has no such hyper-parameter (no critic?)")
        reply = await self.learner.update({n: float(v) for n, v in values.items()})
        after = {BY_KEY[k].name: float(v) for k, v in reply.values.items() if k in BY_KEY}
        for name, value in values.items():
            await self.audit.record(
                who,
                "set_hyperparam",
                target=name,
                old=before.get(name),
                new=float(value),
                source=source,
                detail=reason or f"from step {reply.applies_from_step}",
            )
        return {"applies_from_step": reply.applies_from_step, "values": after}

    # ----- automatic responses -----
    def start_auto(self, on_action: Callable[[Remedy], None] | None = None) -> None:
        """Reads each new step's metrics every ``rlmesh.control.auto.poll_s`` and applies the
        remedies they call for; ``on_action`` is told of each (the metrics count them)."""
        self._on_action = on_action
        self._auto_task = asyncio.create_task(self._auto_loop())

    async def _auto_loop(self) -> None:
        auto = self.cfg.rlmesh.control.auto
        # Decisions from steps finished from now on: a restarted control plane does not act on old ones.
        try:
            newest = await self.redis.xrevrange(metrics_key(self.keys), count=1)
            self._seen_id = newest[0][0].decode() if newest else "-"
        except TRANSIENT_ERRORS:
            self._seen_id = "-"
        while True:
            await asyncio.sleep(auto.poll_s)
            try:
                rows = await read_step_metrics(self.redis, self.keys, after_id=self._seen_id)
                for row in rows:
                    self._seen_id = row["id"]
                    if row["step"] > 0:
                        await self.respond(row["step"], row["metrics"])
            except (ControlError, *TRANSIENT_ERRORS) as e:
                log.warning("automatic responses: %s", e)
            except Exception:
                log.exception("automatic responses failed; trying again")

    async def respond(self, step: int, metrics: dict[str, float]) -> list[Remedy]:
        hparams = known_values(dict((await self.learner.status()).hyperparams))
        remedies = self.responder.decide(step, metrics, hparams)
        for remedy in remedies:
            await self.apply(remedy, step, "auto")
        return remedies

    async def respond_to_alert(self, alertname: str) -> Remedy | None:
        st = await self.learner.status()
        rows = [r for r in await read_recent_metrics(self.redis, self.keys, 4) if r["step"] > 0]
        metrics = rows[-1]["metrics"] if rows else {}
        remedy = self.responder.on_alert(alertname, st.step, metrics, known_values(dict(st.hyperparams)))
        if remedy is not None:
            await self.apply(remedy, st.step, "webhook")
        return remedy

    async def apply(self, remedy: Remedy, step: int, source: str) -> None:
        await self.set_hyperparams(
            "auto", {remedy.hparam: remedy.new}, source=source, reason=f"{remedy.rule}: {remedy.reason}"
        )
        self.responder.acted(remedy.rule, step)
        self.auto_actions += 1
        if self._on_action is not None:
            self._on_action(remedy)
        log.warning(
            "automatic response: %s %s %g -> %g (%s)",
            remedy.rule,
            remedy.hparam,
            remedy.old,
            remedy.new,
            remedy.reason,
        )

    # ----- the autoscaler -----
    def start_autoscale(
        self, on_decision: Callable[[FleetReading, ScaleDecision], None] | None = None
    ) -> None:
        """Reads the fleet every ``rlmesh.control.autoscale.poll_s``, decides, publishes the target
        for the actuators and audits each change; ``on_decision`` is told of each decision."""
        self._scale_task = asyncio.create_task(self._autoscale_loop(on_decision))

    async def _autoscale_loop(
        self, on_decision: Callable[[FleetReading, ScaleDecision], None] | None
    ) -> None:
        poll_s = self.cfg.rlmesh.control.autoscale.poll_s
        while True:
            try:
                reading, decision = await self.autoscale_once()
                if on_decision is not None:
                    on_decision(reading, decision)
            except TRANSIENT_ERRORS as e:
                log.warning("autoscaler: %s", e)
            except Exception:
                log.exception("autoscaler failed; trying again")
            await asyncio.sleep(poll_s)

    async def autoscale_once(self) -> tuple[FleetReading, ScaleDecision]:
        """One reading, one decision, the target published (every time: its time says it is
        fresh), and an audit entry when the count changed."""
        reading = await read_fleet(
            self.redis, self.keys, self.registry, self.cfg.rlmesh.sampler.tasks_in_flight
        )
        decision = self.autoscaler.observe(reading)
        await publish_fleet_target(
            self.redis, self.keys, FleetTarget(decision.desired, reading.live, decision.reason)
        )
        self.last_scale = (reading, decision, time.time())
        if decision.changed:
            old = decision.before
            await self.audit.record(
                "autoscaler",
                "scale_replicas",
                target="rollout replicas",
                old=old,
                new=decision.desired,
                source="auto",
                detail=decision.reason,
            )
            log.warning("autoscaler: replicas %d -> %d (%s)", old, decision.desired, decision.reason)
        return reading, decision

    def autoscale_view(self) -> dict[str, Any]:
        """What ``GET /api/v1/autoscale`` answers: the settings and the last decision."""
        scale = self.cfg.rlmesh.control.autoscale
        out: dict[str, Any] = {"settings": scale.model_dump(), "last": None}
        out["settings"]["learner_backlog_limit"] = self.autoscaler.learner_backlog_limit
        if self.last_scale is not None:
            reading, decision, at = self.last_scale
            out["last"] = {
                "time": round(at, 3),
                "desired": decision.desired,
                "wanted": decision.wanted,
                "live": len(reading.live),
                "reason": decision.reason,
                "arrival_tasks_per_s": round(decision.arrival_per_s, 4),
                "done_tasks_per_s": round(decision.done_per_s, 4),
                "replica_tasks_per_s": None
                if decision.replica_tasks_per_s is None
                else round(decision.replica_tasks_per_s, 4),
                "tasks_outstanding": reading.outstanding,
                "tasks_claimed": reading.claimed,
                "learner_backlog": reading.learner_backlog,
                "capacity": reading.capacity,
            }
        return out
