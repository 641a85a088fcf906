"""The committed generated protobuf code is what proto/generate.py produces."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_generated_code_is_up_to_date(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("generate", ROOT / "proto" / "generate.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    sources = mod.generate(tmp_path)
    assert len(sources) == 3
    committed = ROOT / "proto" / "geofed" / "v1"
    fresh = sorted((tmp_path / "geofed" / "v1").glob("*_pb2*"))
    assert [f.name for f in fresh] == sorted(f.name for f in committed.glob("*_pb2*"))
    for f in fresh:
        assert f.read_text() == (committed / f.name).read_text(), (
            f"{f.name} is stale: run make proto"
        )


def test_generated_modules_import_from_the_installed_package() -> None:
    from geofed.v1 import client_pb2, client_pb2_grpc, federation_pb2, federation_pb2_grpc

    assert client_pb2.DESCRIPTOR.package == "geofed.v1"
    assert hasattr(client_pb2_grpc, "ClientServiceStub")
    assert hasattr(federation_pb2_grpc, "FederationServiceStub")
    assert federation_pb2.Frame().seq == 0
