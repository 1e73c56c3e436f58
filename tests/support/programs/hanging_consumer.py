"""A rollout-side consumer in its own process: claims N prompt tasks, prints their uids as one
line, and then hangs without acking — the test SIGKILLs it."""

import asyncio
import sys

from rlmesh.queue import RunKeys, connect, prompt_queue


async def main(url: str, run_id: str, n: int) -> None:
    redis = connect(url)
    queue = prompt_queue(redis, RunKeys(run_id), consumer="doomed")
    await queue.ensure_group()
    got = await queue.claim(n, block_ms=5000)
    print(" ".join(d.message.uid for d in got), flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
