"""How long the pre-flight of ``rlmesh config validate`` takes on each mistake a user makes, and on a
valid job: the target is under 5 s each (a newcomer's mistake found before anything starts).

Run: ``python benchmarks/bench_preflight.py [--repeat 3] [--limit 5]`` (``make bench-preflight``).

A job of the test suite's size (a tiny Qwen2 with the char tokenizer, 12 train and 4 val prompts, a
reward file: tests/support/preflight.py) is broken one way per case; each case runs
``rlmesh config validate -c JOB [overrides]`` as a subprocess, as a user runs it, ``--repeat`` times.
The table gives the exit code (2 for a mistake, 0 for the valid job and the finished run), the
median and slowest wall seconds, the CPU seconds, and whether the slowest is under ``--limit``; the
first row, ``--schema-only``, is the floor (Python, the CLI and the config without the pre-flight). The last row is
``rlmesh train`` on the finished run, which must say so and exit 0 as fast. Set
``OMP_NUM_THREADS`` before running (default 1, as every rlmesh process).
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the test suite's job builder: tests/support/preflight.py

from tests.support.data import row, write  # noqa: E402
from tests.support.preflight import JobFiles, long_rows, make_job, write_checkpoint  # noqa: E402


@dataclass
class Case:
    name: str
    args: list[str]  # after `rlmesh`
    expect: int  # the exit code


def cases(job: JobFiles, root: Path) -> list[Case]:
    """Each mistake of the pre-flight tests, the valid job, and the finished run (a checkpoint at the
    run's last step, in a run directory of its own)."""
    bare = root / "bare-model"
    shutil.copytree(job.model, bare, ignore=shutil.ignore_patterns("tokenizer*", "*.jinja"))
    syntax = root / "syntax.py"
    syntax.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None)\n")
    signature = root / "signature.py"
    signature.write_text("def compute_score(solution, truth):\n    return 0.0\n")
    raising = root / "raising.py"
    raising.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return float(solution_str == ground_truth['answer'])\n"
    )
    rows = pq.read_table(job.train).to_pylist()
    no_gt = write(root / "no_gt.parquet", [{k: v for k, v in r.items() if k != "reward_model"} for r in rows])
    long = write(root / "long.parquet", long_rows(12, long_every=3))
    unknown = write(root / "unknown.parquet", [row(f"q{i}", source="my_task") for i in range(12)])
    finished = JobFiles(**{**vars(job), "run_dir": root / "finished-run"})
    write_checkpoint(finished, 3)
    at_finished = f"trainer.default_local_dir={finished.run_dir}"

    validate = ["config", "validate", "-c", str(job.config)]
    return [
        Case("--schema-only (no pre-flight)", [*validate, "--schema-only"], 0),
        Case("valid job", validate, 0),
        Case("missing data file", [*validate, f"data.train_files={root / 'nope.parquet'}"], 2),
        Case("missing model directory", [*validate, f"actor_rollout_ref.model.path={root / 'nope'}"], 2),
        Case("missing tokenizer", [*validate, f"actor_rollout_ref.model.path={bare}"], 2),
        Case("missing reward file", [*validate, f"custom_reward_function.path={root / 'nope.py'}"], 2),
        Case("reward: syntax error", [*validate, f"custom_reward_function.path={syntax}"], 2),
        Case("reward: wrong signature", [*validate, f"custom_reward_function.path={signature}"], 2),
        Case("reward raises on the dry call", [*validate, f"custom_reward_function.path={raising}"], 2),
        Case("Parquet without reward_model", [*validate, f"data.train_files={no_gt}"], 2),
        Case("overlong prompts", [*validate, f"data.train_files={long}"], 2),
        Case(
            "unknown data_source",
            [*validate, f"data.train_files={unknown}", "custom_reward_function.path=null"],
            2,
        ),
        Case("finished run", [*validate, at_finished], 0),
        Case("rlmesh train: finished run", ["train", "-c", str(job.config), at_finished], 0),
    ]


def run(case: Case) -> tuple[int, float, float]:
    """(exit code, wall seconds, CPU seconds of the process)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "rlmesh.cli", *case.args],
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")},
        capture_output=True,
        text=True,
        timeout=300,
    )
    seconds = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    if proc.returncode != case.expect:
        print(
            f"{case.name}: exit {proc.returncode}, expected {case.expect}\n{proc.stdout}{proc.stderr}",
            file=sys.stderr,
        )
    return proc.returncode, seconds, cpu


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=3, help="runs of each case")
    p.add_argument("--limit", type=float, default=5.0, help="the target, seconds")
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory(prefix="bench-preflight-") as tmp:
        root = Path(tmp)
        job = make_job(root / "job")
        rows = []
        for case in cases(job, root):
            results = [run(case) for _ in range(args.repeat)]
            codes = {code for code, _, _ in results}
            times = [s for _, s, _ in results]
            cpu = statistics.median(c for _, _, c in results)
            rows.append((case, codes, statistics.median(times), max(times), cpu))
    print(
        f"\n  rlmesh config validate, {args.repeat} run(s) each, wall seconds (target: under {args.limit:g} s)"
    )
    print(f"  {'case':<32} {'exit':>4} {'median':>7} {'max':>7} {'cpu':>6}  under {args.limit:g} s")
    failed = 0
    for case, codes, median, slowest, cpu in rows:
        ok_code = codes == {case.expect}
        under = slowest < args.limit
        failed += not ok_code
        code = ",".join(map(str, sorted(codes))) + ("" if ok_code else "!")
        print(
            f"  {case.name:<32} {code:>4} {median:7.2f} {slowest:7.2f} {cpu:6.2f}  {'yes' if under else 'NO'}"
        )
    load = os.getloadavg()[0]
    print(
        f"\n  {os.cpu_count()} CPUs, load average {load:.1f} at the end (others' work slows the wall time; cpu: "
        "user + system seconds of the command, its median); '!' marks an unexpected exit code"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
