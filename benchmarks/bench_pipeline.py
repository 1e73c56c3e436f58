"""make bench: the demo's pipeline at a fixed configuration; where each step's wall time went,
generation against its batched ceiling, calls per step, and the orchestration overhead.

Runs 20 PPO steps of the CPU demo (prepared model and data reused from `rlmesh demo`'s cache) and
prints, for the steady steps (step 1 warms up: left out) with their median:

1. each step's wall time (``timing_s/step``) split into the learner's phases from its metrics rows
   (``timing_s/*``: the wait for the batch, old log-probs, values, advantages, critic and actor
   updates, the weight push, any phase added later), and "other", the rest, so a row sums to the
   wall time;
2. generation per engine: the tokens it generated in the step and their rate over the step's
   generation window (the learner's wait for the batch, ``timing_s/gen``; in async mode generation
   also runs outside it, so the rate is an upper bound there), against the engine's ceiling: before
   the run, this process generates one whole wave (all prompts of a step x n, the replicas'
   sampling, max_new_tokens and engine_max_batch_size, the same model in float32) with
   ``rlmesh.engine.batching.BatchEngine``, the core every embedded engine runs: each decode step is
   one forward of every running row with a KV cache, so the ratio measures only how the work reaches
   the engine (calls, RPCs, idle time), not the engine. A step served under 25% of it is flagged.
   Beside it, the reference's forward seconds in the step, which the learner's wait also covers;
3. calls per step, with samples per call: the engines' ``/generate`` calls
   (``rlmesh_engine_generate_batch_size``), ``Reward.Score`` and ``Reference.LogProbs`` RPCs
   (``rlmesh_rpc_requests``, ``rlmesh_{reward,reference}_batch_size``), and Redis commands and read
   events (about one per round trip; ``INFO commandstats`` and ``INFO stats``), less this
   benchmark's own ``INFO``. Every counter is read as the learner starts training on a step
   (``Learner.GetStatus``): its batch is in and, in a synchronous run, the rollout side idles until
   the next step's prompts are queued, so a step's counts are its own generation, scoring and
   reference calls (Redis's also hold the previous step's commit); the sums over steps are exact;
4. the orchestration overhead: the share of the steady steps' wall time (from the start of step 2 to
   the end of the last step) during which no process did model compute. Model compute is the union
   of the wall-clock intervals during which
    - the learner computed old log-probs, values, critic and actor updates, or pushed weights
      (``timing_start/<phase>`` + ``timing_s/<phase>`` of its metrics rows),
    - any engine ran forwards (``busy_intervals`` of its ``/get_server_info``),
    - the reference ran forwards (``busy_intervals`` of its GetInfo);
   work that runs at the same time counts once. Target: <= 10%. It counts busy time, not work
   done: 64 one-prompt calls keep an engine as busy as one call of 64, which is why 1-3 come first;
   then what the rest of the wall time was: waiting for rollouts while nothing computed, the
   learner's advantages, and its bookkeeping between steps.
"""

from __future__ import annotations

import os
import statistics
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import grpc

from rlmesh.job import demo
from rlmesh.job.report import (
    FAR_BELOW_CEILING,
    command_calls,
    counter_deltas,
    engine_server_info,
    engine_url,
    far_below,
    metric_sum,
    phase_names,
    read_metrics,
    redis_info,
    served_share,
    step_phases,
)
from rlmesh.job.train import MetricsFollower, run_job, say_with
from rlmesh.runtime.busy import Interval, union_seconds
from rlmesh.runtime.health import scrape_metrics
from rlmesh.v1 import common_pb2, learner_pb2, reference_pb2_grpc

STEPS = 20
TARGET = 0.10
# The learner's model compute, each timed by the trainer or the loop (timing_s/ + timing_start/).
LEARNER_COMPUTE = ("ref", "old_log_prob", "values", "update_critic", "update_actor", "push_weights")
# The learner's phase (and its metrics file) are polled this often for the start of a step's training.
POLL_S = 0.05
MIN_WINDOW_S = 0.005  # a shorter wait for the batch is no generation window
CEILING_WAVES = 10  # the ceiling is the best of this many waves, after one warm-up wave
# Short column names of the learner's phases.
PHASE_COLUMNS = {
    "gen": "gen",
    "ref": "ref",
    "old_log_prob": "old_lp",
    "values": "values",
    "adv": "adv",
    "update_critic": "critic",
    "update_actor": "actor",
    "push_weights": "push",
}


# ----- the engine's ceiling ------------------------------------------------------------------------


@dataclass
class Ceiling:
    prompts: int
    sequences: int
    max_batch_size: int
    max_new_tokens: int
    tokens: int  # of the best wave
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def measure_ceiling(cfg: Any) -> Ceiling:
    """One whole wave (the first ``train_batch_size`` prompts of the training data, ``n`` samples
    each) generated in one request by a ``BatchEngine`` built as every embedded engine builds it,
    with the replicas' sampling parameters; the best of ``CEILING_WAVES`` waves."""
    from transformers.utils import logging as hf_logging

    from rlmesh.data import RLHFDataset
    from rlmesh.engine.batching import GenerationRequest
    from rlmesh.engine.sampling import parse_sampling_params
    from rlmesh.engine.state import load_state
    from rlmesh.models.tokenizer import load_tokenizer
    from rlmesh.rollout.replica import sampling_defaults

    hf_logging.disable_progress_bar()
    max_batch_size = cfg.rlmesh.sampler.engine_max_batch_size
    state = load_state(
        cfg.actor_rollout_ref.model.path,
        max_batch_size=max_batch_size,
        weight_version="ceiling",
        skip_tokenizer_init=False,
        weight_sync_timeout_s=60.0,
    )
    data = RLHFDataset.from_config(cfg.data, load_tokenizer(cfg.tokenizer_path()), split="train")
    prompts = [data[i].prompt_ids for i in range(min(len(data), cfg.data.train_batch_size))]
    sampling = {**sampling_defaults(cfg), "n": cfg.actor_rollout_ref.rollout.n}
    params = parse_sampling_params(sampling)
    engine = state.engine
    engine.start()

    def wave(batch: list[list[int]]) -> tuple[int, float]:
        done = threading.Event()
        request = GenerationRequest(
            rid=uuid.uuid4().hex, prompts=batch, params=params, on_done=lambda _: done.set()
        )
        t0 = time.perf_counter()
        engine.submit(request)
        done.wait()
        return sum(len(s.output_ids) for s in request.sequences), time.perf_counter() - t0

    try:
        wave(prompts)  # first forwards of each shape
        tokens, seconds = max((wave(prompts) for _ in range(CEILING_WAVES)), key=lambda w: w[0] / w[1])
    finally:
        engine.stop()
    return Ceiling(
        prompts=len(prompts),
        sequences=len(prompts) * params.n,
        max_batch_size=max_batch_size,
        max_new_tokens=params.max_new_tokens,
        tokens=tokens,
        seconds=seconds,
    )


# ----- counters, read once per step ----------------------------------------------------------------


def http_text(url: str, timeout_s: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:
        return resp.read().decode()


@dataclass
class StepCounters:
    """Reads every service's counters and Redis's once per step, from ``after_start`` to
    ``before_stop`` of the job, and keeps the deltas between reads (``deltas``, by step).

    A step's read happens when the learner starts training on it (``Learner.GetStatus``): its batch
    is in and, in a synchronous run, the rollout side is idle until the next step's prompts are
    queued, so no call falls on the wrong side. Where that phase is missed (a poll that came late),
    the read happens when the step's metrics row appears. A read that fails (a service restarting)
    is retried at the next poll; a delta that then covers several steps names them (``covers``)."""

    metrics_path: Path
    token: str | None = None
    deltas: dict[int, dict[str, float]] = field(default_factory=dict)
    covers: dict[int, list[int]] = field(default_factory=dict)  # step -> the steps its delta covers
    engines: list[str] = field(default_factory=list)  # names, "engine 0", ...
    has_reference: bool = False
    errors: list[str] = field(default_factory=list)
    late: int = 0  # steps read when their row appeared, not as their training began

    def __post_init__(self) -> None:
        self._follower = MetricsFollower(self.metrics_path)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._reads: list[Callable[[], dict[str, float]]] = []
        self._redis: Any = None
        self._learner: Any = None
        self._last: dict[str, float] = {}
        self._read_up_to = 0  # the last step read

    def start(self, stack: Any) -> None:
        import redis

        from rlmesh.runtime.auth import bearer_metadata
        from rlmesh.v1 import learner_pb2_grpc

        for i, replica in enumerate(stack.rollouts):
            url = engine_url(replica.grpc_address, self.token)
            self.engines.append(f"engine {i}")
            self._reads.append(lambda url=url, i=i: self._engine(f"engine {i}", url))
        for service, method in (("reward", "Score"), ("reference", "LogProbs")):
            instance = stack.get(service)
            if instance is None or not instance.metrics_port:
                continue  # attached, or colocated in the learner: not counted here
            host = instance.grpc_address.rsplit(":", 1)[0]
            self.has_reference |= service == "reference"
            port = instance.metrics_port
            self._reads.append(lambda s=service, m=method, h=host, p=port: self._service(s, m, h, p))
        self._redis = redis.Redis.from_url(stack.redis_url)
        self._redis.set_response_callback("INFO", lambda resp, **_: resp)  # the text, parsed here
        self._reads.append(self._redis_counts)
        channel = grpc.insecure_channel(stack.learner.grpc_address)
        stub = learner_pb2_grpc.LearnerStub(channel)
        metadata = bearer_metadata(self.token)
        self._learner = (channel, lambda: stub.GetStatus(common_pb2.Empty(), timeout=2, metadata=metadata))
        self._last = self.read()
        self._thread = threading.Thread(target=self._follow, name="bench-counters", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        if self._redis is not None:
            self._redis.close()
        if self._learner is not None:
            self._learner[0].close()

    @staticmethod
    def _engine(name: str, url: str) -> dict[str, float]:
        text = http_text(url + "/metrics")
        return {
            f"{name}/tokens": metric_sum(text, "rlmesh_engine_generated_tokens_total"),
            f"{name}/calls": metric_sum(text, "rlmesh_engine_generate_batch_size_count"),
            f"{name}/samples": metric_sum(text, "rlmesh_engine_generate_batch_size_sum"),
            f"{name}/busy_s": metric_sum(text, "rlmesh_engine_busy_seconds"),
        }

    @staticmethod
    def _service(service: str, method: str, host: str, port: int) -> dict[str, float]:
        text = scrape_metrics(host, port, timeout_s=5.0)
        rpc = f"/rlmesh.v1.{service.capitalize()}/{method}"
        return {
            f"{service}/rpcs": metric_sum(text, "rlmesh_rpc_requests_total", method=rpc),
            f"{service}/calls": metric_sum(text, f"rlmesh_{service}_batch_size_count"),
            f"{service}/samples": metric_sum(text, f"rlmesh_{service}_batch_size_sum"),
            f"{service}/busy_s": metric_sum(text, f"rlmesh_{service}_busy_seconds_total"),
        }

    def _redis_counts(self) -> dict[str, float]:
        info = redis_info(self._redis.execute_command("INFO", "stats", "commandstats").decode())
        out = {f"redis/{cmd}": float(n) for cmd, n in command_calls(info).items()}
        out["redis reads"] = float(info.get("total_reads_processed", 0))
        return out

    def read(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for read in self._reads:
            out.update(read())
        return out

    def _training_step(self) -> int:
        """The step the learner is training on now, else 0."""
        try:
            status = self._learner[1]()
        except grpc.RpcError:
            return 0
        return int(status.step) + 1 if status.phase == learner_pb2.LEARNER_PHASE_TRAINING else 0

    def _poll(self) -> None:
        training = self._training_step()
        rows = [int(r["step"]) for r in self._follower.new_rows() if "timing_s/step" in r]
        step = max([training, *rows])
        if step <= self._read_up_to:
            return
        try:
            now = self.read()
        except Exception as e:  # read again at the next poll (its delta may then cover two steps)
            self.errors.append(f"step {step}: {type(e).__name__}: {e}")
            return
        self.late += training < step
        delta = counter_deltas(self._last, now)
        # The benchmark's own INFO: one command and one read per read before this one.
        delta.pop("redis/info", None)
        delta["redis reads"] = max(0.0, delta.get("redis reads", 0.0) - 1)
        self._last = now
        self.deltas[step] = delta
        self.covers[step] = list(range(self._read_up_to + 1, step + 1))
        self._read_up_to = step

    def _follow(self) -> None:
        while not self._stop.wait(POLL_S):
            self._poll()


def engine_info(rollout_address: str) -> dict[str, Any]:
    info = engine_server_info(rollout_address)
    if "busy_intervals" not in info:
        raise SystemExit(f"the engine of {rollout_address} reports no busy_intervals in /get_server_info")
    return {
        "busy_s": float(info["busy_s"]),
        "intervals": [(float(a), float(b)) for a, b in info["busy_intervals"]],
    }


def reference_info(address: str) -> dict[str, Any]:
    with grpc.insecure_channel(address) as channel:
        info = reference_pb2_grpc.ReferenceStub(channel).GetInfo(common_pb2.Empty(), timeout=30)
    flat = list(info.busy_intervals)
    return {"busy_s": info.busy_s, "intervals": list(zip(flat[::2], flat[1::2], strict=True))}


def phase(row: dict[str, float], name: str) -> Interval:
    """The wall-clock interval of one timed phase of a metrics row."""
    if f"timing_start/{name}" not in row:
        raise SystemExit(
            f"step {row['step']:.0f}'s metrics have timing_s/{name} but no timing_start/{name}: the "
            "learner does not record when its phases begin"
        )
    start = row[f"timing_start/{name}"]
    return start, start + row[f"timing_s/{name}"]


def phases(rows: list[dict[str, float]], names: tuple[str, ...]) -> list[Interval]:
    return [phase(r, name) for r in rows for name in names if f"timing_s/{name}" in r]


def fmt(value: float | None, width: int, spec: str) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:{width}{spec}}"


def median_of(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def print_phases(steady: list[dict[str, float]]) -> None:
    names = phase_names(steady)
    split = [step_phases(r, names) for r in steady]
    columns = ["wall", *names, "other"]
    header = "".join(f"{PHASE_COLUMNS.get(c, c)[:7]:>8}" for c in columns)
    print("  1. wall time per step (s), split into the learner's phases; other = the rest of the step")
    print(f"    step{header}")
    for row, parts in zip(steady, split, strict=True):
        print(f"    {int(row['step']):>4}" + "".join(fmt(parts[c], 8, ".3f") for c in columns))
    print("  median" + "".join(fmt(median_of([p[c] for p in split]), 8, ".3f") for c in columns))
    wall = sum(p["wall"] for p in split)
    print("   share" + "".join(f"{sum(p[c] for p in split) / wall:8.1%}" for c in columns))
    print("    (gen = waiting for the batch, ref = a colocated reference's log-probs, old_lp = old")
    print("    log-probs, adv = advantages; share: of the steps' summed wall time, so it adds up; the")
    print("    medians need not)")


def print_generation(steady: list[dict[str, float]], counters: StepCounters, ceiling: Ceiling) -> None:
    print()
    print("  2. generation per engine against its ceiling")
    n = ceiling.sequences // max(ceiling.prompts, 1)
    print(
        f"    ceiling: one wave, {ceiling.prompts} prompts x {n} = {ceiling.sequences} sequences of <= "
        f"{ceiling.max_new_tokens} new tokens, in one request"
    )
    print(
        f"    to a BatchEngine in this process (engine_max_batch_size {ceiling.max_batch_size}): "
        f"{ceiling.tokens} tokens in {ceiling.seconds:.3f} s"
    )
    print(
        f"    = {ceiling.tokens_per_s:.0f} tokens/s (best of {CEILING_WAVES}); the engines are built alike, "
        "so it is each one's ceiling"
    )
    print("    gen: the learner's wait for the batch (s), which also covers scoring and reference")
    print("    log-probs; ref: the reference's forward time in the step (s); tok/s: the engine's tokens")
    print("    over gen; busy: over the engine's own forward time; ceil: tok/s as a share of the ceiling")
    group = f"{'tokens':>7}{'tok/s':>7}{'busy':>7}{'ceil':>6}"
    ref = counters.has_reference
    lead = 20 if ref else 14
    print((" " * lead + "".join(f" | {name:^27}" for name in counters.engines)).rstrip())
    print("    step   gen" + ("   ref" if ref else "") + "".join(f" | {group}" for _ in counters.engines))
    shares: dict[str, list[float | None]] = {name: [] for name in counters.engines}
    flagged = 0
    for row in steady:
        step, window = int(row["step"]), row.get("timing_s/gen", 0.0)
        delta = counters.deltas.get(step) if len(counters.covers.get(step, [])) == 1 else None
        line, low = f"    {step:>4}{window:6.2f}", False
        if ref:
            line += fmt(None if delta is None else delta.get("reference/busy_s", 0.0), 6, ".2f")
        for name in counters.engines:
            if delta is None:
                line += f" | {'-':>7}{'-':>7}{'-':>7}{'-':>6}"
                shares[name].append(None)
                continue
            tokens, busy_s = delta.get(f"{name}/tokens", 0.0), delta.get(f"{name}/busy_s", 0.0)
            busy_rate = tokens / busy_s if busy_s > 0 else 0.0
            if window < MIN_WINDOW_S:  # the batch was there already (async): no window to rate
                line += f" | {tokens:7.0f}{'-':>7}{busy_rate:7.0f}{'-':>6}"
                shares[name].append(None)
                continue
            rate, share = served_share(tokens, window, ceiling.tokens_per_s)
            shares[name].append(share)
            low |= far_below(share)
            line += f" | {tokens:7.0f}{rate:7.0f}{busy_rate:7.0f}{share:6.0%}"
        flagged += low
        print(line + (f"   <- under {FAR_BELOW_CEILING:.0%} of the ceiling" if low else ""))
    print(
        "  median"
        + " " * (lead - 8)
        + "".join(f" | {'':>21}{fmt(median_of(shares[n]), 6, '.0%')}" for n in counters.engines)
    )
    print(
        f"    {flagged} of {len(steady)} steps served generation under {FAR_BELOW_CEILING:.0%} of the "
        "ceiling on some engine"
    )


def print_calls(steady: list[dict[str, float]], counters: StepCounters) -> None:
    print()
    print("  3. calls per step: how many, x samples per call")
    columns = [("/generate", "engine"), ("Reward.Score", "reward")]
    if counters.has_reference:
        columns.append(("Ref.LogProbs", "reference"))
    print("    step" + "".join(f"{title:>14}" for title, _ in columns) + f"{'Redis cmds':>12}{'reads':>8}")
    table: list[list[float | None]] = []
    per_command: dict[str, list[float]] = {}

    def calls(delta: dict[str, float], prefix: str) -> tuple[float, float]:
        if prefix == "engine":
            names = counters.engines
            return (
                sum(delta.get(f"{n}/calls", 0.0) for n in names),
                sum(delta.get(f"{n}/samples", 0.0) for n in names),
            )
        # RPCs (refused ones too), and samples of the calls answered
        return delta.get(f"{prefix}/rpcs", 0.0), delta.get(f"{prefix}/samples", 0.0)

    for row in steady:
        step = int(row["step"])
        delta = counters.deltas.get(step)
        if delta is None or len(counters.covers.get(step, [])) != 1:
            into = next((k for k, steps in counters.covers.items() if step in steps), None)
            note = f"(counted with step {into})" if delta is None else f"(steps {counters.covers[step]})"
            print(f"    {step:>4}   {note}")
            continue
        line, values = f"    {step:>4}", []
        for _, prefix in columns:
            n, samples = calls(delta, prefix)
            line += f"{n:7.0f} x{samples / n if n else 0:5.1f}"
            values += [n, samples / n if n else None]
        commands = {k.removeprefix("redis/"): v for k, v in delta.items() if k.startswith("redis/")}
        for cmd, v in commands.items():
            per_command.setdefault(cmd, []).append(v)
        redis_cmds, reads = sum(commands.values()), delta.get("redis reads", 0.0)
        values += [redis_cmds, reads]
        table.append(values)
        print(line + f"{redis_cmds:12.0f}{reads:8.0f}")
    if table:
        med = [median_of([t[i] for t in table]) for i in range(len(table[0]))]
        line = "  median"
        for k in range(len(columns)):
            line += f"{fmt(med[2 * k], 7, '.0f')} x{fmt(med[2 * k + 1], 5, '.1f')}"
        print(line + f"{fmt(med[-2], 12, '.0f')}{fmt(med[-1], 8, '.0f')}")
    n_steps = max(len(table), 1)
    top = sorted(per_command.items(), key=lambda kv: -sum(kv[1]))[:10]
    print(
        "    Redis commands per step (mean): "
        + ", ".join(f"{cmd} {sum(v) / n_steps:.0f}" for cmd, v in top if sum(v) / n_steps >= 0.5)
    )
    print("    (reads: Redis's read events, about one per round trip: a pipeline of many commands is one)")
    if not counters.has_reference:
        print("    (no reference service: colocated in the learner, or attached, so not counted)")
    if counters.late:
        print(
            f"    ({counters.late} steps read when their metrics row appeared: their training start was missed)"
        )
    if counters.errors:
        print(
            f"    {len(counters.errors)} counter reads failed and were retried; the first: {counters.errors[0]}"
        )


def main() -> int:
    from rlmesh.config import load_config

    args = demo.build_parser().parse_args(
        ["--steps", str(STEPS), "--test-freq", "-1", "trainer.val_before_train=false", "trainer.save_freq=-1"]
    )
    say = say_with("bench")
    prepared = demo.prepare_from_args(args)
    run_id = f"bench-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir = Path(args.workdir) / run_id
    overrides = demo.run_overrides(args, prepared, run_dir, run_id)
    cfg = load_config(args.config, overrides)
    say("the engine's ceiling: one whole wave in this process, before the run starts")
    ceiling = measure_ceiling(cfg)
    say(f"ceiling: {ceiling.tokens_per_s:.0f} tokens/s ({ceiling.tokens} tokens in {ceiling.seconds:.3f} s)")
    counters = StepCounters(Path(cfg.trainer.default_local_dir) / "metrics.jsonl", cfg.rlmesh.token())
    services: dict[str, dict[str, Any]] = {}

    def read_services(stack: Any) -> None:
        counters.stop()
        for i, replica in enumerate(stack.rollouts):
            services[f"engine {i}"] = engine_info(replica.grpc_address)
        if stack.get("reference") is not None:
            services["reference"] = reference_info(stack.get("reference").grpc_address)

    try:
        result = run_job(
            args.config,
            overrides,
            service_dir=run_dir,
            say=say,
            after_start=counters.start,
            before_stop=read_services,
        )
    finally:
        counters.stop()
    if result.code != 0:
        print(f"the run failed: {result.failure}")
        return result.code
    rows = [r for r in read_metrics(run_dir / "checkpoints" / "metrics.jsonl") if "timing_s/step" in r]
    # The first step includes warm-up (first forwards, group set-up): leave it out.
    steady = rows[1:] or rows

    print()
    print(
        f"  pipeline benchmark: {len(rows)} PPO steps, {len(counters.engines)} rollout replicas; "
        f"steps {int(steady[0]['step'])}-{int(steady[-1]['step'])} below (step 1 warms up)"
    )
    print()
    print_phases(steady)
    print_generation(steady, counters, ceiling)
    print_calls(steady, counters)
    print()
    print("  4. orchestration overhead: the share of wall time in which no process computed")

    def total(key: str, rs: list = steady) -> float:
        return sum(r.get(key, 0.0) for r in rs)

    start, end = phase(steady[0], "step")[0], phase(steady[-1], "step")[1]
    wall = end - start
    # A phase the learner times beyond the known ones (a colocated reference's forward) is compute.
    extra = tuple(n for n in phase_names(rows) if n not in PHASE_COLUMNS)
    learner = phases(rows, LEARNER_COMPUTE + extra)
    engines = {name: s["intervals"] for name, s in services.items() if name.startswith("engine")}
    reference = services["reference"]["intervals"] if "reference" in services else []
    rollout_side = [*engines.values(), reference]
    everything = [learner, *rollout_side]
    for name, s in services.items():
        # Trackers keep their most recent intervals only: older ones dropped would undercount.
        if union_seconds([s["intervals"]], float("-inf"), float("inf")) < s["busy_s"] - 0.01:
            print(f"  warning: {name}'s busy intervals do not cover its busy_s: some were dropped")
    compute = union_seconds(everything, start, end)
    overhead = max(0.0, 1 - compute / wall)

    def idle_during(intervals: list[Interval]) -> float:
        """Seconds of ``intervals`` within the span during which nothing computed."""
        return union_seconds([intervals, *everything], start, end) - compute

    waiting = idle_during(phases(rows, ("gen",)))
    advantages = idle_during(phases(rows, ("adv",)))
    bookkeeping = wall - compute - waiting - advantages

    print(f"  steps 2-{len(rows)} span {wall:.1f} s of wall time")
    print(
        f"  generated tokens/s (learner's wait)   {total('training/response_tokens') / total('timing_s/gen'):9.0f}"
    )
    engine_busy = sum(s["busy_s"] for name, s in services.items() if name.startswith("engine"))
    print(
        f"  engine tokens/s while busy (all)      {total('training/response_tokens', rows) / max(engine_busy, 1e-9):9.0f}"
    )
    print(
        f"  learner forward tokens/s              {total('training/tokens') / max(total('timing_s/old_log_prob') + total('timing_s/values'), 1e-9):9.0f}"
    )
    print(
        f"  learner update tokens/s               {total('training/tokens') / max(total('timing_s/update_actor') + total('timing_s/update_critic'), 1e-9):9.0f}"
    )
    print(f"  weight push, mean seconds             {total('timing_s/push_weights') / len(steady):9.3f}")

    def share(seconds: float) -> str:
        return f"{seconds:7.1f} s {seconds / wall:6.1%}"

    print("  model compute within the span (each part, then their union):")
    print(f"    learner (forwards, updates, push)   {share(union_seconds([learner], start, end))}")
    for name, intervals in engines.items():
        print(f"    {name + ' forwards':<36}{share(union_seconds([intervals], start, end))}")
    print(f"    reference forwards                  {share(union_seconds([reference], start, end))}")
    rollout = union_seconds(rollout_side, start, end)
    print(f"    rollout side (engines + reference)  {share(rollout)}")
    overlap = union_seconds([learner], start, end) + rollout - compute
    print(f"    learner while the rollout side ran  {share(overlap)}")
    print(f"    all model compute (union)           {share(compute)}")
    print("  the rest, where nothing computed:")
    print(f"    waiting for rollouts                {share(waiting)}   (queues, reward scoring, RPCs)")
    print(f"    learner advantages                  {share(advantages)}")
    print(f"    learner bookkeeping, between steps  {share(bookkeeping)}   (batch, metrics, commit, logging)")
    print(
        f"  orchestration overhead                {overhead:9.1%}   "
        f"(target <= {TARGET:.0%}: {'met' if overhead <= TARGET else 'MISSED'})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
