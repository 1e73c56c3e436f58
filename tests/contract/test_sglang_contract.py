"""rlmesh against SGLang's own code (sglang 0.5.23, in a venv of its own: `make sglang-contract`).

A replica's launch flags are parsed by SGLang's ServerArgs parser and resolved; every request rlmesh
sends goes through SGLang's real HTTP app (routes, request dataclasses, the /generate contract
check, the API-key middleware), whose back end records what it was handed
(tests/support/programs/sglang_http_contract.py); rlmesh's client reads SGLang's own answers,
including the 400 for a model that cannot read a parameter back."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from transformers import Qwen2Config

from rlmesh.config.loader import load_config
from rlmesh.engine.client import FLATTENED_BUCKET_SINCE, EngineClient, EngineError, engine_device_of
from rlmesh.learner.weight_sync.cycle import update_cycle
from rlmesh.learner.weight_sync.links import EngineLink
from rlmesh.learner.weight_sync.verify import check_engines
from rlmesh.rollout.engines import sglang_launch_argv, weight_sync_ranks_of
from rlmesh.rollout.replica import sampling_defaults, sglang_extra_args
from rlmesh.rollout.sampler import sampling_dict
from rlmesh.runtime.net import free_port
from rlmesh.v1 import common_pb2
from tests.support.repo import REPO

pytestmark = pytest.mark.sglang_contract

PROBE = REPO / "tests" / "support" / "programs" / "sglang_http_contract.py"

KNOBS = [
    "actor_rollout_ref.rollout.name=sglang",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
    "actor_rollout_ref.rollout.enforce_eager=True",
    "actor_rollout_ref.rollout.max_model_len=192",
    "actor_rollout_ref.rollout.max_num_seqs=8",
    "actor_rollout_ref.rollout.max_num_batched_tokens=512",
    "actor_rollout_ref.rollout.enable_prefix_caching=False",
    "actor_rollout_ref.rollout.gpu_memory_utilization=0.6",
    "+actor_rollout_ref.model.override_config.rope_theta=20000.0",
    "+actor_rollout_ref.rollout.engine_kwargs.sglang.attention_backend=torch_native",
    "+actor_rollout_ref.rollout.engine_kwargs.sglang.enable_metrics=true",
    "actor_rollout_ref.rollout.sglang.extra_args=['--max-prefill-tokens','1024']",
]


@pytest.fixture(scope="module")
def sglang_python() -> str:
    python = os.environ.get("RLMESH_SGLANG_PYTHON")
    if not python:
        pytest.fail(
            "RLMESH_SGLANG_PYTHON is not set: `make sglang-contract` builds SGLang's venv and sets it"
        )
    return python


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory) -> Path:
    """A tiny Qwen2 config: SGLang resolves its server args against the model's config (no weights
    are read: the back end stands in for the model)."""
    path = tmp_path_factory.mktemp("qwen2")
    Qwen2Config(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=256,
        architectures=["Qwen2ForCausalLM"],
    ).save_pretrained(path)
    return path


class Served:
    def __init__(self, url: str, record: Path, proc: subprocess.Popen, log: Path) -> None:
        self.url, self.record_path, self.proc, self.log = url, record, proc, log

    def records(self) -> list[dict]:
        return [json.loads(line) for line in self.record_path.read_text().splitlines()]

    def calls(self, name: str) -> list[dict]:
        return [r["obj"] for r in self.records() if r["call"] == name]


@pytest.fixture
def serve(sglang_python, qwen2_dir, tmp_path):
    """Starts SGLang's HTTP app with the argv a replica of ``overrides`` launches SGLang with."""
    started: list[Served] = []

    def start(overrides: list[str], token: str = "") -> Served:
        cfg = load_config(overrides=[f"actor_rollout_ref.model.path={qwen2_dir}", *overrides], warn=False)
        rollout = cfg.actor_rollout_ref.rollout
        port = free_port("127.0.0.1")
        argv = sglang_launch_argv(  # as start_replica_engine has start_engine build it
            cfg.actor_rollout_ref.model.path,
            port,
            host="127.0.0.1",
            tp_size=rollout.tensor_model_parallel_size,
            mem_fraction_static=rollout.gpu_memory_utilization,
            dtype=rollout.dtype,
            skip_tokenizer_init=rollout.skip_tokenizer_init,
            extra_args=sglang_extra_args(cfg),
        )
        assert argv[1:3] == ["-m", "sglang.launch_server"]
        record, log = tmp_path / f"record-{port}.jsonl", tmp_path / f"sglang-{port}.log"
        env = {k: v for k, v in os.environ.items() if k != "RLMESH_AUTH_TOKEN"}
        if token:
            env["RLMESH_AUTH_TOKEN"] = token  # as rlmesh.rollout.sglang_server hands it over
        with log.open("w") as out:
            proc = subprocess.Popen(
                [sglang_python, str(PROBE), "--record", str(record), "--", *argv[3:]],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
            )
        served = Served(f"http://127.0.0.1:{port}", record, proc, log)
        started.append(served)

        async def healthy() -> None:
            client = EngineClient(served.url, timeout_s=30, token=token)
            try:
                deadline = asyncio.get_running_loop().time() + 240
                while not await client.healthy():
                    assert proc.poll() is None, f"SGLang's app exited:\n{log.read_text()[-3000:]}"
                    assert asyncio.get_running_loop().time() < deadline, log.read_text()[-3000:]
                    await asyncio.sleep(0.5)
            finally:
                await client.aclose()

        asyncio.run(healthy())
        return served

    yield start
    for served in started:
        served.proc.terminate()
        served.proc.wait(timeout=30)


def test_a_replicas_flags_parse_with_sglangs_parser_and_carry_verls_knobs(serve, qwen2_dir):
    served = serve(KNOBS)
    args = served.calls("server_args")[0]
    assert args["model_path"] == str(qwen2_dir) and args["tp_size"] == 2 and args["dtype"] == "bfloat16"
    assert args["skip_tokenizer_init"] is True and args["mem_fraction_static"] == 0.6
    assert args["disable_cuda_graph"] is True  # enforce_eager
    assert args["context_length"] == 192  # max_model_len
    assert args["max_running_requests"] == 8  # max_num_seqs
    assert args["chunked_prefill_size"] == 512  # max_num_batched_tokens
    assert args["disable_radix_cache"] is True  # enable_prefix_caching=False
    assert json.loads(args["json_model_override_args"]) == {"rope_theta": 20000.0}  # override_config
    assert args["attention_backend"] == "torch_native" and args["enable_metrics"] is True  # engine_kwargs
    assert args["max_prefill_tokens"] == 1024  # the user's own extra_args


def test_chunked_prefill_off_is_sglangs_minus_one(serve):
    served = serve(
        ["actor_rollout_ref.rollout.name=sglang", "actor_rollout_ref.rollout.enable_chunked_prefill=False"]
    )
    args = served.calls("server_args")[0]
    assert args["chunked_prefill_size"] == -1 and args["disable_cuda_graph"] is False


def test_every_request_rlmesh_sends_builds_sglangs_own_request_and_reads_its_answer(serve):
    token = "contract-token"
    served = serve(
        ["actor_rollout_ref.rollout.name=sglang", "actor_rollout_ref.rollout.tensor_model_parallel_size=1"],
        token=token,
    )
    cfg = load_config(overrides=["actor_rollout_ref.rollout.response_length=3"], warn=False)
    sampling = sampling_dict(common_pb2.SamplingParams(temperature=0.7), sampling_defaults(cfg))

    async def drive() -> dict:
        client = EngineClient(served.url, name="sglang", timeout_s=30, token=token)
        anonymous = EngineClient(served.url, name="anonymous", timeout_s=30, token="")
        seen: dict = {}
        try:
            info = await client.server_info()
            seen["ranks"], seen["device"] = weight_sync_ranks_of(info), engine_device_of("sglang", info)
            seen["version"] = await client.server_version()
            seen["flattened"] = await client.supports_flattened_bucket()
            await client.begin_weight_update()
            await client.init_weights_update_group("127.0.0.1", 29999, 1, 2, "g1", "gloo")
            await client.update_weights_from_distributed(
                ["model.norm.weight", "lm_head.weight"],
                ["float32", "bfloat16"],
                [[16], [64, 16]],
                "g1",
                None,
                load_format="flattened_bucket",
            )
            await client.update_weight_version("7")
            await client.pause_generation("retract")
            await client.flush_cache()
            await client.continue_generation()
            await client.update_weights_from_disk("/weights/v7", "7", flush_cache=False)
            await client.end_weight_update()
            await client.destroy_weights_update_group("g1")
            seen["generate"] = await client.generate([5, 6, 7], sampling, rid="task-1")
            await client.abort_request("task-1")
            link = EngineLink(client=client)
            failed: dict[str, str] = {}
            await check_engines([link], failed, {"model.norm.weight": torch.ones(4)})
            seen["check"] = (failed, link.verifiable)
            # The learner's cycle for in-flight updates: running requests kept in place, no flush.
            in_place: dict[str, str] = {}

            async def nothing() -> None:
                return None

            await update_cycle([link], in_place, 8, nothing, 10, "in_place")
            seen["in_place"] = in_place
            with pytest.raises(EngineError) as refused:
                await anonymous.init_weights_update_group("127.0.0.1", 29999, 1, 2, "g2", "gloo")
            seen["anonymous"] = refused.value.status
        finally:
            await client.aclose()
            await anonymous.aclose()
        return seen

    seen = asyncio.run(drive())
    assert seen["ranks"] == 1 and seen["device"] == "cpu"  # the contract app runs with --device cpu
    assert seen["version"] >= FLATTENED_BUCKET_SINCE and seen["flattened"] is True
    assert seen["check"] == ({}, False)  # SGLang's 400 for a model it cannot read back: not checked
    assert seen["anonymous"] == 401

    (init,) = served.calls("init_weights_update_group")
    assert (init["master_address"], init["master_port"], init["rank_offset"], init["world_size"]) == (
        "127.0.0.1",
        29999,
        1,
        2,
    )
    assert (init["group_name"], init["backend"]) == ("g1", "gloo")
    (update,) = served.calls("update_weights_from_distributed")
    assert update["names"] == ["model.norm.weight", "lm_head.weight"]
    assert update["dtypes"] == ["float32", "bfloat16"] and update["shapes"] == [[16], [64, 16]]
    assert update["group_name"] == "g1" and update["load_format"] == "flattened_bucket"
    assert update["flush_cache"] is False and update["weight_version"] is None
    version, in_place_version = served.calls("update_weight_version")
    assert version["new_version"] == "7" and version["abort_all_requests"] is False
    assert in_place_version["new_version"] == "8"
    assert [p["mode"] for p in served.calls("pause_generation")] == ["retract", "in_place"]
    assert seen["in_place"] == {}
    assert len(served.calls("continue_generation")) == 2 and len(served.calls("flush_cache")) == 1
    (disk,) = served.calls("update_weights_from_disk")
    assert (disk["model_path"], disk["weight_version"], disk["flush_cache"]) == ("/weights/v7", "7", False)
    assert len(served.calls("begin_weight_update")) == 2 and len(served.calls("end_weight_update")) == 2
    (destroy,) = served.calls("destroy_weights_update_group")
    assert destroy["group_name"] == "g1"
    (gen,) = served.calls("generate")
    assert gen["input_ids"] == [5, 6, 7] and gen["rid"] == "task-1"
    assert gen["return_logprob"] is True and gen["logprob_start_len"] == -1
    assert gen["sampling_params"] == sampling
    assert seen["generate"]["meta_info"]["completion_tokens"] == 3
    assert served.calls("abort_request") == [{"rid": "task-1", "abort_all": False}]
    (asked,) = served.calls("get_weights_by_name")
    assert asked["name"] == "model.norm.weight"
