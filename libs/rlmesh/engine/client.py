"""One async client for SGLang's native HTTP API, for a real SGLang server and the embedded engine
alike; version differences are probed, not configured. docs/internals.md#rlmeshengineclient"""

from __future__ import annotations

import asyncio
import os
import re
import time
import uuid
from collections.abc import Sequence
from typing import Any

import httpx

from rlmesh.config.loader import ENV_AUTH_TOKEN
from rlmesh.runtime.http_auth import bearer_headers
from rlmesh.runtime.tls import https_context

FLATTENED_BUCKET = "flattened_bucket"
# In /generate's meta_info with return_logprob, beside output_token_logprobs: the weight version
# each output token was sampled with. The embedded engine's own (SGLang reports one weight_version
# per response, at its end).
TOKEN_VERSIONS = "output_token_weight_versions"
# The first SGLang release whose UpdateWeightsFromDistributedReqInput has ``load_format`` (0.5.5.post3
# has none: the field would be dropped and the server would receive tensor by tensor).
FLATTENED_BUCKET_SINCE = (0, 5, 6)


def parse_server_version(text: Any) -> tuple[int, ...] | None:
    """``"0.5.5.post3"`` -> (0, 5, 5); None when ``text`` names no version."""
    m = re.match(r"\s*v?(\d+)\.(\d+)(?:\.(\d+))?", str(text or ""))
    if not m:
        return None
    return tuple(int(g) for g in m.groups() if g is not None)


def engine_device_of(kind: str, server_info: dict) -> str:
    """Where an engine holds its weights: its /server_info ``device`` (SGLang's ServerArgs.device,
    the embedded engine's ``cpu``), else SGLang's default ``cuda``; any other accelerator SGLang
    names (``xpu``, ``npu``) is not CUDA and gets a gloo weight group."""
    device = str(server_info.get("device") or ("cuda" if kind == "sglang" else "cpu"))
    return "cuda" if device.startswith("cuda") else device


class EngineError(RuntimeError):
    """An engine call failed; the message names the engine URL, the endpoint and why.
    ``status`` is the HTTP status when the engine answered (None when it could not be reached)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status

    @property
    def rejected(self) -> bool:
        """The engine refused the request itself (4xx): retrying the same request cannot help."""
        return self.status is not None and 400 <= self.status < 500


class EngineClient:
    """``token``: sent as ``Authorization: Bearer <token>`` on every call (an engine started with it,
    or SGLang with ``--api-key``, answers 401 without); None = env RLMESH_AUTH_TOKEN, as the config's
    ``rlmesh.auth_token: null``, which every service exports for its process (runtime/entry.py);
    "" = none."""

    def __init__(
        self, url: str, *, timeout_s: float = 600.0, name: str | None = None, token: str | None = None
    ) -> None:
        self.url = url.rstrip("/")
        self.name = name or self.url
        self.timeout_s = timeout_s
        if token is None:
            token = os.environ.get(ENV_AUTH_TOKEN)
        self._sends_token = bool(token)
        self._http = httpx.AsyncClient(
            base_url=self.url,
            timeout=httpx.Timeout(timeout_s, connect=10.0),
            headers=bearer_headers(token),
            # The run's CA (rlmesh.security.tls) and this process's certificate, for mutual TLS.
            verify=https_context(self.url) or True,
        )
        self._has_begin_end: bool | None = None
        # Paths that answered (SGLang 0.5.6+ names first, the deprecated ``get_`` names after a 404).
        self._info_paths: dict[str, str] = {}
        self._flattened_bucket: bool | None = None

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _call(
        self, method: str, path: str, json: Any = None, timeout_s: float | None = None
    ) -> httpx.Response:
        try:
            resp = await self._http.request(
                method,
                path,
                json=json,
                timeout=timeout_s if timeout_s is not None else httpx.USE_CLIENT_DEFAULT,
            )
        except httpx.TimeoutException as e:
            raise EngineError(
                f"{self.name}: {path} timed out after {timeout_s or self.timeout_s:.0f} s"
            ) from e
        except httpx.HTTPError as e:
            raise EngineError(f"{self.name}: {path} failed: {type(e).__name__}: {e}") from e
        if resp.status_code == 401:
            sent = "the token sent was refused" if self._sends_token else "no token was sent"
            raise EngineError(
                f"{self.name}: {path} answered 401 ({sent}): {resp.text[:300]}; the engine needs the "
                "run's rlmesh.auth_token (env RLMESH_AUTH_TOKEN; SGLang: its --api-key)",
                401,
            )
        return resp

    async def _json(self, method: str, path: str, json: Any = None, timeout_s: float | None = None) -> Any:
        resp = await self._call(method, path, json, timeout_s)
        if resp.status_code != 200:
            raise EngineError(
                f"{self.name}: {path} answered {resp.status_code}: {resp.text[:500]}", resp.status_code
            )
        return resp.json()

    async def _ack(self, path: str, json: Any, timeout_s: float | None = None) -> str:
        """Control calls answer {success, message}; success=false raises with the message."""
        resp = await self._call("POST", path, json, timeout_s)
        try:
            body = resp.json()
        except ValueError:
            body = {"success": resp.status_code == 200, "message": resp.text}
        if resp.status_code != 200 or not body.get("success", False):
            raise EngineError(
                f"{self.name}: {path} failed ({resp.status_code}): {body.get('message', body)}",
                resp.status_code,
            )
        return str(body.get("message", ""))

    # ----- generation -----
    async def generate(
        self,
        input_ids: list[int] | list[list[int]],
        sampling_params: dict[str, Any],
        *,
        return_logprob: bool = True,
        rid: str | None = None,
        timeout_s: float | None = None,
    ) -> Any:
        body: dict[str, Any] = {
            "input_ids": input_ids,
            "sampling_params": sampling_params,
            "return_logprob": return_logprob,
        }
        if return_logprob:
            body["logprob_start_len"] = -1
        if rid:
            body["rid"] = rid
        try:
            return await self._json("POST", "/generate", body, timeout_s)
        except EngineError as e:
            # SGLang answers 400 "Duplicate request ID detected" while an earlier request with this
            # rid still runs there (a retry after our timeout, before SGLang noticed the disconnect).
            if not (rid and e.status == 400 and "Duplicate request ID" in str(e)):
                raise
        body["rid"] = f"{rid}-{uuid.uuid4().hex[:8]}"
        return await self._json("POST", "/generate", body, timeout_s)

    async def reachable(self, timeout_s: float) -> bool:
        """Whether the server answers ``/health`` within ``timeout_s`` (it may be paused: unlike
        ``/health_generate`` this generates nothing)."""
        try:
            resp = await self._call("GET", "/health", timeout_s=timeout_s)
        except EngineError:
            return False
        return resp.status_code == 200

    async def healthy(self, timeout_s: float = 5.0) -> bool:
        try:
            resp = await self._call("GET", "/health_generate", timeout_s=timeout_s)
        except EngineError:
            return False
        return resp.status_code == 200

    async def wait_healthy(self, timeout_s: float, poll_s: float = 1.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not await self.healthy():
            if time.monotonic() > deadline:
                raise EngineError(f"{self.name}: /health_generate not OK within {timeout_s:.0f} s")
            await asyncio.sleep(poll_s)  # a refused connection answers at once: don't spin

    async def _info(self, name: str) -> dict[str, Any]:
        """GET /{name}, or /get_{name} where the server has only that (SGLang before 0.5.6)."""
        path = self._info_paths.get(name, f"/{name}")
        resp = await self._call("GET", path)
        if resp.status_code == 404 and path == f"/{name}":
            path = f"/get_{name}"
            resp = await self._call("GET", path)
        if resp.status_code != 200:
            raise EngineError(
                f"{self.name}: {path} answered {resp.status_code}: {resp.text[:300]}", resp.status_code
            )
        self._info_paths[name] = path
        return resp.json()

    async def model_info(self) -> dict[str, Any]:
        """``weight_version`` among others (SGLang: a string, "default" before any update)."""
        return await self._info("model_info")

    async def server_info(self) -> dict[str, Any]:
        """The server's arguments (``tp_size``, ``dp_size``, ...) and ``version`` (SGLang); the
        embedded engine's counters."""
        return await self._info("server_info")

    async def server_version(self) -> tuple[int, ...] | None:
        """SGLang's version, or None for a server that names none (the embedded engine)."""
        return parse_server_version((await self.server_info()).get("version"))

    async def supports_flattened_bucket(self) -> bool:
        """Whether ``load_format="flattened_bucket"`` is understood (SGLang 0.5.6+, the embedded engine)."""
        if self._flattened_bucket is None:
            version = await self.server_version()
            self._flattened_bucket = version is None or version >= FLATTENED_BUCKET_SINCE
        return self._flattened_bucket

    async def flush_cache(self) -> None:
        """Drops the prefix (radix) cache. SGLang refuses (400) while requests run or wait, unless
        generation is paused (``pause_generation``)."""
        resp = await self._call("POST", "/flush_cache")
        if resp.status_code != 200:
            raise EngineError(
                f"{self.name}: /flush_cache answered {resp.status_code}: {resp.text[:300]}", resp.status_code
            )

    async def pause_generation(self, mode: str | None = "retract") -> None:
        """Stops scheduling generation. ``mode`` (SGLang 0.5.6+; 0.5.5 ignores it and aborts):
        "retract" puts running requests back in the queue (their KV cache is dropped and recomputed
        after ``continue_generation``, so a flush and weight updates may run meanwhile); "abort"
        (SGLang's default) ends them with finish_reason abort; "in_place" keeps them and their KV
        cache (a flush is then refused). The embedded engine ignores it."""
        body = {} if mode is None else {"mode": mode}
        resp = await self._call("POST", "/pause_generation", body)
        if resp.status_code != 200:
            raise EngineError(
                f"{self.name}: /pause_generation answered {resp.status_code}: {resp.text[:300]}",
                resp.status_code,
            )

    async def continue_generation(self) -> None:
        resp = await self._call("POST", "/continue_generation", {})
        if resp.status_code != 200:
            raise EngineError(
                f"{self.name}: /continue_generation answered {resp.status_code}: {resp.text[:300]}",
                resp.status_code,
            )

    async def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        await self._call("POST", "/abort_request", {"rid": rid, "abort_all": abort_all})

    # ----- weights -----
    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str,
    ) -> str:
        return await self._ack(
            "/init_weights_update_group",
            {
                "master_address": master_address,
                "master_port": master_port,
                "rank_offset": rank_offset,
                "world_size": world_size,
                "group_name": group_name,
                "backend": backend,
            },
        )

    async def update_weights_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        group_name: str,
        weight_version: str | None,
        flush_cache: bool = False,
        load_format: str | None = None,
    ) -> str:
        """``load_format`` "flattened_bucket": the sender broadcasts all the tensors as one uint8
        tensor (their bytes in order, each at a byte offset that is a multiple of its element size:
        SGLang 0.5.23 refuses an unaligned one); None (not sent): one broadcast per tensor.

        Refused here (EngineError, status 400) for a server that predates flattened_bucket: it would
        drop the field and wait for per-tensor broadcasts, mismatching the sender's one broadcast."""
        if load_format == FLATTENED_BUCKET and not await self.supports_flattened_bucket():
            raise EngineError(
                f"{self.name}: load_format={FLATTENED_BUCKET!r} needs SGLang "
                f"{'.'.join(map(str, FLATTENED_BUCKET_SINCE))}+ (this server: "
                f"{'.'.join(map(str, await self.server_version() or ()))}); push per tensor instead",
                400,
            )
        body: dict[str, Any] = {
            "names": list(names),
            "dtypes": list(dtypes),
            "shapes": [list(s) for s in shapes],
            "group_name": group_name,
            "flush_cache": flush_cache,
        }
        if weight_version is not None:
            body["weight_version"] = weight_version
        if load_format is not None:
            body["load_format"] = load_format
        return await self._ack("/update_weights_from_distributed", body)

    async def update_weights_from_disk(
        self, model_path: str, weight_version: str | None, flush_cache: bool = True
    ) -> str:
        """``flush_cache``: SGLang 0.5.22+ fails it while requests run or wait, unless paused."""
        body: dict[str, Any] = {"model_path": model_path, "flush_cache": flush_cache}
        if weight_version is not None:
            body["weight_version"] = weight_version
        return await self._ack("/update_weights_from_disk", body)

    async def destroy_weights_update_group(self, group_name: str) -> str:
        return await self._ack("/destroy_weights_update_group", {"group_name": group_name})

    async def get_weights_by_name(self, name: str, truncate_size: int = 100) -> Any:
        return await self._json(
            "POST", "/get_weights_by_name", {"name": name, "truncate_size": truncate_size}
        )

    async def update_weight_version(self, version: str) -> str:
        # SGLang's abort_all_requests defaults to true: it would end every running request.
        return await self._ack(
            "/update_weight_version", {"new_version": version, "abort_all_requests": False}
        )

    async def begin_weight_update(self) -> None:
        """Opens SGLang's weight-update session (0.5.21+). A session left open by a push that died
        half-way is closed first: SGLang refuses a second begin until an end."""
        try:
            await self._probe_call("/begin_weight_update")
        except EngineError as e:
            if not (e.status == 400 and "already open" in str(e)):
                raise
            await self._probe_call("/end_weight_update")
            await self._probe_call("/begin_weight_update")

    async def end_weight_update(self) -> None:
        await self._probe_call("/end_weight_update")

    async def _probe_call(self, path: str) -> None:
        if self._has_begin_end is False:
            return
        resp = await self._call("POST", path, {})
        if resp.status_code == 404:
            self._has_begin_end = False  # SGLang before 0.5.21, or the embedded engine
            return
        self._has_begin_end = True
        if resp.status_code != 200:
            raise EngineError(
                f"{self.name}: {path} answered {resp.status_code}: {resp.text[:300]}", resp.status_code
            )
