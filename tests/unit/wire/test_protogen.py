"""The committed stubs in libs/rlmesh/v1 must be exactly what `make protos` generates now."""

import filecmp

from rlmesh.wire import protogen


def test_committed_stubs_match_a_fresh_generation(tmp_path):
    protogen.generate(output_root=tmp_path)
    fresh_dir = tmp_path / protogen.PROTO_PACKAGE
    committed_dir = protogen.OUTPUT_ROOT / protogen.PROTO_PACKAGE

    def generated(d):
        return sorted(p.name for p in d.iterdir() if p.suffix in {".py", ".pyi"})

    assert generated(fresh_dir) == generated(committed_dir), "stubs added or removed: run `make protos`"
    _, mismatch, errors = filecmp.cmpfiles(committed_dir, fresh_dir, generated(fresh_dir), shallow=False)
    assert not mismatch and not errors, f"stale generated files {mismatch + errors}: run `make protos`"


def test_every_proto_defines_package_rlmesh_v1():
    for proto in protogen.proto_files():
        assert "package rlmesh.v1;" in proto.read_text(), proto
