"""Regenerates the Python code and stubs for protos/kvserve/v1/*.proto (`make protos`)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "protos" / "kvserve" / "v1"


def proto_files() -> list[Path]:
    return sorted(PROTO_DIR.glob("*.proto"))


def generate(out_dir: Path = ROOT) -> list[Path]:
    """Writes *_pb2.py, *_pb2.pyi and *_pb2_grpc.py under out_dir/protos/kvserve/v1."""
    from grpc_tools import protoc  # dev dependency: only needed to regenerate

    args = [
        "grpc_tools.protoc",
        f"-I{ROOT}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *(str(p.relative_to(ROOT)) for p in proto_files()),
    ]
    (out_dir / "protos" / "kvserve" / "v1").mkdir(parents=True, exist_ok=True)
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed: " + " ".join(args))
    return sorted((out_dir / "protos" / "kvserve" / "v1").glob("*_pb2*.py*"))


if __name__ == "__main__":
    for path in generate():
        print(path.relative_to(ROOT))
    sys.exit(0)
