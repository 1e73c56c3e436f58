"""``python -m rlmesh.rollout.sglang_server <sglang.launch_server args>``: SGLang's server with
``--api-key`` from env RLMESH_AUTH_TOKEN, kept out of the process's command line."""

# SGLang reads its API key from --api-key only (ServerArgs.api_key; no environment variable in the
# releases checked, docs/sglang.md). --api-key <token> in the argv we exec would show the token to
# every user in ps and /proc/<pid>/cmdline, so this module is what is exec'd: it appends --api-key
# to its in-process sys.argv (the kernel's copy, which ps reads, keeps the exec'd arguments) and
# runs sglang.launch_server as __main__. SGLang's own children are multiprocessing spawns, which get
# their arguments through a pipe, not argv.

from __future__ import annotations

import os
import runpy
import sys
from collections.abc import Sequence

from rlmesh.config.loader import ENV_AUTH_TOKEN

SGLANG_MODULE = "sglang.launch_server"


def run_with_api_key(module: str, args: Sequence[str]) -> None:
    """Runs ``module`` as ``__main__`` with ``args``, plus ``--api-key`` from env RLMESH_AUTH_TOKEN
    when that is set (removed from the environment first: SGLang's children need not inherit it)."""
    token = os.environ.pop(ENV_AUTH_TOKEN, "")
    sys.argv = [module, *args, *(["--api-key", token] if token else [])]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def main() -> None:
    run_with_api_key(SGLANG_MODULE, sys.argv[1:])


if __name__ == "__main__":
    main()
