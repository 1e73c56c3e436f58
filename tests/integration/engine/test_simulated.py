"""A simulated engine as a real `rlmesh engine` process: SGLang's /generate with token ids and
log-probs, pause, abort and continue, a weight push over gloo whose bytes land in its buffers, and a
bad spec refused at start with one line."""

import asyncio
import math
import subprocess
import sys

import httpx
import pytest
import torch

from rlmesh.engine.client import EngineClient
from rlmesh.engine.simulated import SimulatedModel, SimulationSpec, write_simulated_model
from rlmesh.learner.weight_sync.push import WeightPusher
from tests.support.processes import child_env

SPEC = SimulationSpec(
    vocab_size=64,
    eos_token_id=2,
    tokens_per_s=2000.0,
    length_median=12,
    length_sigma=0.5,
    length_max=40,
    weight_bytes=3 << 20,
    tensor_bytes=1 << 20,
    weight_dtype="float32",
)


def test_a_simulated_engine_serves_generate_pause_abort_and_takes_a_weight_push(launcher, tmp_path):
    engine = launcher.start_engine(write_simulated_model(tmp_path / "sim", SPEC), name="simulated")
    body = {
        "input_ids": [[5, 6, 7], [8, 9]],
        "sampling_params": {"max_new_tokens": 100, "n": 3},
        "return_logprob": True,
    }
    outs = httpx.post(engine.url + "/generate", json=body, timeout=60).json()
    assert len(outs) == 6
    for out in outs:
        ids, meta = out["output_ids"], out["meta_info"]
        assert 1 <= len(ids) <= 40 and ids[-1] == 2 and 2 not in ids[:-1]
        assert meta["finish_reason"]["type"] == "stop"
        logprobs = [lp for lp, _, _ in meta["output_token_logprobs"]]
        assert logprobs[:-1] == pytest.approx([-math.log(63)] * (len(ids) - 1)) and logprobs[-1] == 0.0

    target = {n: torch.randn(p.shape) for n, p in SimulatedModel(SPEC).named_parameters()}

    async def drive():
        client = EngineClient(engine.url, timeout_s=60)
        pusher = WeightPusher([client], backend="gloo", timeout_s=60, bucket_bytes=1 << 20)
        try:
            await client.pause_generation()
            held = asyncio.create_task(
                client.generate([1, 2, 3], {"max_new_tokens": 30, "ignore_eos": True}, rid="held")
            )

            async def queued() -> None:
                while (await client.server_info()).get("waiting", 0) == 0:
                    await asyncio.sleep(0.01)

            await asyncio.wait_for(queued(), timeout=60)  # held by the pause, not running
            assert not held.done()
            await client.abort_request("held")
            aborted = await held
            await client.continue_generation()
            report = await pusher.push(target.items(), version=5)
            mismatches = await pusher.verify(target)
            info = await client.model_info()
            return aborted, report, mismatches, info
        finally:
            await pusher.close()
            await client.aclose()

    aborted, report, mismatches, info = asyncio.run(drive())
    assert aborted["meta_info"]["finish_reason"]["type"] == "abort"
    assert not report.failed and report.bytes_per_engine == 3 << 20
    assert list(mismatches.values()) == [[]] and info["weight_version"] == "5"
    after = httpx.post(engine.url + "/generate", json={"input_ids": [4], "sampling_params": {}}, timeout=60)
    assert after.status_code == 200 and after.json()["meta_info"]["weight_version"] == "5"


def test_a_bad_override_stops_the_engine_with_one_line_naming_it(tmp_path):
    model = write_simulated_model(tmp_path / "sim", SPEC)
    argv = [sys.executable, "-m", "rlmesh.cli", "engine", "--model-path", str(model), "--port", "0"]
    for override, named in (
        ('{"bad": 1}', "unknown simulated-engine keys ['bad']"),
        ('{"tokens_per_s": "x"}', "tokens_per_s float (got str 'x')"),
    ):
        done = subprocess.run(
            [*argv, "--json-model-override-args", override],
            env=child_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 2, done.stderr
        assert done.stderr.startswith("rlmesh engine: --json-model-override-args") and named in done.stderr
        assert "Traceback" not in done.stderr
