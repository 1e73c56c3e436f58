"""make bench-scale: what one step's trajectories cost Redis and the learner, from a demo-sized step
to a 7B-shaped one (16k trajectories of up to 4k tokens), on one Redis on this machine.

    python benchmarks/bench_scale.py [--points 1024x512,...,16384x4096] [--producers 8] [--push 1x64,...,16x512]

For each point TRAJECTORIES x RESPONSE_TOKENS: ``--producers`` processes (standing for the rollout
replicas) publish the step's trajectories to the run's trajectory stream as replicas do (groups of
``--n``, a ``--prompt-tokens`` prompt, rollout and reference log-probs per response token, signed
with a run key when ``--signed``, as a run with a token signs them), and only then the learner
side collects them with the learner's own ``BatchCollector`` (validation included), pads them
into a ``PPOBatch`` (``build_batch``) and commits them. Publishing and collecting are timed apart,
so each is the cost of that side alone. Per point: the trajectories' bytes, the time and MB/s of
each side, the learner's CPU seconds, Redis's commands, bytes in and out, CPU seconds (its AOF
rewrites' included) and the memory the step's stream holds (the run's Redis settings: AOF on,
fsync every second, rewritten as it grows). The 16k x 4k point needs about 7 GB in the learner.

Then for each ``--push`` point ENGINESxMB: that many simulated engines (``rlmesh engine`` on a
``SimulationSpec`` of MB of bf16 weights, real processes forked from one fork server) and the
learner's ``WeightPusher`` pushing MB of weights to all of them over gloo, as the learner does
(a weight group per engine, ``flattened_bucket``, the update cycle's pause and continue): the
first push (the groups built) and the next two (warm) are timed, with the bytes moved.

Then for each ``--replicas`` count: a fleet of that many whole replicas on simulated engines, idle
and then saturated (``benchmarks/scale_fleet.py``).

Results go to runs/bench-scale/ with a figure of them (``--plot`` draws one from finished runs); docs/scale.md has the tables and the cost model fitted to them.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import multiprocessing as mp
import os
import resource
import secrets
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np
import torch

from rlmesh.engine.client import EngineClient
from rlmesh.engine.simulated import SimulatedModel, SimulationSpec, write_simulated_model
from rlmesh.learner.ppo.batch import BatchBuilder, PPOBatch, validate_trajectory
from rlmesh.learner.run.collect import BatchCollector
from rlmesh.learner.weight_sync.push import PushReport, WeightPusher
from rlmesh.queue import RunKeys, TrajectoryCollector, connect, trajectory_queue
from rlmesh.runtime.forkserver import ForkServer
from rlmesh.runtime.launcher import ProcessLauncher
from rlmesh.v1 import trajectory_pb2

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.bench_push_groups import timed_pushes
from benchmarks.scale_fleet import fleet_point, fleet_table, plot_scale, redis_info

REPO = Path(__file__).resolve().parents[1]
VOCAB = 152_064  # Qwen2's: token ids take 3 bytes as varints, as a real 7B job's do
INCARNATION = 1
PUT_BATCH = 16  # trajectories a replica puts at once (a group)


def say(msg: str) -> None:
    print(f"[bench-scale] {msg}", flush=True)


def template(prompt_tokens: int, response_tokens: int, seed: int) -> trajectory_pb2.Trajectory:
    rng = np.random.default_rng(seed)
    return trajectory_pb2.Trajectory(
        prompt_ids=rng.integers(0, VOCAB, prompt_tokens).tolist(),
        response_ids=rng.integers(1, VOCAB, response_tokens).tolist(),
        rollout_log_probs=(-rng.exponential(1.0, response_tokens)).astype(np.float32).tolist(),
        ref_log_probs=(-rng.exponential(1.0, response_tokens)).astype(np.float32).tolist(),
        score=1.0,
        policy_version=0,
    )


def producer(
    url: str,
    run_id: str,
    token: str | None,
    worker: int,
    groups: list[int],
    n: int,
    shape: tuple[int, int],
    start: Any,
    out: Any,
    arrive_s: float = 0.0,
) -> None:
    """One replica's share: ``groups`` (their indexes), n trajectories each, put a group at a time;
    with ``arrive_s``, the k-th of them at k/len(groups) of ``arrive_s`` (as generation finishes
    groups over a step), else as fast as it can."""

    async def run() -> None:
        redis = connect(url)
        q = trajectory_queue(redis, RunKeys.signed(run_id, token), f"replica-{worker}", maxlen=10_000_000)
        base = template(*shape, seed=worker)
        size = 0
        out.put(("ready", worker))
        start.wait()
        t0 = time.perf_counter()
        for k, g in enumerate(groups):
            if arrive_s:
                await asyncio.sleep(max(0.0, t0 + arrive_s * (k + 1) / len(groups) - time.perf_counter()))
            batch = []
            for k in range(n):
                t = trajectory_pb2.Trajectory()
                t.CopyFrom(base)
                t.group_uid = f"i{INCARNATION}:s1:d{g}:bench"
                t.uid = f"{t.group_uid}:{k}"
                t.replica_id = f"replica-{worker}"
                batch.append(t)
            size += sum(t.ByteSize() for t in batch)
            for i in range(0, len(batch), PUT_BATCH):
                await q.put(batch[i : i + PUT_BATCH])
        out.put((worker, time.perf_counter() - t0, size, time.time()))
        await redis.aclose()

    asyncio.run(run())


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def learner_side(
    url: str, run_id: str, token: str | None, groups: int, n: int, shape: tuple[int, int]
) -> dict[str, float]:
    """The learner's collection, validation, padding and commit of one step's batch: the rows are
    written as groups come in (``place_s`` of the collection's time), then finished (``finish_s``);
    ``ready_at`` is the wall clock when the batch was ready."""
    redis = connect(url)
    keys = RunKeys.signed(run_id, token)
    q = trajectory_queue(redis, keys, "learner", maxlen=10_000_000)
    collector = BatchCollector(
        TrajectoryCollector(q, keys.used_uids),
        n=n,
        incarnation=INCARNATION,
        max_staleness=0,
        validate=functools.partial(
            validate_trajectory,
            needs_ref=True,
            vocab_size=VOCAB,
            max_prompt_length=shape[0],
            max_response_length=shape[1],
        ),
    )

    async def requeue(_: trajectory_pb2.Trajectory) -> None:
        raise AssertionError("nothing in this benchmark is stale")

    timed = {"place_s": 0.0, "finish_s": 0.0}

    class TimedBuilder(BatchBuilder):
        def add(self, trajectories: Sequence[trajectory_pb2.Trajectory]) -> None:
            t = time.perf_counter()
            super().add(trajectories)
            timed["place_s"] += time.perf_counter() - t

        def finish(self) -> PPOBatch:
            t = time.perf_counter()
            batch = super().finish()
            timed["finish_s"] += time.perf_counter() - t
            return batch

    def new_batch() -> BatchBuilder:
        return TimedBuilder(
            0, rows=groups * n, max_prompt_length=shape[0], max_response_length=shape[1], with_ref=True
        )

    c0, t0 = cpu_s(), time.perf_counter()
    batch = await collector.collect(groups, version=0, timeout_s=3600, requeue=requeue, new_batch=new_batch)
    t1, ready_at = time.perf_counter(), time.time()
    if len(batch.trajectories) != groups * n or any(batch.counts.values()):
        raise SystemExit(f"collected {len(batch.trajectories)} of {groups * n}; refused {batch.counts}")
    ppo = batch.batch
    assert ppo is not None
    await collector.commit(batch)
    t2 = time.perf_counter()
    tensor_bytes = sum(v.numel() * v.element_size() for v in vars(ppo).values() if hasattr(v, "numel"))
    del ppo, batch
    await redis.delete(keys.trajectories, keys.used_uids)
    await redis.aclose()
    return {
        "collect_s": t1 - t0,
        **timed,
        "ready_at": ready_at,
        "commit_s": t2 - t1,
        "learner_cpu_s": cpu_s() - c0,
        "batch_tensor_bytes": float(tensor_bytes),
    }


def run_point(url: str, trajectories: int, response: int, args: argparse.Namespace) -> dict[str, Any]:
    shape = (args.prompt_tokens, response)
    groups = trajectories // args.n
    run_id = f"scale-{trajectories}x{response}-{time.time_ns()}"
    token = args.token

    async def setup() -> None:
        redis = connect(url)
        await trajectory_queue(redis, RunKeys.signed(run_id, token), "learner").ensure_group()
        await redis.aclose()

    asyncio.run(setup())
    before = asyncio.run(redis_info(url))
    ctx = mp.get_context("spawn")
    start, out = ctx.Event(), ctx.Queue()
    shares = [list(range(w, groups, args.producers)) for w in range(args.producers)]
    procs = [
        ctx.Process(
            target=producer, args=(url, run_id, token, w, share, args.n, shape, start, out, args.arrive_s)
        )
        for w, share in enumerate(shares)
    ]
    for p in procs:
        p.start()
    # The clock starts once every producer has imported and connected.
    if not all(out.get(timeout=300)[0] == "ready" for _ in procs):
        raise SystemExit("a producer sent something before it was ready")
    t0 = time.perf_counter()
    start.set()
    if args.arrive_s:  # the learner collects as the groups arrive, as in a run
        learner = asyncio.run(learner_side(url, run_id, token, groups, args.n, shape))
    reports = [out.get(timeout=3600) for _ in procs]
    publish_s = time.perf_counter() - t0
    for p in procs:
        p.join()
    published = asyncio.run(redis_info(url))
    if not args.arrive_s:  # then the learner, timed alone
        learner = asyncio.run(learner_side(url, run_id, token, groups, args.n, shape))
    after = asyncio.run(redis_info(url))
    # What the step waits for after its last trajectory: the last groups' collection, the batch's
    # rows and finishing it (meaningful with --arrive-s; without, the whole collection).
    learner["after_last_s"] = learner.pop("ready_at") - max(r[3] for r in reports)
    stream_bytes = sum(r[2] for r in reports)
    return {
        "trajectories": trajectories,
        "response_tokens": response,
        "prompt_tokens": args.prompt_tokens,
        "stream_bytes": stream_bytes,  # the trajectories' serialized sizes
        "redis_in_bytes": published["net_in"] - before["net_in"],  # commands and all, as Redis read them
        # With --arrive-s the learner read while the producers published: count from before.
        "redis_out_bytes": after["net_out"] - (before if args.arrive_s else published)["net_out"],
        "publish_s": publish_s,
        "publish_mb_s": stream_bytes / publish_s / 1e6,
        **learner,
        "collect_mb_s": stream_bytes / learner["collect_s"] / 1e6,
        "redis_commands": after["commands"] - before["commands"],
        "redis_cpu_s": after["cpu_s"] - before["cpu_s"],
        # None with --arrive-s: the learner took the step as it came, so it was never held whole.
        "redis_step_memory": None if args.arrive_s else published["memory"] - before["memory"],
        "redis_memory_after": after["memory"],
        # Redis's own settings rewrite the AOF as it grows (100%, 64 MB): its child's CPU is counted above.
        "aof_rewrites": after["aof_rewrites"] - before["aof_rewrites"],
    }


def push_point(
    launcher: ProcessLauncher, root: Path, engines: int, mb: int, bucket_mb: int
) -> dict[str, Any]:
    """Pushes ``mb`` MB of bf16 weights to ``engines`` fresh simulated engines, three times."""
    spec = SimulationSpec(weight_bytes=mb << 20, tensor_bytes=64 << 20, weight_dtype="bfloat16")
    model_dir = write_simulated_model(root / f"sim-{mb}mb", spec)
    started = [launcher.start_engine(model_dir, name=f"sim-{engines}x{mb}-{i}") for i in range(engines)]
    weights = {n: torch.randn(p.shape).to(p.dtype) for n, p in SimulatedModel(spec).named_parameters()}

    async def pushes() -> tuple[list[float], int]:
        clients = [EngineClient(e.url, timeout_s=600) for e in started]
        pusher = WeightPusher(
            clients,
            backend="gloo",
            timeout_s=600,
            bucket_bytes=bucket_mb << 20,
            load_format="flattened_bucket",
        )
        seconds, moved = [], 0

        def after_push(version: int, took: float, report: PushReport, _: object) -> None:
            nonlocal moved
            seconds.append(took)
            moved = report.bytes_per_engine * len(report.engines)

        await timed_pushes(pusher, clients, weights, 3, after_push)
        return seconds, moved

    try:
        (first, *warm), moved = asyncio.run(pushes())
    finally:
        for e in started:
            launcher.stop(e.process)
    warm_s = min(warm)
    return {
        "engines": engines,
        "weight_bytes": mb << 20,
        "first_push_s": first,
        "push_s": warm_s,
        "bytes_moved": moved,
        "gb_s": moved / warm_s / 1e9,
    }


def push_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| engines x weights | bytes moved | first push s (groups built) | push s (warm) | GB/s out of the learner |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['engines']} x {r['weight_bytes'] >> 20:,} MB | {r['bytes_moved'] / 1e9:.2f} GB | "
            f"{r['first_push_s']:.2f} | {r['push_s']:.2f} | {r['gb_s']:.2f} |"
        )
    return "\n".join(lines)


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| trajectories x tokens | stream MB | publish s (MB/s) | collect s (MB/s) | of which rows s | finish s "
        "| ready after the last s | commit s | learner CPU s | Redis commands | Redis CPU s | Redis MB held |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        held = "-" if r["redis_step_memory"] is None else f"{r['redis_step_memory'] / 1e6:,.0f}"
        lines.append(
            f"| {r['trajectories']:,} x {r['response_tokens']:,} | {r['stream_bytes'] / 1e6:,.0f} | "
            f"{r['publish_s']:.2f} ({r['publish_mb_s']:.0f}) | {r['collect_s']:.2f} ({r['collect_mb_s']:.0f}) | "
            f"{r['place_s']:.2f} | {r['finish_s']:.3f} | {r['after_last_s']:.2f} | {r['commit_s']:.2f} | "
            f"{r['learner_cpu_s']:.1f} | {r['redis_commands']:,.0f} | "
            f"{r['redis_cpu_s']:.1f} | {held} |"
        )
    return "\n".join(lines)


def parse_points(text: str, what: str = "TRAJECTORIESxTOKENS") -> list[tuple[int, int]]:
    points = []
    for item in filter(None, text.split(",")):
        a, _, b = item.partition("x")
        if not (a.isdigit() and b.isdigit()):
            raise argparse.ArgumentTypeError(f"a point is {what}, got {item!r}")
        points.append((int(a), int(b)))
    return points


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--points", type=parse_points, default=parse_points("1024x512,4096x1024,16384x1024,16384x4096")
    )
    p.add_argument(
        "--push",
        type=functools.partial(parse_points, what="ENGINESxMB"),
        default=parse_points("1x64,4x64,16x64,64x64,4x512,16x512"),
        help="weight pushes: engines x MB of weights (empty: none)",
    )
    p.add_argument(
        "--replicas",
        type=lambda text: [int(x) for x in text.split(",") if x],
        default=[1, 8, 32],
        help="fleet sweep: whole replicas on simulated engines, idle then saturated (empty: none)",
    )
    p.add_argument("--fleet-idle-s", type=float, default=20.0)
    p.add_argument("--fleet-load-s", type=float, default=30.0)
    p.add_argument("--bucket-mb", type=int, default=512, help="rlmesh.weight_sync.bucket_size_mb")
    p.add_argument("--producers", type=int, default=8, help="publishing processes (replicas)")
    p.add_argument("--n", type=int, default=16, help="samples per prompt (a group)")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument(
        "--arrive-s",
        type=float,
        default=0.0,
        help="spread each point's groups over this many seconds and collect as they arrive (0: publish "
        "all, then collect)",
    )
    p.add_argument(
        "--signed", action="store_true", help="sign every entry with a run key, as a run with a token does"
    )
    p.add_argument("--out", default="runs/bench-scale")
    p.add_argument(
        "--plot",
        nargs="+",
        metavar="RESULTS_JSON",
        help="only draw the figure of finished runs' results.json (merged) to --plot-out",
    )
    p.add_argument("--plot-out", default="docs/scale.png")
    args = p.parse_args(argv)
    if args.plot:
        records = [json.loads(Path(f).read_text()) for f in args.plot]
        print(f"wrote {plot_scale(records, Path(args.plot_out))}")
        return 0
    args.token = secrets.token_urlsafe(32) if args.signed else None  # never printed or written
    for t, _ in args.points:
        if t % args.n:
            p.error(f"{t} trajectories are not whole groups of --n {args.n}")
    outdir = REPO / args.out / time.strftime("%Y%m%d-%H%M%S")
    outdir.mkdir(parents=True)
    rows: list[dict[str, Any]] = []
    pushes: list[dict[str, Any]] = []
    fleets: list[dict[str, Any]] = []

    def record() -> None:
        args_out = {k: v for k, v in vars(args).items() if k != "token"}
        (outdir / "results.json").write_text(
            json.dumps({"args": args_out, "points": rows, "pushes": pushes, "fleets": fleets}, indent=1)
            + "\n"
        )

    with ProcessLauncher(outdir / "services", stop_grace_s=30) as launcher:
        redis = launcher.start_redis(appendonly=True)
        say(
            f"redis at {redis.url} (AOF on, fsync every second); {args.producers} producers; signed: {args.signed}"
        )
        for t, length in args.points:
            say(f"{t:,} trajectories of {length:,} response tokens (prompt {args.prompt_tokens}) ...")
            row = run_point(redis.url, t, length, args)
            rows.append(row)
            say(
                f"  {row['stream_bytes'] / 1e6:,.0f} MB: published in {row['publish_s']:.2f} s, collected in "
                f"{row['collect_s']:.2f} s (rows {row['place_s']:.2f} s), finished in {row['finish_s']:.3f} s, "
                f"ready {row['after_last_s']:.2f} s after the last, committed in {row['commit_s']:.2f} s"
            )
            record()
    if args.push:
        with (
            ForkServer.start(dict(os.environ)) as forkserver,
            ProcessLauncher(outdir / "engines", stop_grace_s=30, forkserver=forkserver) as launcher,
        ):
            for engines, mb in args.push:
                say(f"pushing {mb:,} MB to {engines} simulated engines ...")
                row = push_point(launcher, outdir, engines, mb, args.bucket_mb)
                pushes.append(row)
                say(
                    f"  first {row['first_push_s']:.2f} s, warm {row['push_s']:.2f} s ({row['gb_s']:.2f} GB/s out)"
                )
                record()
    for replicas in args.replicas:
        say(f"a fleet of {replicas} replicas on simulated engines ...")
        fleets.append(fleet_point(replicas, outdir, args.fleet_idle_s, args.fleet_load_s, say))
        say(f"  {json.dumps(fleets[-1])}")
        record()
    print()
    if rows:
        print(table(rows))
    if fleets:
        print()
        print(fleet_table(fleets))
    if pushes:
        print()
        print(push_table(pushes))
    figure = plot_scale([{"points": rows, "pushes": pushes, "fleets": fleets}], outdir / "scale.png")
    print(f"\n  results: {outdir / 'results.json'}; figure: {figure}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
