"""What a replica joining mid-run loads from the policy record in a real Redis: the run's signed
record naming a snapshot inside the run's weights or checkpoint directory, and nothing else."""

from rlmesh.config import load_config
from rlmesh.queue import RunKeys
from rlmesh.queue.policy import publish_policy
from rlmesh.queue.signing import signer_for
from rlmesh.rollout.replica import weights_roots, weights_to_join

TOKEN = "join-token-41"


async def test_a_joining_replica_loads_only_the_runs_signed_snapshot_inside_its_directories(
    redis, keys, tmp_path
):
    signed = RunKeys.signed(keys.run_id, TOKEN)
    roots = [str(tmp_path / "ckpt"), str(tmp_path / "weights")]
    inside = str(tmp_path / "weights" / "v5")

    await publish_policy(redis, signed, 5, inside)
    joined = await weights_to_join(redis, signed, roots, held_version=0)
    assert (joined.version, joined.disk_path) == (5, inside)
    assert await weights_to_join(redis, signed, roots, held_version=5) is None  # nothing newer

    for path in ("/etc", str(tmp_path / "weights" / ".." / "elsewhere"), str(tmp_path / "weights")):
        await publish_policy(redis, signed, 6, path)
        assert await weights_to_join(redis, signed, roots, held_version=0) is None
    await publish_policy(redis, keys, 7, inside)  # unsigned
    assert await weights_to_join(redis, signed, roots, held_version=0) is None
    await publish_policy(redis, RunKeys(keys.run_id, signer_for("guess", keys.run_id)), 7, inside)
    assert await weights_to_join(redis, signed, roots, held_version=0) is None
    # A run without a token checks the path all the same.
    await publish_policy(redis, keys, 8, "/etc")
    assert await weights_to_join(redis, keys, roots, held_version=0) is None
    await publish_policy(redis, keys, 8, inside)
    assert (await weights_to_join(redis, keys, roots, held_version=0)).version == 8


def test_the_roots_are_the_checkpoint_directory_and_the_disk_transports():
    cfg = load_config(None, ["trainer.default_local_dir=/runs/ckpt"])
    assert weights_roots(cfg) == ["/runs/ckpt"]
    cfg = load_config(None, ["trainer.default_local_dir=/runs/ckpt", "rlmesh.weight_sync.disk_dir=/shared/w"])
    assert weights_roots(cfg) == ["/runs/ckpt", "/shared/w"]
