"""Starting or attaching the rollout replica's inference engine: the embedded one or SGLang.

docs/design.md#engines"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlmesh.config.loader import ENV_AUTH_TOKEN
from rlmesh.config.rlmesh_section import SecurityConfig
from rlmesh.engine.client import EngineClient, engine_device_of
from rlmesh.runtime.launcher import ManagedProcess, ProcessLauncher
from rlmesh.runtime.net import bracket, check_open_bind, dial_host, free_port

log = logging.getLogger("rlmesh.rollout")


@dataclass
class RunningEngine:
    kind: str
    url: str
    client: EngineClient
    process: ManagedProcess | None = None
    weight_sync_ranks: int = 1  # SGLang: tp_size (each TP worker joins the weight-update group)
    device: str = "cpu"  # where it holds the weights: engine_device_of


def engine_env(token: str | None, gpus: list[str] | None = None) -> dict[str, str]:
    """What an engine's process gets on top of ours: the token, set either way (an engine told no
    token must not inherit one from this process's environment), and ``gpus`` (ids or UUIDs) as
    CUDA_VISIBLE_DEVICES when the replica claimed its own (gpu_slots)."""
    env = {ENV_AUTH_TOKEN: token or ""}
    if gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
    return env


def sglang_launch_argv(
    model_path: str,
    port: int,
    *,
    host: str = "127.0.0.1",
    tp_size: int = 1,
    mem_fraction_static: float = 0.5,
    seed: int = 0,
    dtype: str = "bfloat16",
    skip_tokenizer_init: bool = True,
    extra_args: list[str] | None = None,
    api_key_from_env: bool = False,
) -> list[str]:
    """The SGLang server command line for one replica (one server per replica: SGLang's weight
    endpoints need dp_size == 1). Token ids only (--skip-tokenizer-init): rlmesh tokenizes; SGLang
    then answers 400 to sampling params that need its tokenizer (``stop`` strings,
    ``min_new_tokens`` > 0) and sends no ``text``. Every flag is a ServerArgs field of SGLang
    0.4.10-0.5.23 (``--tp-size`` alias ``--tensor-parallel-size``; ``--dtype`` one of auto, half,
    float16, bfloat16, float, float32).

    ``api_key_from_env``: run it through ``rlmesh.rollout.sglang_server``, which adds ``--api-key``
    from env RLMESH_AUTH_TOKEN inside the process, where ``ps`` does not show it."""
    if tp_size < 1:
        raise ValueError(f"tp_size must be >= 1, got {tp_size}")
    return [
        sys.executable,
        "-m",
        "rlmesh.rollout.sglang_server" if api_key_from_env else "sglang.launch_server",
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
        *(["--skip-tokenizer-init"] if skip_tokenizer_init else []),
        *(extra_args or []),
    ]


def sglang_rollout_args(
    *,
    enforce_eager: bool = False,
    max_model_len: int | None = None,
    max_num_seqs: int | None = None,
    max_num_batched_tokens: int | None = None,
    enable_chunked_prefill: bool = True,
    enable_prefix_caching: bool = True,
    override_config: dict[str, Any] | None = None,
    engine_kwargs: dict[str, Any] | None = None,
) -> list[str]:
    """verl's rollout knobs as SGLang flags (verl's own SGLang server passes the first few the same
    way): enforce_eager -> --disable-cuda-graph, max_model_len -> --context-length, max_num_seqs ->
    --max-running-requests, max_num_batched_tokens -> --chunked-prefill-size (-1 when chunked prefill
    is off), no prefix caching -> --disable-radix-cache, the model's override_config ->
    --json-model-override-args, and each ``engine_kwargs`` entry (verl's engine_kwargs.sglang) as
    ``--name value`` (true: the bare flag; false/null: left out; a list: its items; a dict: JSON)."""
    args: list[str] = []
    if enforce_eager:
        args.append("--disable-cuda-graph")
    if max_model_len is not None:
        args += ["--context-length", str(max_model_len)]
    if max_num_seqs is not None:
        args += ["--max-running-requests", str(max_num_seqs)]
    if not enable_chunked_prefill:
        args += ["--chunked-prefill-size", "-1"]
    elif max_num_batched_tokens is not None:
        args += ["--chunked-prefill-size", str(max_num_batched_tokens)]
    if not enable_prefix_caching:
        args.append("--disable-radix-cache")
    if override_config:
        args += ["--json-model-override-args", json.dumps(override_config)]
    for name, value in (engine_kwargs or {}).items():
        flag = "--" + str(name).replace("_", "-")
        if value is True:
            args.append(flag)
        elif isinstance(value, (list, tuple)):
            args += [flag, *(str(v) for v in value)]
        elif isinstance(value, dict):
            args += [flag, json.dumps(value)]
        elif value not in (None, False):
            args += [flag, str(value)]
    return args


def _flag_value(argv: list[str], *names: str) -> str | None:
    """The value of the last ``--name V`` or ``--name=V`` among ``names`` in ``argv``."""
    value = None
    for i, arg in enumerate(argv):
        for name in names:
            if arg == name and i + 1 < len(argv):
                value = argv[i + 1]
            elif arg.startswith(name + "="):
                value = arg.split("=", 1)[1]
    return value


def weight_sync_ranks_of(server_info: dict) -> int:
    """The ranks an SGLang server brings to a weight-update group, from its /server_info: each
    tensor-parallel worker joins as ``rank_offset + tp_rank``. Raises where SGLang cannot take part
    (dp_size > 1: its weight endpoints assert dp_size == 1; pp_size > 1: workers of different
    pipeline stages would claim the same rank). The embedded engine names no tp_size: 1."""
    tp = int(server_info.get("tp_size") or 1)
    dp = int(server_info.get("dp_size") or 1)
    pp = int(server_info.get("pp_size") or 1)
    if dp > 1 or pp > 1:
        raise ValueError(
            f"SGLang server with dp_size={dp}, pp_size={pp}: weight updates need dp_size == 1 and "
            "pp_size == 1 (run one server per replica; use tp_size for more GPUs)"
        )
    return tp


def engine_http_args(security: SecurityConfig, own_hosts: Sequence[str] = ()) -> list[str]:
    """``rlmesh engine`` flags for ``rlmesh.security``'s HTTP settings; ``own_hosts``: the names the
    engine is reached by beyond its bind host (the replica's advertised host)."""
    args = [
        "--max-concurrency",
        str(security.http_max_concurrency),
        "--keep-alive-timeout",
        str(security.http_keep_alive_timeout_s),
    ]
    for host in dict.fromkeys([*own_hosts, *security.allowed_hosts]):
        args += ["--allowed-host", host]
    for origin in security.allowed_origins:
        args += ["--allowed-origin", origin]
    return args


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
    port: int = 0,
    host: str = "127.0.0.1",
    tp_size: int = 1,
    mem_fraction_static: float = 0.5,
    dtype: str = "bfloat16",
    seed: int = 0,
    skip_tokenizer_init: bool = True,
    extra_args: list[str] | None = None,
    token: str | None = None,
    override_config: dict[str, Any] | None = None,
    gpus: list[str] | None = None,
    allow_open_bind: bool = False,
    http_args: Sequence[str] = (),
) -> RunningEngine:
    """``token``: the engine it starts requires it (``Authorization: Bearer``; SGLang's ``--api-key``),
    handed over in the child's environment, never its argv; the client sends it, also to an engine
    it attaches to. None = env RLMESH_AUTH_TOKEN, as for the config's ``rlmesh.auth_token``.

    ``host``: the address an engine it starts binds (the replica's; a wildcard binds every
    interface); it reaches that engine on loopback then. ``override_config``: the embedded engine's
    model config overrides (an SGLang server takes them in ``extra_args``, sglang_rollout_args).
    An engine it starts beyond loopback with no token is refused (``OpenBindError``) unless
    ``allow_open_bind`` (rlmesh.security.allow_open_bind). ``http_args``: the embedded engine's
    Host, Origin and concurrency flags (:func:`engine_http_args`)."""
    if token is None:
        token = os.environ.get(ENV_AUTH_TOKEN) or None
    if not attach_urls:
        check_open_bind(host, f"the engine of {name} (rlmesh.rollout.host)", token, allow_open_bind)
    env = engine_env(token, gpus)
    if kind == "embedded":
        if not Path(model_path).exists():
            raise FileNotFoundError(f"actor_rollout_ref.model.path={model_path!r} does not exist")
        instance = await asyncio.to_thread(
            launcher.start_engine,
            model_path,
            name=f"{name}-engine",
            host=host,
            port=port,
            extra_args=[
                "--max-batch-size",
                str(max_batch_size),
                *(["--allow-open-bind"] if allow_open_bind else []),
                *http_args,
                *(["--json-model-override-args", json.dumps(override_config)] if override_config else []),
            ],
            env=env,
            timeout_s=startup_timeout_s,
        )
        client = EngineClient(
            instance.url, timeout_s=request_timeout_s, name=f"{name}-engine", token=token or ""
        )
        return RunningEngine("embedded", instance.url, client, instance.process, device="cpu")
    if kind != "sglang":
        raise ValueError(f"unknown engine {kind!r}; rlmesh supports 'embedded' and 'sglang'")
    if attach_urls:
        client = EngineClient(
            attach_urls[0], timeout_s=request_timeout_s, name=f"{name}-sglang", token=token or ""
        )
        await client.wait_healthy(startup_timeout_s)
        info = await client.server_info()
        return RunningEngine(
            "sglang",
            attach_urls[0],
            client,
            weight_sync_ranks=weight_sync_ranks_of(info),
            device=engine_device_of("sglang", info),
        )
    port = port or free_port(host)
    argv = sglang_launch_argv(
        model_path,
        port,
        host=host,
        tp_size=tp_size,
        mem_fraction_static=mem_fraction_static,
        seed=seed,
        dtype=dtype,
        skip_tokenizer_init=skip_tokenizer_init,
        extra_args=extra_args,
        api_key_from_env=bool(token),
    )
    # extra_args may set the parallelism itself (argparse: the last one wins).
    ranks = int(_flag_value(argv, "--tp-size", "--tensor-parallel-size") or tp_size)
    weight_sync_ranks_of(
        {
            "tp_size": ranks,
            "dp_size": _flag_value(argv, "--dp-size", "--data-parallel-size"),
            "pp_size": _flag_value(argv, "--pp-size", "--pipeline-parallel-size"),
        }
    )
    proc = launcher.spawn(f"{name}-sglang", argv, env)
    url = f"http://{bracket(dial_host(host))}:{port}"
    client = EngineClient(url, timeout_s=request_timeout_s, name=f"{name}-sglang", token=token or "")
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
    device = engine_device_of("sglang", await client.server_info())
    return RunningEngine("sglang", url, client, proc, weight_sync_ranks=ranks, device=device)
