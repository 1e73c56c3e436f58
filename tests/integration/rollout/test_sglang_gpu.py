"""SGLang on a GPU: the same client and weight push as the embedded engine. These run only where
a CUDA GPU and sglang are present; elsewhere they skip and say why."""

import asyncio
import importlib.util
import sys

import pytest
import torch

from rlmesh.rollout.engines import sglang_launch_argv

HAVE_GPU = torch.cuda.is_available()
HAVE_SGLANG = importlib.util.find_spec("sglang") is not None
needs_sglang_gpu = pytest.mark.skipif(
    not (HAVE_GPU and HAVE_SGLANG),
    reason=f"needs a CUDA GPU and sglang (gpu extra): cuda={HAVE_GPU}, sglang={HAVE_SGLANG}",
)


def test_launch_command_is_one_token_id_server_per_replica():
    argv = sglang_launch_argv(
        "/models/q", 30001, tp_size=2, mem_fraction_static=0.6, seed=7, extra_args=["--disable-radix-cache"]
    )
    assert argv[:3] == [sys.executable, "-m", "sglang.launch_server"]
    pairs = dict(zip(argv[3::2], argv[4::2], strict=False))
    assert pairs["--model-path"] == "/models/q" and pairs["--port"] == "30001" and pairs["--tp-size"] == "2"
    assert pairs["--mem-fraction-static"] == "0.6" and pairs["--random-seed"] == "7"
    assert "--skip-tokenizer-init" in argv and argv[-1] == "--disable-radix-cache"


@pytest.mark.gpu
@needs_sglang_gpu
def test_sglang_generate_and_weight_push(tmp_path):
    from transformers import AutoModelForCausalLM

    from rlmesh.models import build_tiny_model, build_tokenizer
    from rlmesh.rollout.engines import start_engine
    from rlmesh.runtime.launcher import ProcessLauncher
    from rlmesh.weights.push import WeightPusher

    tok = build_tokenizer()
    start = build_tiny_model(tmp_path / "a", tok, hidden_size=64, num_layers=2, seed=1)
    target = build_tiny_model(tmp_path / "b", tok, hidden_size=64, num_layers=2, seed=2)
    prompts = [[10, 20, 30], [5, 6, 7, 8]]

    async def scenario():
        with ProcessLauncher(tmp_path / "procs") as launcher:
            engine = await start_engine(
                kind="sglang",
                model_path=str(start),
                launcher=launcher,
                name="gpu",
                attach_urls=[],
                max_batch_size=8,
                startup_timeout_s=600,
                request_timeout_s=300,
                dtype="float32",
            )
            sp = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
            first = await engine.client.generate(prompts, sp)
            assert all(len(o["output_ids"]) == 6 for o in first)
            model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
            pusher = WeightPusher([engine.client], backend="nccl", timeout_s=120)
            report = await pusher.push(((n, t.cuda()) for n, t in model.state_dict().items()), version=1)
            assert not report.failed
            mismatches = await pusher.verify(dict(list(model.state_dict().items())[:4]))
            assert all(m == [] for m in mismatches.values())
            await pusher.close()
            await engine.client.aclose()

    asyncio.run(scenario())
