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
    """One GPU: the trainer (this process) and the server share it, so the weight group is gloo
    (NCCL refuses two ranks on one device: "Duplicate GPU detected"). The model is bf16 with a head
    dim of 64: on Hopper SGLang's default attention backend is FA3, which runs neither fp32 nor a
    head dim of 16. Llama, not Qwen2: SGLang's Qwen2ForCausalLM has no get_weights_by_name (the
    verify step would get a 400)."""
    from transformers import AutoModelForCausalLM

    from rlmesh.learner.weight_sync.push import WeightPusher
    from rlmesh.models import build_tiny_model, build_tokenizer
    from rlmesh.rollout.engines import start_engine
    from rlmesh.runtime.launcher import ProcessLauncher

    tok = build_tokenizer()
    shape = {"arch": "llama", "hidden_size": 128, "num_layers": 2, "num_heads": 2, "num_kv_heads": 2}
    start = build_tiny_model(tmp_path / "a", tok, seed=1, dtype=torch.bfloat16, **shape)
    target = build_tiny_model(tmp_path / "b", tok, seed=2, dtype=torch.bfloat16, **shape)
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
                dtype="bfloat16",
                mem_fraction_static=0.3,
                extra_args=["--disable-cuda-graph"],
            )
            assert engine.weight_sync_ranks == 1
            client = engine.client
            assert (await client.server_version()) is not None
            sp = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
            first = await client.generate(prompts, sp)
            assert isinstance(first, list) and len(first) == 2
            for o in first:
                assert len(o["output_ids"]) == 6
                meta = o["meta_info"]
                assert meta["finish_reason"]["type"] == "length"
                assert [tid for _, tid, _ in meta["output_token_logprobs"]] == o["output_ids"]
            many = await client.generate(prompts[0], {**sp, "temperature": 1.0, "n": 3}, rid="task-1")
            assert isinstance(many, list) and len(many) == 3

            model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.bfloat16)
            pusher = WeightPusher([client], backend="gloo", timeout_s=120)
            await client.pause_generation()  # as a learner's push should: see docs/sglang.md
            report = await pusher.push(model.state_dict().items(), version=1)
            await client.flush_cache()
            await client.continue_generation()
            assert not report.failed, report.failed
            assert (await client.model_info())["weight_version"] == "1"
            mismatches = await pusher.verify(dict(list(model.state_dict().items())[:4]))
            assert all(m == [] for m in mismatches.values()), mismatches
            second = await client.generate(prompts, sp)
            assert all(o["meta_info"]["weight_version"] == "1" for o in second)
            await pusher.close()
            await client.aclose()

    asyncio.run(scenario())
