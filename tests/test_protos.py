"""The generated protobuf code must match the .proto files (run `make protos` after editing one)."""

from __future__ import annotations

from pathlib import Path

from protos.build import ROOT, generate


def test_generated_code_is_fresh(tmp_path: Path) -> None:
    fresh = {p.name: p.read_bytes() for p in generate(tmp_path)}
    committed = {p.name: p.read_bytes() for p in (ROOT / "protos" / "kvserve" / "v1").glob("*_pb2*.py*")}
    assert fresh.keys() == committed.keys(), "generated files differ: run `make protos`"
    stale = sorted(name for name in fresh if fresh[name] != committed[name])
    assert not stale, f"stale generated code {stale}: run `make protos`"


def test_services_are_in_package_kvserve_v1() -> None:
    from protos.kvserve.v1 import decode_pb2, kvstore_pb2, prefill_pb2

    names = {
        kvstore_pb2.DESCRIPTOR.services_by_name["KVStore"].full_name,
        prefill_pb2.DESCRIPTOR.services_by_name["Prefill"].full_name,
        decode_pb2.DESCRIPTOR.services_by_name["Decode"].full_name,
    }
    assert names == {"kvserve.v1.KVStore", "kvserve.v1.Prefill", "kvserve.v1.Decode"}
