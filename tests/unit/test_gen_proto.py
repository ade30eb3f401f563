"""The committed generated gRPC code (fleetrl/v1/) is what scripts/gen_proto.py makes of proto/ now."""

from __future__ import annotations

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _gen_proto_module():
    spec = importlib.util.spec_from_file_location("gen_proto", REPO / "scripts" / "gen_proto.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_code_is_current(tmp_path: Path) -> None:
    generated = _gen_proto_module().generate(tmp_path)
    assert generated, "nothing generated"
    for path in generated:
        committed = REPO / path.relative_to(tmp_path)
        assert committed.exists(), f"{committed} is missing: run python scripts/gen_proto.py"
        assert committed.read_bytes() == path.read_bytes(), f"{committed} is stale: run python scripts/gen_proto.py"


def test_generated_modules_import_from_the_package() -> None:
    from fleetrl.v1 import inference_pb2, inference_pb2_grpc

    assert inference_pb2.DESCRIPTOR.package == "fleetrl.v1"
    assert hasattr(inference_pb2_grpc, "InferenceStub")
