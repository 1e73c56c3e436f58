"""``rlmesh.rollout.sglang_server`` hands SGLang ``--api-key`` from the environment inside the
process: SGLang's parser sees it, ``ps`` (the kernel's command line) does not. A stand-in module
takes SGLang's place (sglang needs a GPU)."""

import json
import subprocess
import sys

from tests.support.processes import child_env
from tests.support.repo import REPO

STAND_IN = "tests.support.programs.sglang_stand_in"
RUN = "import sys; from rlmesh.rollout.sglang_server import run_with_api_key; run_with_api_key(sys.argv[1], sys.argv[2:])"


def launch(tmp_path, **env: str) -> dict:
    out = tmp_path / "seen.json"
    subprocess.run(
        [sys.executable, "-c", RUN, STAND_IN, "--port", "30001", "--out", str(out)],
        cwd=REPO,
        env=child_env(**env),
        check=True,
        timeout=60,
    )
    return json.loads(out.read_text())


def test_the_token_reaches_sglangs_arguments_but_not_the_command_line(tmp_path):
    seen = launch(tmp_path, RLMESH_AUTH_TOKEN="sglang-key-77")
    assert seen["argv"] == [
        "--port",
        "30001",
        "--out",
        str(tmp_path / "seen.json"),
        "--api-key",
        "sglang-key-77",
    ]
    assert "--port" in seen["cmdline"]
    assert not any("sglang-key-77" in a for a in seen["cmdline"])
    assert seen["env_token"] is None  # SGLang's own children don't inherit it


def test_without_a_token_no_api_key_is_added(tmp_path):
    seen = launch(tmp_path, RLMESH_AUTH_TOKEN="")
    assert "--api-key" not in seen["argv"]
