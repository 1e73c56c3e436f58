"""Runs a launcher in its own process for the orphan tests: starts a private Redis and the reward
service, prints their pids as one JSON line, then either blocks (to be SIGKILLed) or, with
`fail`, starts a service whose config is invalid so start-up fails half-way."""

import json
import sys

from rlmesh.runtime.launcher import LaunchError, ProcessLauncher


def main(mode: str, workdir: str) -> int:
    with ProcessLauncher(workdir, stop_grace_s=10) as launcher:
        redis = launcher.start_redis()
        reward = launcher.start_service(
            "reward",
            overrides=[
                "rlmesh.reward.port=0",
                "rlmesh.reward.metrics_port=0",
                f"rlmesh.redis_url={redis.url}",
            ],
        )
        pids = {"redis": redis.process.pid, "reward": reward.process.pid}
        if mode == "fail":
            try:
                launcher.start_service("reference", overrides=["rlmesh.reference.port=not-a-port"])
            except LaunchError as e:
                pids["error"] = str(e)
                pids["reference"] = launcher.processes[-1].pid
                print(json.dumps(pids), flush=True)
                raise
        print(json.dumps(pids), flush=True)
        sys.stdin.read()  # block until the test closes stdin or kills us
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
