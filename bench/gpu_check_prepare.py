"""Prepare a GPU session for bench/gpu_check.py: the wheels the GPU machine lacks, the size check, the one command.

    python bench/gpu_check_prepare.py            # download into .gpu_wheels/, check the size, print the command
    python bench/gpu_check_prepare.py --print    # only print the command (no download)

The GPU machines lent to this project (docs/benchmarks.md "GPU check") have Python 3.12 with torch, transformers,
safetensors, xxhash, prometheus-client, peft, numpy, rich, tokenizers, pyarrow, pandas, huggingface-hub and grpcio,
but no pyzmq, no pydantic, no datasets, no fastapi or uvicorn (an inference replica's HTTP API) and no network; their
grpcio and protobuf may be older than fleetrl's generated code needs (grpcio >= 1.85.1, protobuf >= 7.35.1). So the
wheels of WHEELS are downloaded here for that Python (manylinux x86_64, binary only, no dependencies: each one fleetrl
needs is named), pinned to the versions this machine's tests ran with, into .gpu_wheels/ (git-ignored). Everything
that travels (the working tree and the wheels) must stay under 64 MiB.

On the GPU machine the wheels install into /tmp/site (first on PYTHONPATH, so they win over older copies there) and
fleetrl installs editable from the copied tree with no download (`pip install --no-deps --no-index
--no-build-isolation -e .`): a bare PYTHONPATH would not do, since `fleetrl.services` is the top-level services/
folder mapped by setup.py and the services are found through the package's entry points.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WHEEL_DIR = ".gpu_wheels"
LIMIT_MIB = 64.0
PYTHON_VERSION = "3.12"  # the GPU machines' python3 (docs/benchmarks.md)
PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_26_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
)

# Distributions carried to the GPU machine: fleetrl's own requirements it lacks (or may have too old), and their
# requirements it lacks. Each is pinned to the version installed here.
WHEELS = (
    "pyzmq",
    "pydantic",
    "pydantic-core",
    "annotated-types",
    "typing-inspection",
    "typing-extensions",
    "grpcio",
    "grpcio-health-checking",
    "protobuf",
    "datasets",
    "dill",
    "multiprocess",
    # the `http` extra: every inference replica serves its OpenAI-compatible API (services/inference/http_server.py)
    "fastapi",
    "starlette",
    "uvicorn",
    "annotated-doc",
)
# fleetrl's requirements the GPU machine has (its package list, docs/benchmarks.md) and that are not carried.
DEVICE_HAS = (
    "torch",
    "transformers",
    "tokenizers",
    "xxhash",
    "prometheus-client",
    "numpy",
    "safetensors",
    "rich",
    "peft",
)


def pinned() -> list[str]:
    """NAME==VERSION of every wheel to carry, at the versions installed here."""
    out = []
    for name in WHEELS:
        try:
            out.append(f"{name}=={importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            raise SystemExit(f"{name} is not installed here: install fleetrl first (bash scripts/install.sh)") from None
    return out


def download(folder: Path, python_version: str) -> None:
    """The wheels of WHEELS for `python_version` into `folder`, and nothing else there: a wheel left from another run
    (another version, or another Python's build) would stop the install on the GPU machine."""
    folder.mkdir(exist_ok=True)
    for old in folder.glob("*.whl"):
        old.unlink()
    argv = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:"]
    argv += ["--python-version", python_version, "--implementation", "cp"]
    argv += [a for p in PLATFORMS for a in ("--platform", p)]
    argv += ["-d", str(folder), *pinned()]
    subprocess.run(argv, check=True, timeout=600)


def travelling_bytes() -> int:
    """Bytes of the working tree that a device call sends: tracked files and untracked ones git does not ignore."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    total = 0
    for name in filter(None, listed):
        path = REPO / name.decode()
        if path.is_file() and not path.is_symlink():
            total += path.stat().st_size
    return total


def device_command(budget_s: int = 480) -> str:
    """The one shell command for the device tool's `run` (with carry = [".gpu_wheels"], timeout_s = 600)."""
    return (
        "set -o pipefail; "
        f"python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "
        f"{WHEEL_DIR}/*.whl && export PYTHONPATH=/tmp/site && "
        "python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 3; "
        f"PYTHONUNBUFFERED=1 python3 bench/gpu_check.py --out $OUT --budget-s {budget_s} 2>&1 | tee $OUT/gpu_check.log"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--print", action="store_true", help="only print the command")
    parser.add_argument("--python-version", default=PYTHON_VERSION, help="the GPU machine's Python (default 3.12)")
    args = parser.parse_args(argv)
    if not args.print:
        folder = REPO / WHEEL_DIR
        download(folder, args.python_version)
        wheels = sorted(folder.glob("*.whl"))
        wheel_bytes = sum(w.stat().st_size for w in wheels)
        tree = travelling_bytes()
        total_mib = (wheel_bytes + tree) / (1 << 20)
        for wheel in wheels:
            print(f"  {wheel.stat().st_size / (1 << 20):6.2f} MiB  {wheel.name}")
        print(
            f"wheels {wheel_bytes / (1 << 20):.1f} MiB + working tree {tree / (1 << 20):.1f} MiB = {total_mib:.1f} MiB "
            f"(limit {LIMIT_MIB:.0f} MiB)"
        )
        if total_mib >= LIMIT_MIB:
            print("too much would travel: ignore or remove large untracked files first", file=sys.stderr)
            return 1
    print(f'\ndevice run: carry = ["{WHEEL_DIR}"], timeout_s = 600, command:\n')
    print(device_command())
    return 0


if __name__ == "__main__":
    sys.exit(main())
