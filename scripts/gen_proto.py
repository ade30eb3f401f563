"""Generate the Python gRPC code for every proto under proto/ into the repository root.

    python scripts/gen_proto.py            # writes fleetrl/v1/*_pb2.py, *_pb2_grpc.py, *_pb2.pyi
    python scripts/gen_proto.py --out DIR  # same into DIR (the currency test compares against it)

proto/fleetrl/v1/x.proto becomes fleetrl/v1/x_pb2*.py, importable as `from fleetrl.v1 import x_pb2`.
Generated code is committed; rerun this after editing a proto.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO / "proto"
INIT_TEXT = '"""Generated gRPC/protobuf code for the fleetrl.v1 protos (scripts/gen_proto.py)."""\n'


def generate(out_dir: Path) -> list[Path]:
    """Run protoc for every .proto under proto/; return the generated files."""
    from grpc_tools import protoc  # from grpcio-tools, a test/dev dependency

    out_dir.mkdir(parents=True, exist_ok=True)
    protos = sorted(PROTO_ROOT.rglob("*.proto"))
    if not protos:
        raise SystemExit(f"no .proto files under {PROTO_ROOT}")
    include = str(Path(protoc.__file__).parent / "_proto")  # google/protobuf/*.proto
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        f"--pyi_out={out_dir}",
        *[str(p.relative_to(PROTO_ROOT)) for p in protos],
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed (see the messages above)")
    packages = {(out_dir / p.relative_to(PROTO_ROOT)).parent for p in protos}
    for package in packages:
        init = package / "__init__.py"
        if not init.exists():
            init.write_text(INIT_TEXT)
    return sorted(f for pkg in packages for f in pkg.iterdir() if f.is_file())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO, help="output root (default: the repo)")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
