"""Replicas that share a GPU pool (compose's --scale) each claim their own slot of tp GPUs, by UUID,
under a lease in a real Redis. The UUIDs stand for GPUs this machine does not have."""

import pytest

from rlmesh.rollout.engines import engine_env
from rlmesh.rollout.gpu_slots import NoFreeGpusError, claim_gpus, gpu_slots, parse_gpu_uuids

POOL = [f"GPU-{i}aaaaaaa-0000-0000-0000-00000000000{i}" for i in range(4)]


def test_nvidia_smi_lists_uuids_in_order():
    listing = (
        "GPU 0: NVIDIA H200 (UUID: GPU-8c1f0b2e-aaaa-bbbb-cccc-000000000000)\n"
        "GPU 1: NVIDIA H200 (UUID: GPU-11111111-aaaa-bbbb-cccc-000000000001)\n"
    )
    assert parse_gpu_uuids(listing) == [
        "GPU-8c1f0b2e-aaaa-bbbb-cccc-000000000000",
        "GPU-11111111-aaaa-bbbb-cccc-000000000001",
    ]
    assert gpu_slots(POOL[:3], 2) == [POOL[:2]]  # the odd GPU out stays unused


async def test_replicas_of_a_shared_pool_get_disjoint_slots_until_none_is_left(redis, keys):
    first = await claim_gpus(redis, keys, POOL, tp=2, lease_s=5)
    second = await claim_gpus(redis, keys, POOL, tp=2, lease_s=5)
    assert [first.gpus, second.gpus] == [POOL[:2], POOL[2:]]
    with pytest.raises(
        NoFreeGpusError, match=r"sees 4 GPU\(s\), 2 slot\(s\) of tensor_model_parallel_size=2"
    ):
        await claim_gpus(redis, keys, POOL, tp=2, lease_s=5)
    await first.release()  # a replica that stops frees its slot for the next
    third = await claim_gpus(redis, keys, POOL, tp=2, lease_s=5)
    assert third.gpus == POOL[:2]
    await second.release()
    await third.release()


async def test_a_dead_replicas_slot_frees_when_its_lease_runs_out(redis, keys):
    dead = await claim_gpus(redis, keys, POOL[:1], tp=1, lease_s=0.2)
    dead.keeper.cancel()  # killed: nothing renews its lease any more
    late = None
    while late is None:  # the lease lapses within 0.2 s; each try fails fast until then
        try:
            late = await claim_gpus(redis, keys, POOL[:1], tp=1, lease_s=5)
        except NoFreeGpusError:
            continue
    assert late.gpus == POOL[:1]
    await late.release()


def test_the_claimed_gpus_are_all_its_sglang_sees():
    assert engine_env("", POOL[2:]) == {"RLMESH_AUTH_TOKEN": "", "CUDA_VISIBLE_DEVICES": ",".join(POOL[2:])}
    assert engine_env(None) == {"RLMESH_AUTH_TOKEN": ""}
