"""The SGLang launch command and how many ranks an SGLang server brings to a weight-update group.
Flags checked against the ServerArgs of sglang 0.4.10, 0.5.5 and 0.5.23 (0.5.23 derives them from
the fields in srt/arg_groups/fields/*.py); ranks against 0.5.23's weight updater, where every TP
worker joins as ``rank_offset + tp_rank``."""

from __future__ import annotations

import sys
from typing import ClassVar

import pytest

from rlmesh.rollout import engines
from rlmesh.rollout.engines import sglang_launch_argv, sglang_rollout_args, start_engine, weight_sync_ranks_of


def test_launch_argv_exactly():
    argv = sglang_launch_argv(
        "/models/q",
        30001,
        tp_size=2,
        mem_fraction_static=0.6,
        seed=7,
        dtype="float16",
        extra_args=["--x", "1"],
    )
    assert argv == [
        sys.executable,
        "-m",
        "sglang.launch_server",
        "--model-path",
        "/models/q",
        "--host",
        "127.0.0.1",
        "--port",
        "30001",
        "--tp-size",
        "2",
        "--mem-fraction-static",
        "0.6",
        "--random-seed",
        "7",
        "--dtype",
        "float16",
        "--skip-tokenizer-init",
        "--x",
        "1",
    ]


def test_launch_argv_with_sglangs_tokenizer():
    # Needed for `stop` strings and min_new_tokens > 0, which SGLang refuses without a tokenizer.
    assert "--skip-tokenizer-init" not in sglang_launch_argv("/m", 1, skip_tokenizer_init=False)
    with pytest.raises(ValueError):
        sglang_launch_argv("/m", 1, tp_size=0)


def test_weight_sync_ranks_from_server_info():
    assert weight_sync_ranks_of({"tp_size": 4, "dp_size": 1, "pp_size": 1, "version": "0.5.23"}) == 4
    assert weight_sync_ranks_of({"engine": "embedded"}) == 1
    with pytest.raises(ValueError, match="dp_size=2"):
        weight_sync_ranks_of({"tp_size": 1, "dp_size": 2})
    with pytest.raises(ValueError, match="pp_size=2"):
        weight_sync_ranks_of({"tp_size": 2, "pp_size": 2})


class FakeClient:
    info: ClassVar[dict] = {}

    def __init__(self, url: str, *, token: str | None = None, **_: object) -> None:
        self.url = url
        self.token = token

    async def wait_healthy(self, timeout_s: float) -> None:
        pass

    async def healthy(self) -> bool:
        return True

    async def server_info(self) -> dict:
        return self.info


class FakeProcess:
    def alive(self) -> bool:
        return True


class FakeLauncher:
    def __init__(self) -> None:
        self.argv: list[str] | None = None
        self.env: dict[str, str] | None = None

    def spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> FakeProcess:
        self.argv, self.env = argv, env
        return FakeProcess()


def start(launcher: FakeLauncher, **kw: object):
    return start_engine(
        kind="sglang",
        model_path="/m",
        launcher=launcher,  # type: ignore[arg-type]
        name="r0",
        max_batch_size=8,
        startup_timeout_s=5,
        request_timeout_s=5,
        **kw,  # type: ignore[arg-type]
    )


async def test_launched_server_brings_its_tp_size(monkeypatch):
    monkeypatch.setattr(engines, "EngineClient", FakeClient)
    launcher = FakeLauncher()
    engine = await start(launcher, attach_urls=[], tp_size=2)
    assert engine.weight_sync_ranks == 2 and launcher.argv is not None
    # extra_args set last win in SGLang's argparse, and here.
    engine = await start(launcher, attach_urls=[], tp_size=2, extra_args=["--tensor-parallel-size", "4"])
    assert engine.weight_sync_ranks == 4


async def test_launch_with_data_parallel_is_refused_before_spawning(monkeypatch):
    monkeypatch.setattr(engines, "EngineClient", FakeClient)
    launcher = FakeLauncher()
    with pytest.raises(ValueError, match="dp_size=2"):
        await start(launcher, attach_urls=[], extra_args=["--dp-size=2"])
    assert launcher.argv is None


async def test_attached_server_reports_its_tp_size(monkeypatch):
    class Attached(FakeClient):
        info: ClassVar[dict] = {"tp_size": 8, "dp_size": 1, "pp_size": 1, "version": "0.5.23"}

    monkeypatch.setattr(engines, "EngineClient", Attached)
    engine = await start(FakeLauncher(), attach_urls=["http://10.0.0.2:30000"])
    assert (engine.url, engine.weight_sync_ranks, engine.process) == ("http://10.0.0.2:30000", 8, None)


async def test_a_launched_server_gets_the_token_in_its_environment_not_its_argv(monkeypatch):
    # SGLang takes its key from --api-key only: rlmesh.rollout.sglang_server adds it in-process.
    monkeypatch.setattr(engines, "EngineClient", FakeClient)
    launcher = FakeLauncher()
    engine = await start(launcher, attach_urls=[], token="tok-123")
    assert launcher.argv is not None and launcher.argv[1:3] == ["-m", "rlmesh.rollout.sglang_server"]
    assert not any("tok-123" in a for a in launcher.argv) and "--api-key" not in launcher.argv
    assert launcher.env == {"RLMESH_AUTH_TOKEN": "tok-123"}
    assert engine.client.token == "tok-123"


async def test_without_a_token_sglang_is_launched_as_it_is(monkeypatch):
    monkeypatch.setattr(engines, "EngineClient", FakeClient)
    monkeypatch.delenv("RLMESH_AUTH_TOKEN", raising=False)
    launcher = FakeLauncher()
    engine = await start(launcher, attach_urls=[])
    assert launcher.argv is not None and launcher.argv[1:3] == ["-m", "sglang.launch_server"]
    assert launcher.env == {"RLMESH_AUTH_TOKEN": ""} and engine.client.token == ""


async def test_no_token_given_is_no_token_even_where_the_environment_has_one(monkeypatch):
    monkeypatch.setattr(engines, "EngineClient", FakeClient)
    monkeypatch.setenv("RLMESH_AUTH_TOKEN", "from-env")
    launcher = FakeLauncher()
    engine = await start(launcher, attach_urls=[], token="")
    assert launcher.argv is not None and launcher.argv[1:3] == ["-m", "sglang.launch_server"]
    assert launcher.env == {"RLMESH_AUTH_TOKEN": ""} and engine.client.token == ""


async def test_the_token_defaults_to_the_environment_and_reaches_an_attached_server(monkeypatch):
    monkeypatch.setattr(engines, "EngineClient", FakeClient)
    monkeypatch.setenv("RLMESH_AUTH_TOKEN", "from-env")
    engine = await start(FakeLauncher(), attach_urls=["http://10.0.0.2:30000"])
    assert engine.client.token == "from-env"


def test_verls_rollout_knobs_become_sglang_flags() -> None:
    """The flags are ServerArgs fields of SGLang 0.5.6 and 0.5.23 (--disable-cuda-graph: 0.5.23's
    deprecated spelling of its per-phase switches, still accepted). This argv was parsed by
    sglang 0.5.23's own ServerArgs.add_cli_args in a venv of its own (2026-12-02); the check is not
    automated here: issue 30."""
    assert sglang_rollout_args() == []
    args = sglang_rollout_args(
        enforce_eager=True,
        max_model_len=32768,
        max_num_seqs=256,
        max_num_batched_tokens=8192,
        enable_prefix_caching=False,
        override_config={"max_position_embeddings": 32768},
        engine_kwargs={
            "attention_backend": "fa3",
            "enable_metrics": True,
            "log_level": None,
            "cuda_graph_bs_decode": [1, 2],
        },
    )
    assert args == [
        "--disable-cuda-graph",
        "--context-length",
        "32768",
        "--max-running-requests",
        "256",
        "--chunked-prefill-size",
        "8192",
        "--disable-radix-cache",
        "--json-model-override-args",
        '{"max_position_embeddings": 32768}',
        "--attention-backend",
        "fa3",
        "--enable-metrics",
        "--cuda-graph-bs-decode",
        "1",
        "2",
    ]
    assert sglang_rollout_args(enable_chunked_prefill=False, max_num_batched_tokens=8192) == [
        "--chunked-prefill-size",
        "-1",
    ]
