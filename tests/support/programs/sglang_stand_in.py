"""Stands in for ``sglang.launch_server`` under ``rlmesh.rollout.sglang_server``: writes what it was
given (its in-process argv, whether the token is still in its environment, the command line the
kernel shows for it) as JSON to the file named after ``--out``."""

import json
import os
import sys
from pathlib import Path

if __name__ == "__main__":
    out = sys.argv[sys.argv.index("--out") + 1]
    Path(out).write_text(
        json.dumps(
            {
                "argv": sys.argv[1:],
                "env_token": os.environ.get("RLMESH_AUTH_TOKEN"),
                "cmdline": Path("/proc/self/cmdline").read_bytes().decode().split("\0"),
            }
        )
    )
