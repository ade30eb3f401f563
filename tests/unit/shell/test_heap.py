"""fleetrl.shell.heap: freed heap pages go back to the OS, on a period every service runs."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap

import pytest

from fleetrl.shell.heap import TRIM_ENV, heap_trim_interval, trim_heap, trim_heap_every
from fleetrl.shell.service import Service, ShellConfig, run_service

glibc = pytest.mark.skipif(trim_heap() is None, reason="the C library has no malloc_trim")

# A fresh interpreter allocates ~120 MB in 2 kB blocks (below the mmap threshold: they come from the heap, above
# pymalloc's 512 bytes: from malloc), frees all but the last (which pins the heap's top, so free() cannot shrink it),
# and prints its RSS before and after trim_heap().
FRAGMENTED = textwrap.dedent(
    """
    from fleetrl.shell.heap import trim_heap

    def rss_mb():
        for line in open("/proc/self/status"):
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024

    blocks = [bytes(2048) for _ in range(60_000)]
    last = bytes(2048)
    del blocks
    before = rss_mb()
    trimmed = trim_heap()
    print(before, rss_mb(), trimmed)
    """
)


@glibc
def test_trim_heap_gives_freed_pages_back_to_the_os():
    out = subprocess.run([sys.executable, "-c", FRAGMENTED], capture_output=True, text=True, timeout=120, check=True)
    before, after, trimmed = out.stdout.split()
    assert trimmed == "True"
    assert float(before) - float(after) > 80, out.stdout  # most of the ~120 MB freed but held by malloc


def test_the_interval_comes_from_the_environment_and_a_bad_one_is_refused_by_name():
    assert heap_trim_interval({}) == 30.0
    assert heap_trim_interval({TRIM_ENV: "0"}) == 0.0
    assert heap_trim_interval({TRIM_ENV: " 2.5 "}) == 2.5
    for bad in ("soon", "-1", "nan"):
        with pytest.raises(ValueError, match=TRIM_ENV):
            heap_trim_interval({TRIM_ENV: bad})


@glibc
def test_trims_run_on_the_period_until_stopped():
    async def main() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        calls = 0

        def trim() -> bool:
            nonlocal calls
            calls += 1
            if calls == 3:
                loop.call_soon_threadsafe(stop.set)
            return True

        return await asyncio.wait_for(trim_heap_every(0.001, stop, trim), timeout=60)

    assert asyncio.run(main()) == 3


def test_off_when_the_interval_is_zero():
    async def main() -> int:
        return await trim_heap_every(0, asyncio.Event(), lambda: pytest.fail("trimmed while off"))

    assert asyncio.run(main()) == 0


def test_a_bad_interval_fails_the_service_at_start(monkeypatch, caplog):
    monkeypatch.setenv(TRIM_ENV, "often")
    started = []

    class Probe(Service):
        async def start(self) -> dict:
            started.append(True)
            return {}

    code = asyncio.run(run_service(Probe(), ShellConfig()))
    assert code == 1 and not started
    assert TRIM_ENV in caplog.text
