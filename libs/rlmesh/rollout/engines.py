"""Starting or attaching the rollout replica's inference engine.

- ``embedded``: ``rlmesh engine`` as a child process on a free port (CPU, HF transformers).
- ``sglang``: attach to ``actor_rollout_ref.rollout.sglang.url``, or launch
  ``python -m sglang.launch_server`` with flags from the config and wait for /health_generate.

Either way the replica holds an ``EngineClient``: everything after start-up is the same code.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from dataclasses import dataclass
from pathlib import Path

from rlmesh.engine.client import EngineClient
from rlmesh.runtime.launcher import ManagedProcess, ProcessLauncher, free_port

log = logging.getLogger("rlmesh.rollout")


@dataclass
class RunningEngine:
    kind: str
    url: str
    client: EngineClient
    process: ManagedProcess | None = None


def sglang_launch_argv(
    model_path: str,
    port: int,
    *,
    host: str = "127.0.0.1",
    tp_size: int = 1,
    mem_fraction_static: float = 0.5,
    seed: int = 0,
    dtype: str = "bfloat16",
    extra_args: list[str] | None = None,
) -> list[str]:
    """The SGLang server command line for one replica (one server per replica: SGLang's weight
    endpoints need dp_size == 1). Token ids only (--skip-tokenizer-init): rlmesh tokenizes."""
    return [
        sys.executable,
        "-m",
        "sglang.launch_server",
        "--model-path",
        model_path,
        "--host",
        host,
        "--port",
        str(port),
        "--tp-size",
        str(tp_size),
        "--mem-fraction-static",
        str(mem_fraction_static),
        "--random-seed",
        str(seed),
        "--dtype",
        dtype,
        "--skip-tokenizer-init",
        *(extra_args or []),
    ]


async def start_engine(
    *,
    kind: str,
    model_path: str,
    launcher: ProcessLauncher,
    name: str,
    attach_urls: list[str],
    max_batch_size: int,
    startup_timeout_s: float,
    request_timeout_s: float,
    tp_size: int = 1,
    mem_fraction_static: float = 0.5,
    dtype: str = "bfloat16",
    seed: int = 0,
    extra_args: list[str] | None = None,
) -> RunningEngine:
    if kind == "embedded":
        if not Path(model_path).exists():
            raise FileNotFoundError(f"actor_rollout_ref.model.path={model_path!r} does not exist")
        instance = await asyncio.to_thread(
            launcher.start_engine,
            model_path,
            name=f"{name}-engine",
            extra_args=["--max-batch-size", str(max_batch_size)],
            timeout_s=startup_timeout_s,
        )
        client = EngineClient(instance.url, timeout_s=request_timeout_s, name=f"{name}-engine")
        return RunningEngine("embedded", instance.url, client, instance.process)
    if kind != "sglang":
        raise ValueError(f"unknown engine {kind!r}; rlmesh supports 'embedded' and 'sglang'")
    if attach_urls:
        client = EngineClient(attach_urls[0], timeout_s=request_timeout_s, name=f"{name}-sglang")
        await client.wait_healthy(startup_timeout_s)
        return RunningEngine("sglang", attach_urls[0], client)
    port = free_port()
    argv = sglang_launch_argv(
        model_path,
        port,
        tp_size=tp_size,
        mem_fraction_static=mem_fraction_static,
        seed=seed,
        dtype=dtype,
        extra_args=extra_args,
    )
    proc = launcher.spawn(f"{name}-sglang", argv)
    url = f"http://127.0.0.1:{port}"
    client = EngineClient(url, timeout_s=request_timeout_s, name=f"{name}-sglang")
    deadline = asyncio.get_running_loop().time() + startup_timeout_s
    while not await client.healthy():
        if not proc.alive():
            raise RuntimeError(
                f"sglang.launch_server exited with code {proc.popen.returncode}; "
                f"last lines of {proc.log_path}:\n{proc.log_tail()}"
            )
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError(
                f"SGLang at {url} not healthy within {startup_timeout_s:.0f} s; see {proc.log_path}"
            )
        await asyncio.sleep(1.0)
    return RunningEngine("sglang", url, client, proc)
