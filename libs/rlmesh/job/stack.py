"""Starting a run's services as OS processes: ``start_stack`` (every job calls it) and ``run_stack``,
which is ``rlmesh up``. docs/train.md#rlmesh-up"""

from __future__ import annotations

import contextlib
import secrets
import signal
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from rlmesh.config import RLMeshConfig
from rlmesh.config.placement import (
    GpuPlan,
    PlacementError,
    check_fits_machine,
    gpu_count,
    plan_gpus,
    visible_gpus,
)
from rlmesh.config.secrets import redact_url
from rlmesh.config.verl_map import gpu_present
from rlmesh.runtime.auth import bearer_metadata
from rlmesh.runtime.health import grpc_health, http_ok, redis_ping, scrape_metrics
from rlmesh.runtime.launcher import (
    LaunchError,
    ManagedProcess,
    ProcessLauncher,
    RedisInstance,
    ServiceInstance,
    ServiceRequest,
    start_fork_server,
)
from rlmesh.runtime.net import free_port
from rlmesh.runtime.tls import export_tls, http_scheme, sync_channel, tls_of
from rlmesh.v1 import (
    common_pb2,
    learner_pb2_grpc,
    reference_pb2_grpc,
    reward_pb2_grpc,
    rollout_pb2_grpc,
)

# service -> (stub class, the RPC that describes it)
INFO_RPC = {
    "reward": (reward_pb2_grpc.RewardStub, "GetInfo"),
    "reference": (reference_pb2_grpc.ReferenceStub, "GetInfo"),
    "rollout": (rollout_pb2_grpc.RolloutStub, "GetInfo"),
    "learner": (learner_pb2_grpc.LearnerStub, "GetStatus"),
}


@dataclass
class ServiceReport:
    name: str
    pid: int
    address: str
    health: str
    metrics: str
    info: str


def probe_info(service: str, address: str, token: str | None) -> str:
    """What the service's info RPC answers: OK, or the status code it returned."""
    if service not in INFO_RPC:
        return "-"
    stub_cls, method = INFO_RPC[service]
    metadata = bearer_metadata(token)
    with sync_channel(address) as channel:
        try:
            getattr(stub_cls(channel), method)(common_pb2.Empty(), timeout=5, metadata=metadata)
        except grpc.RpcError as e:
            return f"{method}: {e.code().name}"
    return f"{method}: OK"


def probe(instance: ServiceInstance, token: str | None) -> ServiceReport:
    host = instance.grpc_address.rsplit(":", 1)[0]
    metrics = "-"
    if instance.metrics_port:
        text = scrape_metrics(host, instance.metrics_port)
        metrics = f":{instance.metrics_port}/metrics ({sum(1 for ln in text.splitlines() if ln.startswith('rlmesh_'))} rlmesh series)"
    if instance.name == "control":  # REST: its /health
        health = "SERVING" if http_ok(f"{http_scheme()}://{instance.grpc_address}/health") else "NOT_SERVING"
    else:
        health = grpc_health(instance.grpc_address)
    return ServiceReport(
        name=instance.name,
        pid=instance.process.pid,
        address=instance.grpc_address,
        health=health,
        metrics=metrics,
        info=probe_info(instance.name.split("-", 1)[0], instance.grpc_address, token),
    )


STACK_ORDER = ("reward", "reference", "rollout", "learner", "control")
STANDBY = "learner-standby"  # the warm standby learner's name (rlmesh.learner.standbys)


def learner_addresses(learner: ServiceInstance) -> str:
    """The override that points the control plane at ``learner``."""
    return f"rlmesh.learner.addresses=['{learner.grpc_address}']"


def free_port_overrides(service: str) -> list[str]:
    """Overrides that make ``service`` bind free ports (it reports them in its ready file)."""
    return [f"rlmesh.{service}.port=0", f"rlmesh.{service}.metrics_port=0"]


@dataclass
class Stack:
    """What ``start_stack`` started or attached to."""

    redis_url: str
    redis: RedisInstance | None  # None: attached to rlmesh.redis_url
    overrides: list[str]  # what every service was given: the caller's, Redis, reward and reference
    started: list[ServiceInstance] = field(default_factory=list)
    attached: dict[str, list[str]] = field(default_factory=dict)  # service -> addresses not started here
    # name -> (service, its own overrides, health timeout): what restart() starts again
    specs: dict[str, tuple[str, list[str], float]] = field(default_factory=dict)
    envs: dict[str, dict[str, str]] = field(default_factory=dict)  # name -> its GPUs (the GPU plan)
    launcher: ProcessLauncher | None = None
    config_path: str | None = None
    replica_wait_s: float = 600.0  # how long a replica started later may take to be healthy
    replicas_started: int = 0  # rollout-<i> names given so far: a replica added later never reuses one

    def get(self, name: str) -> ServiceInstance | None:
        return next((s for s in self.started if s.name == name), None)

    @property
    def rollouts(self) -> list[ServiceInstance]:
        return [s for s in self.started if s.name.startswith("rollout")]

    @property
    def learner(self) -> ServiceInstance | None:
        return self.get("learner")

    @property
    def standby(self) -> ServiceInstance | None:
        """The warm standby learner (rlmesh.learner.standbys), when one is up."""
        return self.get(STANDBY)

    def processes(self) -> list[tuple[str, ManagedProcess]]:
        """Every process started here, by name: Redis first, in start order."""
        named = [("redis", self.redis.process)] if self.redis is not None else []
        return named + [(s.name, s.process) for s in self.started]

    @property
    def control(self) -> ServiceInstance | None:
        return self.get("control")

    @property
    def control_url(self) -> str | None:
        """Where the control plane serves (``rlmesh ctl --url``); None when none was started."""
        control = self.control
        return f"{http_scheme()}://{control.grpc_address}" if control is not None else None

    def stop(self, meanwhile: Callable[[], None] | None = None, *, learner_exiting: bool = False) -> None:
        """Stops every process started here, side by side where the run allows: the control plane
        with the learner (which ends its step and writes its final checkpoint, and may still need
        the replicas, reward and reference for that step), then those together, Redis last (the
        others release what they hold in it as they stop). Each group takes as long as its
        slowest process, not the sum. ``meanwhile()`` runs while the last services stop.

        ``learner_exiting``: the learner's run is over (it let go of the others) and its process
        is exiting by itself: it is not signalled, the others stop at once, and it is waited for
        once they did."""
        assert self.launcher is not None, "stop needs the launcher start_stack was given"
        services = [s.process for s in self.started]
        learner = self.learner.process if self.learner is not None else None
        if learner is not None and learner_exiting:
            services.remove(learner)
        elif learner is not None and learner.alive():
            first = [p for p in services if p is learner or p is getattr(self.control, "process", None)]
            self.launcher.stop_together(first)
            services = [p for p in services if p not in first]
        self.launcher.stop_together(services, meanwhile=meanwhile)
        if learner is not None and learner_exiting:
            learner.popen.wait()  # a signal now could cut its exit short; then what it left behind
            self.launcher.stop_together([learner])
        if self.redis is not None:
            self.launcher.stop_together([self.redis.process])

    def promote_standby(self) -> ServiceInstance:
        """The learner died and its standby took the run over: the standby is the learner from now
        on, and the control plane (when there is one) is started again on its URL, pointed at it."""
        old, standby = self.learner, self.standby
        assert old is not None and standby is not None
        self.started.remove(standby)
        standby.name = "learner"
        self.started[self.started.index(old)] = standby
        self.specs["learner"] = self.specs[STANDBY]
        if self.control is not None:
            service, extra, timeout_s = self.specs["control"]
            extra = [e for e in extra if not e.startswith("rlmesh.learner.addresses=")]
            self.specs["control"] = (service, [*extra, learner_addresses(standby)], timeout_s)
            assert self.launcher is not None
            self.launcher.stop_together([self.control.process])  # its port is kept for the new one
            self.restart("control")
        return standby

    def start_standby(self) -> ServiceInstance:
        """A new warm standby, in place of one that took over or died."""
        instance = self._start(STANDBY)
        gone = self.standby
        if gone is not None:
            self.started.remove(gone)
        self.started.append(instance)
        return instance

    def restart(self, name: str) -> ManagedProcess:
        """Starts service ``name`` (or ``"redis"``) again after it died, where the others find it:
        Redis on its port with its data dir (its append-only file brings the run's queues back),
        reward and reference on their gRPC port (replicas and the learner were given it), the
        learner on its gRPC port too (the control plane was given it) with every rank, a rollout
        replica on new ports under the same replica id (it registers them). Raises ``LaunchError``
        when it does not come up healthy."""
        assert self.launcher is not None, "restart needs the launcher start_stack was given"
        if name == "redis":
            assert self.redis is not None
            self.redis = self.launcher.start_redis(port=self.redis.port, password=self.redis.password)
            return self.redis.process
        service = self.specs[name][0]
        old = self.get(name)
        assert old is not None
        keep = []
        if service in ("reward", "reference", "control", "learner"):  # where the others (and people) reach it
            keep = [f"rlmesh.{service}.port={old.grpc_address.rsplit(':', 1)[1]}"]
        instance = self._start(name, keep)
        self.started[self.started.index(old)] = instance
        return instance.process

    def add_replica(self) -> ServiceInstance:
        """Starts one more rollout replica, ``rollout-<i>`` with the next unused ``i``; returns it
        once healthy (it registers and claims like the first ones), raises ``LaunchError`` else."""
        name = f"rollout-{self.replicas_started}"
        self.replicas_started += 1
        self.specs[name] = ("rollout", [f"rlmesh.sampler.replica_id={name}"], self.replica_wait_s)
        try:
            instance = self._start(name)
        except BaseException:
            del self.specs[name]
            raise
        self.started.append(instance)
        return instance

    def replica_alive(self, name: str) -> bool:
        """Whether replica ``name`` runs now (a dead one is the supervisor's to restart, not to stop)."""
        instance = self.get(name)
        return instance is not None and instance.process.alive()

    def remove_replica(self, name: str) -> int | None:
        """Stops rollout replica ``name`` with SIGTERM: it stops claiming, finishes its tasks within
        rlmesh.runtime.shutdown_grace_s and gives the rest back to the queue, leaves the registry and
        exits. It is no part of the stack from the moment this is called (nothing restarts it).
        Returns its exit code: 0 when it drained and stopped in time."""
        assert self.launcher is not None, "stopping a replica needs the launcher start_stack was given"
        instance = self.get(name)
        assert instance is not None and name.startswith("rollout"), f"no replica {name!r} in the stack"
        self.started.remove(instance)
        del self.specs[name]
        self.launcher.stop_together([instance.process])
        return instance.process.popen.returncode

    def _start(self, name: str, keep: Sequence[str] = ()) -> ServiceInstance:
        """Starts ``name`` as ``start_stack`` specified it, on free ports but ``keep``'s."""
        assert self.launcher is not None, "starting a service needs the launcher start_stack was given"
        service, extra, timeout_s = self.specs[name]
        return self.launcher.start_service(
            service,
            name=name,
            config_path=self.config_path,
            overrides=[*self.overrides, *free_port_overrides(service), *extra, *keep],
            env=self.envs.get(name),
            timeout_s=timeout_s,
        )


def gpu_plan_here(cfg: RLMeshConfig) -> GpuPlan | None:
    """The config's GPU plan where this machine has a GPU (None elsewhere: nothing to place);
    ``PlacementError`` (a ``LaunchError``'s message) when it does not fit the machine."""
    if not gpu_present():
        return None
    try:
        plan = plan_gpus(cfg)
        if plan is not None:
            check_fits_machine(plan, gpu_count())
    except PlacementError as e:
        raise LaunchError(str(e)) from None
    return plan


def start_stack(
    launcher: ProcessLauncher,
    config_path: str | None,
    overrides: Sequence[str],
    *,
    services: Sequence[str] = STACK_ORDER,
    say: Callable[[str], None] = print,
) -> Stack:
    """Starts what the config needs on this machine, each service on free ports and side by side
    with the others: all at once but the control plane, which starts once the learner serves
    (reward and reference get their gRPC port from here, so the others are told it up front);
    returns when every one is healthy, raises ``LaunchError`` naming the one that failed.

    Attaches instead of starting where the config points at something running: Redis when
    ``rlmesh.redis_url`` is given, reward / reference when ``rlmesh.<svc>.addresses`` lists them,
    rollout replicas when ``rlmesh.rollout.replicas`` is 0 (those registered in Redis serve).
    ``rlmesh.rollout.replicas`` replicas are started otherwise; the learner always is. With
    ``rlmesh.reference.colocated`` no reference service is started or attached: the learner
    computes the reference log-probs itself.
    """
    from rlmesh.config import given_keys, load_config

    cfg = load_config(config_path, overrides)
    # Its probes (and the control plane's clients it starts) speak TLS when the services do.
    export_tls(tls_of(cfg.rlmesh.security.tls))
    timeout_s = cfg.rlmesh.runtime.health_timeout_s
    plan = gpu_plan_here(cfg)
    if plan is not None:
        say(plan.describe())
    given = given_keys(config_path, overrides)
    if "rlmesh.redis_url" in given:
        redis, redis_url = None, cfg.rlmesh.redis_url
        say(f"{'redis':<12} {redact_url(redis_url)} (given: not started here)")
    else:
        # A password even on loopback: another user of this machine reaches loopback too. It goes to
        # the children as a secret override (rlmesh.config.secrets), never their argv.
        redis = launcher.start_redis(password=secrets.token_urlsafe(24))
        redis_url = redis.url
        say(f"{'redis':<12} {redact_url(redis_url)} (pid {redis.process.pid})")
    stack = Stack(
        redis_url=redis_url,
        redis=redis,
        overrides=[*overrides, f"rlmesh.redis_url={redis_url}"],
        launcher=launcher,
        config_path=config_path,
    )

    notes: dict[str, str] = {}  # name -> what its started line adds

    def request(service: str, name: str, extra: Sequence[str], note: str) -> ServiceRequest:
        wait_s = max(timeout_s, 600.0) if service in ("rollout", "learner") else timeout_s
        stack.specs[name] = (service, list(extra), wait_s)
        notes[name] = note
        placed = plan.of(name) if plan is not None else None
        if placed is not None:
            stack.envs[name] = placed.env(visible_gpus())
        return ServiceRequest(
            service,
            name=name,
            config_path=config_path,
            overrides=[*stack.overrides, *free_port_overrides(service), *extra],
            env=stack.envs.get(name),
            timeout_s=wait_s,
        )

    # Everything but the control plane starts at once: reward and reference on ports chosen here,
    # so the replicas and the learner are given their addresses before either serves (a client
    # retries until they do, seconds before its first call); the control plane when the learner
    # serves (it is given its address).
    requests = []
    for service in ("reward", "reference"):
        section = getattr(cfg.rlmesh, service)
        if service == "reference" and cfg.rlmesh.reference.colocated:
            if service in services:
                say(f"{service:<12} colocated in the learner (rlmesh.reference.colocated): not started")
        elif section.addresses:
            stack.attached[service] = list(section.addresses)
            say(f"{service:<12} {', '.join(section.addresses)} (given: not started here)")
        elif service in services:
            port = free_port(section.host)  # free where the service binds, wildcard or not
            address = section.model_copy(update={"port": port}).client_addresses()[0]
            stack.overrides.append(f"rlmesh.{service}.addresses=['{address}']")
            requests.append(request(service, service, [f"rlmesh.{service}.port={port}"], ""))
    if "rollout" in services and cfg.rlmesh.rollout.replicas == 0:
        stack.attached["rollout"] = []
        say(
            f"{'rollout':<12} none started: the replicas registered in {redact_url(redis_url)} serve this run"
        )
    stack.replica_wait_s = max(timeout_s, 600.0)
    if "rollout" in services:
        engine = cfg.actor_rollout_ref.rollout.name
        stack.replicas_started = cfg.rlmesh.rollout.replicas
        for i in range(cfg.rlmesh.rollout.replicas):
            extra = [f"rlmesh.sampler.replica_id=rollout-{i}"]
            requests.append(request("rollout", f"rollout-{i}", extra, f", {engine} engine"))
    if "learner" in services:
        ranks = cfg.rlmesh.learner.ranks
        requests.append(
            request("learner", "learner", (), f", DeepSpeed, {ranks} rank{'s' if ranks > 1 else ''}")
        )

    def control(learner: ServiceInstance) -> list[ServiceRequest]:
        if "control" not in services or not cfg.rlmesh.control.enabled:
            return []
        # On its configured port when one was given (people and scripts dial it), else a free one.
        port = [f"rlmesh.control.port={cfg.rlmesh.control.port}"] if "rlmesh.control.port" in given else []
        return [request("control", "control", [learner_addresses(learner), *port], "")]

    def standby() -> list[ServiceRequest]:
        # Once the learner serves: the two would build their models side by side otherwise.
        if "learner" not in services or not cfg.rlmesh.learner.standbys:
            return []
        return [
            request("learner", STANDBY, ["rlmesh.learner.standby=true"], ", warm: waits on the run's lease")
        ]

    def then(instance: ServiceInstance) -> list[ServiceRequest]:
        stack.started.append(instance)
        say(f"{instance.name:<12} {instance.grpc_address} (pid {instance.process.pid}{notes[instance.name]})")
        if instance.name == "control":
            say(f"{'':<12} control plane: {http_scheme()}://{instance.grpc_address}/docs")
        return [*control(instance), *standby()] if instance.name == "learner" else []

    started = launcher.start_services(requests, then=then)
    # In the order they were started (as `rlmesh up` reports them), not the order they came up.
    stack.started = sorted(stack.started, key=lambda s: [i.name for i in started].index(s.name))
    return stack


def run_stack(
    config_path: str | None = None,
    overrides: Sequence[str] = (),
    services: str | Sequence[str] = STACK_ORDER,
    hold: bool = False,
    workdir: str | None = None,
) -> int:
    from rlmesh.config import ConfigError, given_keys, load_config

    names = [s for s in (services.split(",") if isinstance(services, str) else services) if s]
    try:
        cfg = load_config(config_path, overrides)  # fail here, once, before starting anything
    except ConfigError as e:
        print(f"invalid configuration:\n{e}")
        return 2
    run_id = cfg.rlmesh.run_id or f"up-{uuid.uuid4().hex[:8]}"
    token = cfg.rlmesh.token()
    t0 = time.monotonic()
    # Logs and Redis data stay in runs/<run id> (git-ignored) so they can be read afterwards.
    workdir = workdir or str(Path("runs") / run_id)
    forkserver = start_fork_server(cfg.rlmesh.runtime.fork_server)
    with (
        forkserver or contextlib.nullcontext(),  # closed once the launcher stopped its children
        ProcessLauncher(
            workdir, stop_grace_s=cfg.rlmesh.runtime.shutdown_grace_s, forkserver=forkserver
        ) as launcher,
    ):
        print(f"[rlmesh up] run {run_id}: logs in {launcher.workdir / 'logs'}", flush=True)
        # A check of the stack, not a run: the learner holds before its first step (resume it over
        # the control plane to train) unless the user says otherwise.
        paused = (
            []
            if "rlmesh.learner.start_paused" in given_keys(config_path, overrides)
            else ["rlmesh.learner.start_paused=true"]
        )
        common = [*overrides, f"rlmesh.run_id={run_id}", *paused]
        model_path = Path(cfg.actor_rollout_ref.model.path).expanduser()
        if not model_path.exists():
            model_path = _tiny_model(launcher.workdir / "tiny-model")
            common.append(f"actor_rollout_ref.model.path={model_path}")
            print(
                f"[rlmesh up] no model at {cfg.actor_rollout_ref.model.path}: built a tiny random Qwen2 at "
                f"{model_path} for this check",
                flush=True,
            )
        train_files = (
            cfg.data.train_files if isinstance(cfg.data.train_files, list) else [cfg.data.train_files]
        )
        if not all(Path(f).expanduser().exists() for f in train_files):
            from rlmesh.data import generate_arithmetic

            data = generate_arithmetic(
                launcher.workdir / "data",
                0,
                train_size=64,
                val_size=16,
                min_terms=2,
                max_terms=2,
                max_operand=20,
                ops="+",
            )
            common += [f"data.train_files={data['train']}", f"data.val_files={data['test']}"]
            print(
                f"[rlmesh up] no data at {train_files[0]}: wrote a small arithmetic set in {data['train'].parent}",
                flush=True,
            )
        try:
            stack = start_stack(
                launcher,
                config_path,
                common,
                services=names,
                say=lambda msg: print(f"[rlmesh up] {msg}", flush=True),
            )
        except LaunchError as e:
            print(f"[rlmesh up] start-up failed: {e}", flush=True)
            return 1
        started = stack.started
        if stack.redis is not None:
            redis = stack.redis
            pong = "PONG" if redis_ping(redis.host, redis.port, password=redis.password) else "no answer"
            print(
                f"[rlmesh up] redis     pid {redis.process.pid:<7} {redact_url(redis.url)}  PING: {pong}",
                flush=True,
            )
        for instance in started:
            report = probe(instance, token)
            print(
                f"[rlmesh up] {report.name:<9} pid {report.pid:<7} {report.address:<16} health: "
                f"{report.health:<8} metrics: {report.metrics}  {report.info}",
                flush=True,
            )
        print(
            f"[rlmesh up] {len(started)} services and redis healthy after {time.monotonic() - t0:.1f} s",
            flush=True,
        )
        try:
            if hold:
                print("[rlmesh up] holding; Ctrl-C stops everything", flush=True)
                while True:
                    signal.pause()
        finally:
            print("[rlmesh up] stopping everything", flush=True)
            stack.stop()
    print("[rlmesh up] all processes stopped", flush=True)
    return 0


def _tiny_model(out: Path) -> Path:
    from rlmesh.models import build_tiny_model, build_tokenizer

    return build_tiny_model(out, build_tokenizer(), hidden_size=64, num_layers=2)
