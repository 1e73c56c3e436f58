"""make bench-queue: enqueue-to-dequeue throughput of the trajectory stream on loopback.

For 1 KB and 64 KB trajectories and 1 and 8 producer processes: producers put trajectories in
batches of 64, the learner side claims, dedupes and commits them (TrajectoryCollector), and the
clock runs from the first put to the last commit. Target: >= 5,000 trajectories/s at 1 KB.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

from rlmesh.queue import RunKeys, TrajectoryCollector, connect, trajectory_queue
from rlmesh.runtime.launcher import ProcessLauncher
from rlmesh.v1 import trajectory_pb2


def make_trajectory(uid: str, size_bytes: int) -> trajectory_pb2.Trajectory:
    # int32 token ids take ~2-3 bytes each on the wire; pad with log-probs (4 bytes each).
    n = max(1, size_bytes // 8)
    return trajectory_pb2.Trajectory(
        uid=uid,
        group_uid=uid,
        prompt_ids=list(range(100, 100 + n)),
        response_ids=list(range(n)),
        rollout_log_probs=[-0.5] * n,
        score=1.0,
    )


def producer(url: str, run_id: str, worker: int, count: int, size: int, start: mp.Event) -> None:
    async def run() -> None:
        redis = connect(url)
        q = trajectory_queue(redis, RunKeys(run_id), f"producer-{worker}", maxlen=10_000_000)
        batch = [make_trajectory(f"w{worker}-{i}", size) for i in range(count)]
        start.wait()
        for i in range(0, count, 64):
            await q.put(batch[i : i + 64])
        await redis.aclose()

    asyncio.run(run())


async def consume(url: str, run_id: str, total: int) -> None:
    redis = connect(url)
    q = trajectory_queue(redis, RunKeys(run_id), "learner", maxlen=10_000_000)
    collector = TrajectoryCollector(q, RunKeys(run_id).used_uids)
    got = 0
    while got < total:
        batch = await collector.collect_until(min(512, total - got), timeout_s=60, block_ms=100)
        await collector.commit(batch)
        got += len(batch.trajectories)
    await redis.aclose()


def run_case(url: str, size: int, producers: int, total: int) -> float:
    run_id = f"bench-{size}-{producers}-{time.time_ns()}"

    async def setup() -> None:
        redis = connect(url)
        await trajectory_queue(redis, RunKeys(run_id), "learner", maxlen=10_000_000).ensure_group()
        await redis.aclose()

    asyncio.run(setup())
    start = mp.Event()
    per = total // producers
    procs = [mp.Process(target=producer, args=(url, run_id, w, per, size, start)) for w in range(producers)]
    for p in procs:
        p.start()
    t0 = time.perf_counter()
    start.set()
    asyncio.run(consume(url, run_id, per * producers))
    elapsed = time.perf_counter() - t0
    for p in procs:
        p.join()
    return per * producers / elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=20_000, help="trajectories per 1 KB case")
    args = parser.parse_args()
    with ProcessLauncher(stop_grace_s=10) as launcher:
        redis = launcher.start_redis(appendonly=True)
        print(f"redis at {redis.url} (AOF on, appendfsync everysec)", flush=True)
        print(f"{'size':>6} {'producers':>9} {'trajectories':>12} {'traj/s':>10} {'MB/s':>8}", flush=True)
        results = {}
        for size in (1024, 64 * 1024):
            for producers in (1, 8):
                total = args.count if size == 1024 else max(800, args.count // 20)
                rate = run_case(redis.url, size, producers, total)
                results[(size, producers)] = rate
                print(
                    f"{size // 1024:>5}K {producers:>9} {total:>12} {rate:>10.0f} {rate * size / 1e6:>8.1f}",
                    flush=True,
                )
    worst_1k = min(results[(1024, 1)], results[(1024, 8)])
    verdict = "meets" if worst_1k >= 5000 else "MISSES"
    print(f"1 KB: {worst_1k:.0f} trajectories/s at worst, {verdict} the 5,000/s target")
    return 0


if __name__ == "__main__":
    sys.exit(main())
