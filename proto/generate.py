"""Regenerate the Python code for the geofed protobuf/gRPC API.

Run from anywhere: ``python proto/generate.py``. Needs grpcio-tools (test extra).
Generated modules live next to their ``.proto`` sources in ``proto/geofed/v1``
and are installed as the ``geofed.v1`` package.
"""

from __future__ import annotations

import sys
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent


def generate(out_dir: Path = PROTO_ROOT) -> list[Path]:
    """Compile every ``geofed/v1/*.proto`` into ``out_dir``; return the sources compiled."""
    from grpc_tools import protoc  # imported here: only this script needs grpcio-tools

    sources = sorted((PROTO_ROOT / "geofed" / "v1").glob("*.proto"))
    include = Path(protoc.__file__).parent / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *(str(s.relative_to(PROTO_ROOT)) for s in sources),
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    return sources


if __name__ == "__main__":
    generate()
    sys.exit(0)
