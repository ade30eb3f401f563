"""How the lanes share the machine's cores: pytest-xdist workers (`scripts/test.sh` runs each lane with
`-n $FLEETRL_TEST_WORKERS`, 2 by default) and the units of work they are handed (`scope_of`).

A worker takes a whole test module at a time, as xdist's `--dist loadscope` does, so a module's shared fixtures (a
run, an engine, a stack) are built once. Two kinds of module go to one worker together, one after the other:

- `deploy`: the deployment stacks (tests/deploy) put each service on a loopback address of its own with the ports
  compose and the chart name (9400-9404, 50051...); two stacks at once would take each other's ports.
- `vllm`: the vLLM engines started in the test process or by `fleetrl up` (tests/integration/*vllm*, the tensor
  parallel engine): each binds its threads to cores and takes its KV cache space, so two at once would only slow
  each other down.

Without xdist installed the hook is never called and a plain `pytest` runs as before.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

WORKERS_ENV = "FLEETRL_TEST_WORKERS"

VLLM_MODULES = frozenset(
    {
        "tests/integration/up/test_up_modes.py",
        "tests/integration/examples/test_openai_agent_up.py",
        "tests/integration/tensor_parallel/test_vllm_tensor_parallel.py",
    }
)
"""Modules that start vLLM engines without saying so in their name (besides tests/integration/**/*vllm*)."""


def scope_of(nodeid: str) -> str:
    """The unit of work `nodeid` belongs to: its module, or a scope shared by modules that must not run at the same
    time as each other (`deploy`, `vllm`)."""
    module = nodeid.split("::", 1)[0]
    if module.startswith("tests/deploy/"):
        return "deploy"
    if module.startswith("tests/integration/") and ("vllm" in module or module in VLLM_MODULES):
        return "vllm"
    return module


LONG_SCOPES: tuple[str, ...] = (
    "vllm",
    "tests/integration/examples/test_arithmetic_main_job.py",
    "deploy",
)
"""Handed out first (longest first, as measured in the slow lane), so that no worker starts one of them while the
other has nothing left: the lane ends when its busiest worker does."""


def scheduling_order(nodeids: list[str]) -> list[int]:
    """The positions of `nodeids` with the tests of `LONG_SCOPES` first, in that order; the rest keep theirs."""
    rank = {scope: i for i, scope in enumerate(LONG_SCOPES)}
    return sorted(range(len(nodeids)), key=lambda i: (rank.get(scope_of(nodeids[i]), len(rank)), i))


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under xdist (each worker collects the same items, and the scheduler hands out scopes in their order)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        order = scheduling_order([item.nodeid for item in items])
        items[:] = [items[i] for i in order]


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScopes(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return scope_of(nodeid)

    return ModuleScopes(config, log)
