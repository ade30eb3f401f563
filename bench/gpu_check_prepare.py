"""Prepare a GPU session for bench/gpu_check.py: the wheels the GPU machine lacks, the size check, the one command.

    python bench/gpu_check_prepare.py            # download into .gpu_wheels/, check the size, print the command
    python bench/gpu_check_prepare.py --print    # only print the command (no download)
    python bench/gpu_check_prepare.py --scale    # the same for bench/scale_check.py (issue 41): Liger carried too

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
# What bench/scale_check.py needs beyond that (--scale): Liger's kernels for item 1 (pure Python; Triton is there),
# pinned to the project's `liger` extra (not installed on this CPU machine).
SCALE_WHEELS = ("liger-kernel",)
SCALE_SCRIPT = "scale_check"
SCALE_BUDGET_S = 450  # of the script's 480 s at most: the install before it and the machine's start-up need the rest
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


def pinned(scale: bool = False) -> list[str]:
    """NAME==VERSION of every wheel to carry, at the versions installed here (with `scale`, SCALE_WHEELS too, at the
    versions pyproject.toml's extras pin)."""
    out = []
    for name in WHEELS:
        try:
            out.append(f"{name}=={importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            raise SystemExit(f"{name} is not installed here: install fleetrl first (bash scripts/install.sh)") from None
    if scale:
        out += [extra_pin(name) for name in SCALE_WHEELS]
    return out


def extra_pin(name: str) -> str:
    """`name`'s NAME==VERSION in pyproject.toml's optional dependencies; SystemExit when no extra pins it."""
    import tomllib

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for requirement in (r for group in extras.values() for r in group):
        if requirement.split("==")[0].strip().lower() == name and "==" in requirement:
            return requirement.split(";")[0].strip()
    raise SystemExit(f"no extra in pyproject.toml pins {name} (NAME==VERSION)")


def download(folder: Path, python_version: str, scale: bool = False) -> None:
    """The wheels of WHEELS for `python_version` into `folder`, and nothing else there: a wheel left from another run
    (another version, or another Python's build) would stop the install on the GPU machine."""
    folder.mkdir(exist_ok=True)
    for old in folder.glob("*.whl"):
        old.unlink()
    argv = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:"]
    argv += ["--python-version", python_version, "--implementation", "cp"]
    argv += [a for p in PLATFORMS for a in ("--platform", p)]
    argv += ["-d", str(folder), *pinned(scale)]
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


def device_command(budget_s: int = 480, script: str = "gpu_check", flags: str = "") -> str:
    """The one shell command for the device tool's `run` (with carry = [".gpu_wheels"], timeout_s = 600): install the
    wheels and fleetrl, then run bench/`script`.py with `flags` and the budget, its output also in $OUT."""
    return (
        "set -o pipefail; "
        f"python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "
        f"{WHEEL_DIR}/*.whl && export PYTHONPATH=/tmp/site && "
        "python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 3; "
        f"PYTHONUNBUFFERED=1 python3 bench/{script}.py --out $OUT {flags}--budget-s {budget_s} 2>&1 | "
        f"tee $OUT/{script}.log"
    )


def scale_command() -> str:
    """bench/scale_check.py's command: every item runs (--keep-going) within SCALE_BUDGET_S."""
    return device_command(SCALE_BUDGET_S, SCALE_SCRIPT, "--keep-going ")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--print", action="store_true", help="only print the command")
    parser.add_argument("--python-version", default=PYTHON_VERSION, help="the GPU machine's Python (default 3.12)")
    parser.add_argument("--scale", action="store_true", help="for bench/scale_check.py: Liger too, its command")
    args = parser.parse_args(argv)
    if not args.print:
        folder = REPO / WHEEL_DIR
        download(folder, args.python_version, args.scale)
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
    print(scale_command() if args.scale else device_command())
    return 0


if __name__ == "__main__":
    sys.exit(main())
