"""SGLang's own HTTP server (sglang 0.5.23's ``http_server.app``: its routes, request dataclasses,
/generate contract check, API-key middleware and response bodies) over a back end that records what
each route hands it, for `make sglang-contract`. Runs in the contract venv, not rlmesh's.

    python sglang_http_contract.py --record FILE -- <the argv rlmesh gives sglang.launch_server>

The argv is parsed with SGLang's ServerArgs parser and resolved (``--device cpu`` added where it
names no device: this machine has no accelerator); ``--api-key`` comes from env RLMESH_AUTH_TOKEN,
as ``rlmesh.rollout.sglang_server`` adds it. FILE gets one JSON line for the resolved server args,
then one per back-end call: ``{"call": name, "obj": the request dataclass's fields}``.

The back end stands in for SGLang's TokenizerManager and scheduler (they need a GPU): weight calls
succeed, ``get_weights_by_name`` answers None as SGLang does for a model class without the method
(its Qwen2), generation returns ``max_new_tokens`` copies of token 1 in SGLang's output layout."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib.machinery
import json
import os
import sys
import time
import types
from pathlib import Path
from typing import Any


def _without_torchvision() -> None:
    """PyPI's torchvision is built against CUDA torch and cannot load beside the CPU build; sglang
    imports it at module level only for image models' preprocessing. transformers is asked first
    (and caches) that it is absent; then any ``torchvision.*`` import gets a module whose attributes
    are placeholders that refuse to be called."""
    from transformers.utils import import_utils

    assert not import_utils.is_torchvision_available()

    class Placeholder:
        def __init__(self, name: str) -> None:
            self._name = name

        def __getattr__(self, attr: str) -> Any:
            if attr.startswith("__"):
                raise AttributeError(attr)
            return Placeholder(f"{self._name}.{attr}")

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            raise RuntimeError(f"{self._name}: torchvision is not installed in the contract venv")

        def __mro_entries__(self, bases: tuple) -> tuple:
            return (object,)

    class Absent(types.ModuleType):
        def __getattr__(self, attr: str) -> Any:
            if attr.startswith("__"):
                raise AttributeError(attr)
            return Placeholder(f"{self.__name__}.{attr}")

    class Finder:
        def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
            if fullname == "torchvision" or fullname.startswith("torchvision."):
                return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
            return None

        def create_module(self, spec: Any) -> types.ModuleType:
            module = Absent(spec.name)
            module.__path__ = []
            return module

        def exec_module(self, module: types.ModuleType) -> None:
            pass

    sys.meta_path.insert(0, Finder())


def fields_of(obj: Any) -> dict[str, Any]:
    import msgspec

    if isinstance(obj, msgspec.Struct):
        return msgspec.structs.asdict(obj)
    if dataclasses.is_dataclass(obj):
        return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    return dict(vars(obj)) if hasattr(obj, "__dict__") else {"value": obj}


class RecordingBackend:
    """What SGLang's routes call on ``_global_state.tokenizer_manager``."""

    def __init__(self, server_args: Any, record: Path) -> None:
        from sglang.srt.managers.tokenizer_manager import ServerStatus

        self.server_args = server_args
        self.record_path = record
        self.startup_time = time.time()
        self.gracefully_exit = False
        self.server_status = ServerStatus.Up
        self.is_generation = True
        self.last_receive_tstamp = 0.0
        self.rid_to_state: dict[str, Any] = {}

    def record(self, call: str, obj: Any = None, **extra: Any) -> None:
        line = {"call": call, "obj": fields_of(obj) if obj is not None else extra}
        with self.record_path.open("a") as f:
            f.write(json.dumps(line, default=repr) + "\n")

    def auto_create_handle_loop(self) -> None:
        pass

    async def get_internal_state(self) -> list[dict]:
        return [{}]

    async def _weights(self, call: str, obj: Any, *rest: Any) -> tuple:
        self.record(call, obj)
        return (True, f"{call}: recorded", *rest)

    async def init_weights_update_group(self, obj: Any, request: Any = None) -> tuple:
        return await self._weights("init_weights_update_group", obj)

    async def update_weights_from_distributed(self, obj: Any, request: Any = None) -> tuple:
        return await self._weights("update_weights_from_distributed", obj)

    async def update_weights_from_disk(self, obj: Any, request: Any = None) -> tuple:
        return await self._weights("update_weights_from_disk", obj, 0)

    async def destroy_weights_update_group(self, obj: Any, request: Any = None) -> tuple:
        return await self._weights("destroy_weights_update_group", obj)

    async def begin_weight_update(self, obj: Any, request: Any = None) -> tuple:
        return await self._weights("begin_weight_update", obj)

    async def end_weight_update(self, obj: Any, request: Any = None) -> tuple:
        return await self._weights("end_weight_update", obj)

    async def update_weight_version(self, obj: Any) -> None:
        self.record("update_weight_version", obj)

    async def pause_generation(self, obj: Any) -> None:
        self.record("pause_generation", obj)

    async def continue_generation(self, obj: Any) -> None:
        self.record("continue_generation", obj)

    async def flush_cache(self, timeout_s: float = 0.0) -> Any:
        self.record("flush_cache", timeout_s=timeout_s)
        return types.SimpleNamespace(success=True, message="")

    async def get_weights_by_name(self, obj: Any, request: Any = None) -> Any:
        self.record("get_weights_by_name", obj)
        return None  # SGLang's answer for a model class without get_weights_by_name

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        self.record("abort_request", rid=rid, abort_all=abort_all)

    async def generate_request(self, obj: Any, request: Any = None) -> Any:
        self.last_receive_tstamp = time.time()
        if obj.rid and str(obj.rid).startswith("HEALTH_CHECK"):
            yield {}
            return
        self.record("generate", obj)
        n = int((obj.sampling_params or {}).get("max_new_tokens", 4))
        yield {
            "output_ids": [1] * n,
            "meta_info": {
                "id": obj.rid or "0",
                "finish_reason": {"type": "length", "length": n},
                "prompt_tokens": len(obj.input_ids or []),
                "completion_tokens": n,
                "output_token_logprobs": [[-0.5, 1, None]] * n,
                "weight_version": "default",
            },
        }


def main() -> None:
    argv = sys.argv[1:]
    split = argv.index("--")
    ours = argparse.ArgumentParser()
    ours.add_argument("--record", required=True)
    record = Path(ours.parse_args(argv[:split]).record)
    sglang_argv = argv[split + 1 :]
    token = os.environ.pop("RLMESH_AUTH_TOKEN", "")
    if token:
        sglang_argv += ["--api-key", token]
    if "--device" not in sglang_argv:
        sglang_argv += ["--device", "cpu"]

    _without_torchvision()
    import uvicorn
    from sglang.srt.entrypoints import http_server
    from sglang.srt.runtime_context import publish
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.utils.auth import add_api_key_middleware

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    server_args = ServerArgs.from_cli_args(parser.parse_args(sglang_argv))
    publish(server_args, role="tokenizer")
    backend = RecordingBackend(server_args, record)
    backend.record("server_args", **{k: v for k, v in fields_of(server_args).items() if k != "api_key"})
    http_server.set_global_state(
        http_server._GlobalState(tokenizer_manager=backend, template_manager=None, scheduler_info={})
    )
    if server_args.api_key:
        add_api_key_middleware(http_server.app, api_key=server_args.api_key, admin_api_key=None)
    config = uvicorn.Config(
        http_server.app, host=server_args.host, port=server_args.port, lifespan="off", log_level="warning"
    )
    asyncio.run(uvicorn.Server(config).serve())


if __name__ == "__main__":
    main()
