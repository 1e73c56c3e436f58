"""A gRPC service (reward, as a real process) publishes the address it advertises beside the one it
binds; beyond loopback without rlmesh.auth_token it refuses to start unless allowed on purpose."""

import pytest

from rlmesh.runtime.launcher import LaunchError, ProcessLauncher
from rlmesh.runtime.net import ENV_ADVERTISE_HOST


def test_the_ready_file_carries_the_advertised_address_and_an_open_bind_is_refused(tmp_path):
    with ProcessLauncher(tmp_path, stop_grace_s=10) as launcher:
        common = ["rlmesh.run_id=advertise", "rlmesh.reward.metrics_port=0", "rlmesh.log_format=text"]
        from_env = launcher.start_service(
            "reward",
            name="reward-env",
            overrides=[*common, "rlmesh.reward.port=0"],
            env={ENV_ADVERTISE_HOST: "reward-7.internal"},
        )
        port = from_env.grpc_address.rsplit(":", 1)[1]
        assert from_env.grpc_address == f"127.0.0.1:{port}"  # a launcher dials what it bound
        assert from_env.process.info["advertise_address"] == f"reward-7.internal:{port}"

        configured = launcher.start_service(
            "reward",
            name="reward-open",
            overrides=[
                *common,
                "rlmesh.reward.port=0",
                "rlmesh.reward.host=0.0.0.0",
                "rlmesh.security.allow_open_bind=true",
                "rlmesh.reward.advertise_address=127.0.0.2",  # a host alone: the bound port
            ],
            env={ENV_ADVERTISE_HOST: "ignored.internal"},  # the config key wins
        )
        port = configured.grpc_address.rsplit(":", 1)[1]
        assert configured.process.info["advertise_address"] == configured.grpc_address == f"127.0.0.2:{port}"
        log = configured.process.log_path.read_text()
        assert "binds 0.0.0.0 without rlmesh.auth_token (rlmesh.security.allow_open_bind=true)" in log
        assert "without rlmesh.auth_token" not in from_env.process.log_path.read_text()

        with pytest.raises(LaunchError, match=r"binds 0\.0\.0\.0, reachable from other hosts, and no rlmesh"):
            launcher.start_service(
                "reward",
                name="reward-refused",
                overrides=[*common, "rlmesh.reward.port=0", "rlmesh.reward.host=0.0.0.0"],
            )
