"""The `rlmesh` section: what verl has no keys for — services, Redis, weight sync, queues."""

from __future__ import annotations

import math
import re
from typing import Any, Literal

from pydantic import Field, SecretStr, field_validator, model_validator

from rlmesh.config.base import Section
from rlmesh.config.redis_url import redis_url_problem

# (gRPC or HTTP port, Prometheus port) of each service when nothing says otherwise.
SERVICE_PORTS: dict[str, tuple[int, int]] = {
    "reward": (50051, 9101),
    "reference": (50052, 9102),
    "rollout": (50053, 9103),
    "learner": (50054, 9104),
    "control": (8000, 9105),
}

_WILDCARD_HOSTS = ("0.0.0.0", "::", "")
# host, or host:port; an IPv6 literal in brackets.
_ADVERTISE = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+)(:\d{1,5})?")
_CPUS = re.compile(r"\s*(\d+(-\d+)?(\s*,\s*\d+(-\d+)?)*)?\s*")


class ServiceConfig(Section):
    """Where one service listens and how its clients call it; the same shape for every service."""

    host: str = Field("127.0.0.1", description="interface the service binds")
    port: int = Field(ge=0, le=65535, description="gRPC port (HTTP for control); 0 = pick a free one")
    metrics_port: int = Field(ge=0, le=65535, description="Prometheus /metrics port; 0 = pick a free one")
    addresses: list[str] = Field(
        default_factory=list,
        description="host:port where clients reach it, one per replica; empty = host:port",
    )
    advertise_address: str | None = Field(
        None,
        description="host, or host:port, this service tells its peers to reach it at (the replica "
        "registry, its ready file; the learner's host is also the weight-sync rendezvous), behind NAT, "
        "a proxy or a container's port mapping; a host alone keeps the bound port. null = env "
        "RLMESH_ADVERTISE_HOST, else the bound host, else (bound to 0.0.0.0 or ::) the address routing "
        "to Redis (docs/design.md#addresses)",
    )
    timeout_s: float = Field(60.0, gt=0, description="deadline of one call to this service, seconds")
    max_concurrency: int = Field(64, ge=1, description="calls served at once; more wait")
    cpus: str = Field(
        "",
        description="CPU cores its processes run on ('0', '1-3', '0,2'; empty = any): learner and "
        "generation on separate cores overlap (docs/throughput.md#cpu-placement)",
    )

    @field_validator("addresses", mode="before")
    @classmethod
    def _one_address(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @field_validator("advertise_address")
    @classmethod
    def _advertise(cls, value: str | None) -> str | None:
        if value is None:
            return None
        m = _ADVERTISE.fullmatch(value.strip())
        if m is None or (m.group(2) and not 0 < int(m.group(2)[1:]) < 65536):
            raise ValueError(f"{value!r}: expected host or host:port (an IPv6 literal in brackets)")
        if m.group(1).strip("[]") in _WILDCARD_HOSTS:
            raise ValueError(f"{value!r}: a wildcard address is not one a peer can dial")
        return value.strip()

    @field_validator("cpus", mode="before")
    @classmethod
    def _core_list(cls, value: Any) -> Any:
        if isinstance(value, int) and not isinstance(value, bool):
            value = str(value)  # cpus=1 on a command line is read as a number
        if isinstance(value, str) and not _CPUS.fullmatch(value):
            raise ValueError(f"{value!r}: expected core ids like '0', '1-3' or '0,2-3' (empty = any)")
        return value

    def client_addresses(self) -> list[str]:
        """Addresses a client dials: `addresses`, else this service's own host:port.

        A wildcard bind address (0.0.0.0, ::) is not dialable, so it becomes loopback.
        """
        if self.addresses:
            return list(self.addresses)
        host = "127.0.0.1" if self.host in _WILDCARD_HOSTS else self.host
        if ":" in host:  # IPv6 literal
            host = f"[{host}]"
        return [f"{host}:{self.port}"]


class RewardServiceConfig(ServiceConfig):
    """The reward service: where it listens, and how it scores."""

    function: Literal["gsm8k", "math", "math_dapo", "arithmetic"] | None = Field(
        None, description="force this built-in scorer for every sample; null = by data_source"
    )
    function_timeout_s: float | None = Field(
        None, gt=0, description="per-sample deadline of a reward function; null = timeout_s"
    )
    max_batch_size: int = Field(1024, ge=1, description="samples per Score call; larger calls are refused")
    workers: int = Field(32, ge=1, description="threads running synchronous reward functions")
    on_error: Literal["penalty", "drop"] = Field(
        "penalty",
        description="a sample whose reward failed (raised, timed out, returned no number): penalty = "
        "trained on with score error_score, its prompt group kept whole; drop = left out of training "
        "and of the validation score (its group trains on fewer samples). Either way it counts in "
        "reward/failed_ratio (docs/train.md#when-the-reward-fails)",
    )
    # Bounded as the learner bounds any score (rlmesh.learner.ppo.batch.MAX_ABS_SCORE).
    error_score: float = Field(
        0.0,
        ge=-1e6,
        le=1e6,
        description="the score of a sample whose reward failed, in training and validation, under "
        "on_error=penalty",
    )
    max_failed_ratio: float = Field(
        0.5,
        ge=0.0,
        le=1.0,
        description="the run stops, quoting the first failure's file and line, when more than this share "
        "of a step's (or a validation's) samples failed to score; 0 = at the first failure, as verl "
        "does; a step or validation in which every sample failed stops the run whatever this says",
    )


class ReferenceServiceConfig(ServiceConfig):
    """The reference policy: where its service listens, its model, or that the learner computes it."""

    model_path: str | None = Field(
        None, description="the reference model; null = actor_rollout_ref.model.path (the initial actor)"
    )
    max_tokens: int | None = Field(
        None, ge=1, description="padded tokens per forward; null = ref.log_prob_max_token_len_per_gpu"
    )
    max_batch_size: int = Field(1024, ge=1, description="samples per LogProbs call; larger calls are refused")
    device: str | None = Field(
        None,
        description="cpu, cuda, cuda:1, ...; null = cuda when available (the service's; a colocated "
        "reference runs on each learner rank's own device)",
    )
    dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        None, description="null = bfloat16 on GPU, float32 on CPU"
    )
    colocated: bool = Field(
        False,
        description="compute the reference log-probs in the learner, as verl's ActorRolloutRefWorker "
        "does: each rank loads the reference model once and scores its share of every batch at the "
        "start of the step; no reference service is started and replicas call none (the log-probs "
        "trajectories carry are ignored). false = the reference service, for scale-out",
    )


class RolloutServiceConfig(ServiceConfig):
    """Rollout replicas: where each listens, and how many `rlmesh train` starts."""

    replicas: int = Field(
        1,
        ge=0,
        description="rollout replicas `rlmesh train` starts on this machine; 0 = start none and use "
        "the replicas already registered in rlmesh.redis_url",
    )


class LearnerServiceConfig(ServiceConfig):
    """The learner service: where rank 0 listens, and how many data-parallel ranks it starts."""

    ranks: int = Field(
        1,
        ge=1,
        description="data-parallel ranks `rlmesh serve learner` starts on this machine (one GPU each on "
        "CUDA, gloo on CPU); a config that sets trainer.n_gpus_per_node and not this key gets that "
        "number; under torchrun or deepspeed the launcher's ranks apply instead",
    )
    start_paused: bool = Field(
        False,
        description="hold before the first step (after the first weight push and val_before_train) until "
        "resumed: the control plane's POST /api/v1/run/resume, rlmesh ctl resume or Learner.Resume. "
        "`rlmesh up` sets it, so a stack check trains nothing",
    )
    export_dir: str = Field(
        "",
        description="when the run's last step is done, the learner writes the actor there as an HF "
        "directory (LoRA merged, the training dtype, the tokenizer beside it), from memory: no process "
        "loads the checkpoint again. `rlmesh train` sets <trainer.default_local_dir>/actor-hf; empty = none "
        "(`rlmesh export` writes one from any checkpoint)",
    )
    async_checkpoint: bool = Field(
        True,
        description="a checkpoint is copied into host memory while the step waits and written to disk in "
        "the background (marked complete and renamed into place once every rank's files are written); a "
        "save waits for the one before it, and the run's last for itself. false: the step waits for the write",
    )
    standbys: int = Field(
        0,
        ge=0,
        le=1,
        description="warm standby learners `rlmesh train` keeps beside the learner: each has built its model "
        "and optimizer (every rank) and waits on the run's lease; when the learner dies, the standby takes "
        "the lease at once (the learner's process gone from this host) and resumes from the latest "
        "checkpoint, and a new standby is started. 0 = a dead learner is started again from nothing",
    )
    standby: bool = Field(
        False,
        description="this learner process is a warm standby: it builds its model and optimizer, then waits "
        "on the run's lease as long as it takes instead of giving up after 1.5 leases. Set by `rlmesh "
        "train` on the standbys it starts (rlmesh.learner.standbys)",
    )
    optimizer_threads: int = Field(
        0,
        ge=0,
        description="threads of the optimizer step when its states are offloaded to the CPU "
        "(actor/critic offload_optimizer: DeepSpeed's CPU Adam); 0 = every core the rank may use",
    )
    torch_threads: int = Field(
        0,
        ge=0,
        description="intra-op torch threads of each learner rank; 0 = OMP_NUM_THREADS (1 by default). "
        "Synchronous runs (max_staleness 0) leave the replicas idle while the learner trains: on a small "
        "CPU machine give the learner the cores",
    )
    overlap_phases: bool = Field(
        True,
        description="with one learner rank, run a step's independent phases side by side, each in a "
        "thread with its share of torch_threads: the reference, old-log-prob and value forwards, then "
        "the critic's update beside the actor's (as verl's split placement does on separate devices). "
        "Several ranks always run them in order",
    )


class AutoResponseConfig(Section):
    """The control plane's opt-in automatic responses to a run going off course (docs/control.md)."""

    enabled: bool = Field(
        False,
        description="apply the remedies below through the live hyper-parameter path, each logged in the "
        "audit log; false = only report (the alert rules still fire)",
    )
    kl_threshold: float = Field(
        0.03,
        gt=0,
        description="KL mean (actor/reward_kl_penalty, else actor/kl_loss) above which to raise the KL coefficient",
    )
    kl_factor: float = Field(1.5, gt=1, description="the KL coefficient is multiplied by this per action")
    kl_coef_max: float = Field(1.0, gt=0, description="ceiling of a KL coefficient raised automatically")
    grad_norm_threshold: float = Field(
        5.0, gt=0, description="actor grad norm (actor/grad_norm) above which to lower the actor lr"
    )
    lr_factor: float = Field(0.5, gt=0, lt=1, description="the actor lr is multiplied by this per action")
    lr_min: float = Field(1e-8, gt=0, description="floor of an actor lr lowered automatically")
    min_steps_between: int = Field(5, ge=1, description="training steps between two actions of one remedy")
    min_seconds_between: float = Field(300.0, ge=0, description="seconds between two actions of one remedy")
    poll_s: float = Field(
        2.0, gt=0, description="how often the control plane reads new step metrics, seconds"
    )


class AutoscaleConfig(Section):
    """The control plane's opt-in autoscaler: the number of rollout replicas from the prompt backlog,
    the tasks arriving and finishing, and the learner's backlog (docs/control.md#autoscaling)."""

    enabled: bool = Field(
        False,
        description="decide a desired replica count every poll_s, publish it (Redis, the "
        "rlmesh_autoscale_desired_replicas metric, GET /api/v1/autoscale) and audit each change; "
        "`rlmesh train` starts and stops its own replicas to match",
    )
    min_replicas: int = Field(1, ge=0, description="fewest replicas the autoscaler asks for")
    max_replicas: int = Field(8, ge=1, description="most replicas the autoscaler asks for")
    poll_s: float = Field(
        5.0, gt=0, description="how often the autoscaler reads the queues and decides, seconds"
    )
    target_utilization: float = Field(
        0.8,
        gt=0,
        le=1,
        description="share of the fleet's task slots the arriving tasks should keep busy: room for bursts",
    )
    target_backlog_s: float = Field(
        30.0,
        gt=0,
        description="a backlog of unclaimed tasks should be cleared within this many seconds; more "
        "replicas are asked for to do so",
    )
    scale_up_cooldown_s: float = Field(
        15.0, ge=0, description="seconds after a change before the count may rise again"
    )
    scale_down_cooldown_s: float = Field(
        60.0, ge=0, description="seconds after a change before the count may fall"
    )
    scale_down_window_s: float = Field(
        60.0,
        ge=0,
        description="the count falls only to the highest count asked for within this many seconds: a "
        "lull shorter than it keeps the fleet",
    )
    rate_window_s: float = Field(
        30.0, gt=0, description="arrival and completion rates are measured over the last this many seconds"
    )
    learner_backlog_samples: int = Field(
        0,
        ge=0,
        description="trajectories waiting for the learner at or above which the count is not raised: "
        "the learner sets the pace and more replicas would only make staler samples; 0 = two "
        "batches (2 x data.train_batch_size x rollout.n)",
    )

    @model_validator(mode="after")
    def _bounds(self) -> AutoscaleConfig:
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"min_replicas ({self.min_replicas}) is above max_replicas ({self.max_replicas})"
            )
        return self


class ControlServiceConfig(ServiceConfig):
    """The control plane: a REST API over the learner, the replicas, the reward services and the queues."""

    history_steps: int = Field(
        10_000,
        ge=1,
        description="steps of metrics the learner keeps in Redis for the control plane (a capped stream)",
    )
    audit_max_entries: int = Field(
        10_000, ge=1, description="entries the audit log of control actions keeps in Redis"
    )
    enabled: bool = Field(
        True, description="`rlmesh train` (and the demo) start the control plane; false = not started"
    )
    prometheus_url: str | None = Field(
        None,
        description="the Prometheus that evaluates deploy/alerts.yml for this run (http://host:port): "
        "GET /api/v1/alerts and the dashboard show its pending and firing alerts; null = none",
    )
    auto: AutoResponseConfig = Field(
        default_factory=AutoResponseConfig, description="automatic responses to alert conditions"
    )
    autoscale: AutoscaleConfig = Field(
        default_factory=AutoscaleConfig, description="the rollout fleet sized from its load (opt-in)"
    )


def _service(name: str, kind: type[ServiceConfig] = ServiceConfig) -> Any:
    port, metrics_port = SERVICE_PORTS[name]
    return Field(
        default_factory=lambda: kind(port=port, metrics_port=metrics_port),
        description=f"the {name} service",
    )


class PlacementConfig(Section):
    """Where a GPU job's processes run on a node: the learner's ranks (rlmesh.learner.ranks), the
    replicas (rlmesh.rollout.replicas x tensor_model_parallel_size) and the reference; a config
    that sets trainer.n_gpus_per_node and not those two keys gets a split that uses every GPU."""

    reference_gpus: int = Field(
        0,
        ge=0,
        le=1,
        description="GPUs of the reference service's own (1), or 0: it shares the learner's first GPU "
        "(it only scores; it never joins a NCCL group)",
    )
    claim_gpus: bool = Field(
        False,
        description="an SGLang replica claims tensor_model_parallel_size of the GPUs it sees (by UUID, "
        "under a lease in Redis) and starts SGLang on those only: for replicas that share a GPU pool, "
        "as compose's --scale rollout=N does; false = the GPUs it is given",
    )


class WeightSyncConfig(Section):
    """How the learner pushes new weights to rollout engines."""

    transport: Literal["distributed", "disk"] = Field(
        "distributed",
        description="distributed: torch.distributed broadcast; disk: safetensors on shared storage",
    )
    backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto",
        description="each engine's weight-group backend; auto = nccl when the learner and that engine "
        "are both on CUDA, else gloo",
    )
    master_address: str | None = Field(
        None,
        description="host engines dial to join the learner's weight group (its rendezvous); null = the "
        "learner's advertised host (rlmesh.learner.advertise_address, env RLMESH_ADVERTISE_HOST, its "
        "bound host; docs/design.md#addresses)",
    )
    master_port: int = Field(
        0, ge=0, le=65535, description="rendezvous port of the group; 0 = pick a free one"
    )
    bucket_size_mb: int = Field(256, gt=0, description="weights are broadcast in buckets of this many MiB")
    load_format: Literal["auto", "flattened_bucket", "per_tensor"] = Field(
        "auto",
        description="flattened_bucket: one broadcast per bucket (SGLang's load_format); per_tensor: "
        "one per tensor (also for SGLang servers older than flattened_bucket support); auto: per_tensor "
        "to a gloo weight group of several engines (gloo's tree overlaps successive broadcasts, not "
        "the levels of one), flattened_bucket otherwise",
    )
    group_size: int = Field(
        1,
        ge=1,
        description="engines sharing one weight group (one broadcast reaches them all: the learner sends "
        "about one copy per group, gloo relays it along a tree, NCCL along a ring; see load_format); "
        "1 = a group per engine, so a replica "
        "that dies mid-push costs only its own push; larger costs every member of its group that push "
        "(docs/sglang.md#weight-groups)",
    )
    timeout_s: float = Field(300.0, gt=0, description="deadline of one weight push, seconds")
    control_timeout_s: float = Field(
        30.0,
        gt=0,
        description="deadline of an engine's pause, version, flush and continue calls around a push; an "
        "engine cut off from the learner holds the push up this long (at most timeout_s), seconds",
    )
    verify_tensors: int = Field(
        4,
        ge=0,
        description="pushed tensors compared with each engine's copy after a push (their first rows); "
        "an engine that differs is dropped and pushed to afresh; 0 = none",
    )
    disk_dir: str | None = Field(None, description="shared directory for transport=disk")
    pause_mode: Literal["retract", "in_place"] = Field(
        "retract",
        description="how engines hold the sequences they run during a push (SGLang's pause_generation "
        "mode): retract = back to the queue, their KV cache dropped and recomputed with the new weights "
        "(the cache is flushed); in_place = kept where they are with their KV cache, and they go on "
        "decoding with the new weights, each token tagged with the version that sampled it "
        "(Trajectory.token_policy_versions; no flush: SGLang refuses one while requests run)",
    )


class RuntimeConfig(Section):
    """Process lifecycle."""

    shutdown_grace_s: float = Field(
        30.0, ge=0, description="on SIGTERM, time to drain in-flight work, seconds"
    )
    fork_server: bool = Field(
        True,
        description="`rlmesh train`, `demo` and `up` fork their rlmesh services (engines included) from "
        "one process that imported torch, transformers and DeepSpeed once, instead of each importing "
        "them again; false = exec each (docs/operations.md#the-fork-server)",
    )
    health_timeout_s: float = Field(
        120.0, gt=0, description="how long a launcher waits for a service to become healthy, seconds"
    )
    max_restarts_per_hour: int = Field(
        6,
        ge=0,
        description="`rlmesh train` restarts a crashed replica, reward, reference, Redis or learner (one "
        "killed, or with a rank lost) at most this often per hour each, then fails the job; 0 = a crash "
        "fails the job",
    )
    grpc_max_request_mb: int = Field(
        64,
        ge=1,
        le=1024,
        description="largest request a gRPC service accepts, MiB; a bigger one is refused with "
        "RESOURCE_EXHAUSTED before it is parsed (a Reward.Score batch of 1,024 samples of 4,096 "
        "tokens, ids and text, is about 30 MiB)",
    )
    grpc_max_concurrent_rpcs: int = Field(
        256,
        ge=1,
        description="calls one gRPC service runs at once; more are refused with RESOURCE_EXHAUSTED "
        "(clients retry)",
    )


class QueueConfig(Section):
    """Redis Streams holding prompt tasks and trajectories."""

    prompt_stream_maxlen: int = Field(
        100_000, gt=0, description="bound on unfinished prompt tasks; a put past it fails, nothing is trimmed"
    )
    trajectory_stream_maxlen: int = Field(
        100_000, gt=0, description="bound on unconsumed trajectories; a put past it fails, nothing is trimmed"
    )
    claim_idle_ms: int = Field(
        60_000, gt=0, description="a task idle this long at a dead consumer is reclaimed, ms"
    )
    max_deliveries: int = Field(3, ge=1, description="deliveries of one task before it is dropped as poison")
    heartbeat_ttl_s: float = Field(
        15.0, gt=0, description="a replica missing heartbeats this long is dropped, seconds"
    )
    finished_run_ttl_s: int = Field(
        7 * 24 * 3600,
        ge=0,
        description="a run's Redis keys expire this long after it finished (its checkpoints stay); 0 = never",
    )


class SamplerConfig(Section):
    """A rollout replica's sampler loop and its engine."""

    replica_id: str | None = Field(None, description="this replica's id in the registry; null = host-pid")
    tasks_in_flight: int = Field(8, ge=1, description="prompt tasks one replica works on at once")
    claim_block_ms: int = Field(1000, ge=1, description="how long one claim waits for new tasks, ms")
    retry_backoff_s: float = Field(0.2, gt=0, description="first backoff when reward/reference fail; doubles")
    retry_max_backoff_s: float = Field(10.0, gt=0, description="longest backoff between retries, seconds")
    breaker_failures: int = Field(
        5, ge=1, description="consecutive failures that open a dependency's breaker"
    )
    breaker_reset_s: float = Field(5.0, gt=0, description="an open breaker lets one call through after this")
    partial_chunk_tokens: int = Field(
        0,
        ge=0,
        description="partial rollouts: generate in calls of this many tokens and save each sample's tokens, "
        "log-probs and versions with its task in Redis after each, so a generation interrupted (its "
        "replica killed, an abort) goes on from them on any replica; 0 = one call per request "
        "(docs/reliability.md#partial-rollouts)",
    )
    engine_max_batch_size: int = Field(64, ge=1, description="embedded engine: sequences decoded together")
    engine_port: int = Field(0, ge=0, le=65535, description="port of the replica's engine; 0 = a free one")
    engine_advertise_url: str | None = Field(
        None,
        description="URL the learner uses for this replica's engine (weight pushes); null = "
        "http://<the replica's advertised host>:<engine port>; the engine binds rlmesh.rollout.host",
    )
    engine_startup_timeout_s: float = Field(
        600.0, gt=0, description="wait this long for the engine to be healthy"
    )
    engine_lost_after_s: float = Field(
        30.0,
        gt=0,
        description="an engine unreachable this long (its process exiting: at once) ends the replica: it "
        "deregisters, gives its tasks back and exits non-zero for its supervisor to restart it",
    )


class TlsConfig(Section):
    """Optional TLS on gRPC, the engines' HTTP and the control plane (docs/security.md#tls)."""

    cert_file: str | None = Field(
        None,
        description="PEM certificate this process serves with and presents to its peers; null = env "
        "RLMESH_TLS_CERT_FILE, else no TLS",
    )
    key_file: str | None = Field(None, description="its private key; null = env RLMESH_TLS_KEY_FILE")
    ca_file: str | None = Field(
        None, description="the CA every peer's certificate is checked against; null = env RLMESH_TLS_CA_FILE"
    )
    verify_clients: bool = Field(
        False, description="mutual TLS: servers refuse a client without a certificate from ca_file"
    )

    @model_validator(mode="after")
    def _all_or_none(self) -> TlsConfig:
        given = [k for k in ("cert_file", "key_file", "ca_file") if getattr(self, k)]
        if given and len(given) != 3:
            missing = sorted({"cert_file", "key_file", "ca_file"} - set(given))
            raise ValueError(f"TLS needs cert_file, key_file and ca_file together; missing {missing}")
        if self.verify_clients and not given:
            raise ValueError("verify_clients needs cert_file, key_file and ca_file")
        return self

    @property
    def enabled(self) -> bool:
        return bool(self.cert_file)


class SecurityConfig(Section):
    """Who may reach a service, and from where. docs/security.md"""

    allow_open_bind: bool = Field(
        False,
        description="let a service bind beyond loopback with no rlmesh.auth_token (anyone who reaches "
        "it can then call it); false = such a service refuses to start",
    )
    grpc_reflection: bool = Field(
        False,
        description="serve gRPC server reflection (behind the token, like every method but Health/Check)",
    )
    allowed_hosts: list[str] = Field(
        default_factory=list,
        description="Host header values the HTTP services (engine, control plane) accept besides "
        "loopback names and their own bind and advertised hosts; ['*'] = any (refuses DNS "
        "rebinding when not '*')",
    )
    allowed_origins: list[str] = Field(
        default_factory=list,
        description="browser origins (scheme://host[:port]) besides the service's own that may send "
        "requests other than GET/HEAD/OPTIONS to the HTTP services",
    )
    http_max_concurrency: int = Field(
        256, ge=1, description="HTTP requests an engine or control plane serves at once; more get a 503"
    )
    http_keep_alive_timeout_s: float = Field(
        5.0, gt=0, description="an idle HTTP keep-alive connection is closed after this long"
    )
    tls: TlsConfig = Field(default_factory=TlsConfig, description="optional TLS between processes")


class RlmeshSection(Section):
    """rlmesh's own keys."""

    run_id: str | None = Field(
        None, description="names the run in Redis and logs; null = generated by the launcher"
    )
    redis_url: str = Field(
        "redis://127.0.0.1:6379/0",
        description="Redis holding queues, registry and run state: redis://[[user]:password@]host:port/db "
        "(password %-encoded), or rediss:// for TLS with the files as query parameters (ssl_ca_certs, "
        "and ssl_certfile, ssl_keyfile where Redis checks clients)",
    )
    # SecretStr: repr, str, logs and model_dump show `**********`; readers call token().
    auth_token: SecretStr | None = Field(
        None,
        description="shared token every gRPC/REST call and every call to a rollout engine's HTTP API "
        "(SGLang's --api-key) must carry; health probes and /metrics stay open; null = env "
        "RLMESH_AUTH_TOKEN, else no auth",
    )
    max_staleness: int = Field(
        0,
        ge=0,
        description="policy versions a trajectory may lag the learner; 0 = synchronous on-policy (verl)",
    )
    over_provision: float = Field(
        0.0,
        ge=0.0,
        le=4.0,
        description="prompt groups kept in flight beyond the batches of the steps max_staleness queues, "
        "as a fraction of data.train_batch_size (APRIL's over-provisioning, rounded up): a step trains the "
        "first train_batch_size groups complete and the rest go on to serve the next one, so engines stay "
        "full through a step's long tail. Their tokens count toward max_staleness: with 0, those begun "
        "under a step's weights come back stale and are generated again",
    )
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"] = Field(
        "INFO", description="log level"
    )
    log_format: Literal["json", "text"] = Field("json", description="log line format")
    reward: RewardServiceConfig = _service("reward", RewardServiceConfig)
    reference: ReferenceServiceConfig = _service("reference", ReferenceServiceConfig)
    rollout: RolloutServiceConfig = _service("rollout", RolloutServiceConfig)
    learner: LearnerServiceConfig = _service("learner", LearnerServiceConfig)
    control: ControlServiceConfig = _service("control", ControlServiceConfig)
    weight_sync: WeightSyncConfig = Field(
        default_factory=WeightSyncConfig, description="learner → engine weights"
    )
    placement: PlacementConfig = Field(
        default_factory=PlacementConfig, description="GPUs of a node, by process (docs/train.md#gpus)"
    )
    runtime: RuntimeConfig = Field(default_factory=RuntimeConfig, description="process lifecycle")
    queue: QueueConfig = Field(default_factory=QueueConfig, description="Redis streams")
    sampler: SamplerConfig = Field(
        default_factory=SamplerConfig, description="rollout replicas' sampler loop"
    )
    security: SecurityConfig = Field(
        default_factory=SecurityConfig, description="who may reach a service (docs/security.md)"
    )

    @field_validator("redis_url")
    @classmethod
    def _redis_url(cls, value: str) -> str:
        # Its TLS files are checked where a client connects: the config may be read elsewhere.
        problem = redis_url_problem(value)
        if problem:
            raise ValueError(problem)
        return value

    @field_validator("log_level", mode="before")
    @classmethod
    def _upper_level(cls, value: Any) -> Any:
        return value.upper() if isinstance(value, str) else value

    @model_validator(mode="before")
    @classmethod
    def _service_port_defaults(cls, data: Any) -> Any:
        # A partial service section ({host: ...}) keeps that service's own default ports;
        # pydantic alone would replace the whole default object and then miss the ports.
        if not isinstance(data, dict):
            return data
        data = dict(data)
        for name, (port, metrics_port) in SERVICE_PORTS.items():
            section = data.get(name)
            if isinstance(section, dict):
                data[name] = {"port": port, "metrics_port": metrics_port, **section}
        return data

    def extra_groups(self, batch_size: int) -> int:
        """The groups ``over_provision`` keeps in flight beyond the steps' batches."""
        return math.ceil(round(self.over_provision * batch_size, 6))

    def token(self) -> str:
        """The run's token in clear, for a client to send or a server to check; "" = none."""
        return self.auth_token.get_secret_value() if self.auth_token is not None else ""

    def services(self) -> dict[str, ServiceConfig]:
        """Every service section by name."""
        return {name: getattr(self, name) for name in SERVICE_PORTS}
