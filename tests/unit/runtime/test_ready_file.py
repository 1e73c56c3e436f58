"""The one ready-file writer every service uses."""

import json

from rlmesh.runtime.ready_file import write_ready_file


def test_the_ready_file_holds_the_info_as_json_and_replaces_an_older_one_whole(tmp_path):
    path = tmp_path / "reward-0.ready.json"
    path.write_text('{"pid": 1, "grpc_address": "stale"')  # a crashed predecessor's half file
    write_ready_file(path, {"pid": 42, "grpc_address": "127.0.0.1:5000"})
    assert json.loads(path.read_text()) == {"pid": 42, "grpc_address": "127.0.0.1:5000"}
    assert [p.name for p in tmp_path.iterdir()] == ["reward-0.ready.json"]  # no temporary left
    write_ready_file(str(path), {"pid": 43})
    assert json.loads(path.read_text()) == {"pid": 43}
