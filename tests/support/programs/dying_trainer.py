"""A trainer that dies half-way through a weight push (tests/integration/engine/test_weight_sync.py):
it links to the engine, starts a push, and exits with code 3 once the engine is receiving straight
into its parameters, before sending anything.

Run as ``python -m tests.support.programs.dying_trainer ENGINE_URL MODEL_DIR``."""

from __future__ import annotations

import asyncio
import os
import sys

import httpx
import torch
from transformers import AutoModelForCausalLM

from rlmesh.engine.client import EngineClient
from rlmesh.learner.weight_sync.push import WeightPusher

EXIT_CODE = 3


async def push_and_die(url: str, model_dir: str) -> None:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    named = list(model.named_parameters())
    client = EngineClient(url, timeout_s=60)
    pusher = WeightPusher([client], backend="gloo", timeout_s=60)
    await pusher.connect()
    link = pusher.links[0]
    call = asyncio.create_task(  # noqa: F841, RUF006 - the process dies while it runs
        client.update_weights_from_distributed(
            [n for n, _ in named],
            ["float32"] * len(named),
            [list(p.shape) for _, p in named],
            link.group_name,
            weight_version="9",
            load_format="flattened_bucket",
        )
    )
    # The engine is now inside its receive, straight into its parameters: die before sending.
    while not httpx.get(url + "/get_server_info").json()["weights_receiving_direct"]:
        await asyncio.sleep(0.01)
    os._exit(EXIT_CODE)


if __name__ == "__main__":
    asyncio.run(push_and_die(sys.argv[1], sys.argv[2]))
