"""Fixtures for the inference integration tests: ONE vLLM engine shared by every vLLM test in this package.

A vLLM engine costs ~30 s to start (it spawns an engine-core and a worker process), so all vLLM test modules
share `vllm_engine`. AsyncLLM is bound to the event loop it runs on, hence the session-scoped event loop: tests
that use the fixture mark themselves `pytest.mark.asyncio(loop_scope="session")` (see VLLM_TEST_MARKS).

vLLM is optional: without it the fixture skips the test (modules also `pytest.importorskip("vllm")`). The KV
cache is sized explicitly (1 GiB, the engine's kv_cache_memory_bytes, like VLLM_CPU_KVCACHE_SPACE=1), since the
CPU backend otherwise wants most of the machine's memory. vLLM starts its processes with spawn; that works
under pytest because the spawned children import this package by name, not a test file's `__main__`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

VLLM_MAX_LORA_RANK = 16
VLLM_TEST_MARKS = [
    pytest.mark.integration,
    pytest.mark.vllm,
    pytest.mark.slow,  # each test is quick, but the shared engine takes ~25 s to start and 5 s to stop
    pytest.mark.asyncio(loop_scope="session"),
]


# Package scope: the engine stops once the inference tests are done, so its engine-core process (which polls for
# work while idle, taking a core) does not run beside the rest of the suite. Two CI runs had a spawned two-rank
# trainer test (tests/integration/trainer/test_fsdp.py, the next module) abort at teardown while it ran.
@pytest_asyncio.fixture(scope="package", loop_scope="session")
async def vllm_engine(tiny_model_dir: str) -> AsyncIterator[object]:
    """A started VLLMEngine serving the session's tiny model (float32, 1 GiB KV cache, eager), LoRA enabled
    (rank <= VLLM_MAX_LORA_RANK) so that the LoRA tests share it; requests without an adapter run on the base."""
    pytest.importorskip("vllm")
    from fleetrl.services.inference.vllm_engine import VLLMEngine

    engine = VLLMEngine(
        tiny_model_dir,
        dtype="float32",
        max_model_len=1024,
        kv_cache_gib=1.0,
        seed=0,
        max_lora_rank=VLLM_MAX_LORA_RANK,
    )
    await engine.start()
    try:
        yield engine
    finally:
        await engine.shutdown()
