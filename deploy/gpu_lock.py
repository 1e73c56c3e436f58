"""The lock of the `gpu` extra (constraints-gpu.txt): write it from pip's resolver, or check that
pip still resolves `.[gpu]` to exactly it. `make lock-gpu` / `make gpu-lock-check`; docs/deploy.md"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LOCK = REPO / "constraints-gpu.txt"
HEADER = """\
# The locked environment of the `gpu` extra (sglang and its CUDA stack), for CUDA images and GPU
# machines: torch and transformers as sglang pins them. Written by `make lock-gpu` from pip's
# resolver (Linux x86_64, Python 3.11); `make gpu-lock-check` resolves `.[gpu]` against it again.
# cuda-tile is taken as a wheel only: its sdist is a stub that downloads from NVIDIA's index.
"""


def resolve(python: str, constraints: Path | None) -> dict[str, str]:
    """What ``pip install .[gpu]`` would install (a dry run: nothing is downloaded but metadata)."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        argv = [
            python, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
            "--only-binary=cuda-tile", "--report", str(report), f"{REPO}[gpu]",
        ]  # fmt: skip
        if constraints is not None:
            argv += ["-c", str(constraints)]
        subprocess.run(argv, check=True)
        items = json.loads(report.read_text())["install"]
    return {
        i["metadata"]["name"].lower(): i["metadata"]["version"]
        for i in items
        if i["metadata"]["name"].lower() != "rlmesh"
    }


def read_lock(path: Path = LOCK) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            pins[name.lower()] = version
    return pins


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("action", choices=["write", "check"])
    parser.add_argument("--python", default=sys.executable, help="a venv's python whose pip resolves")
    args = parser.parse_args()
    if args.action == "write":
        pins = resolve(args.python, None)
        LOCK.write_text(HEADER + "".join(f"{n}=={v}\n" for n, v in sorted(pins.items())))
        print(
            f"wrote {len(pins)} pins to {LOCK.name}: torch {pins.get('torch')}, sglang {pins.get('sglang')}"
        )
        return 0
    locked = read_lock()
    resolved = resolve(args.python, LOCK)
    differ = {n: (locked.get(n), v) for n, v in resolved.items() if locked.get(n) != v}
    if differ:
        print(f"pip resolves .[gpu] otherwise than {LOCK.name} (name: locked, resolved): {differ}")
        return 1
    print(f".[gpu] resolves to {LOCK.name}: {len(resolved)} packages, torch {resolved['torch']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
