"""Give freed heap memory back to the OS, periodically, in every long-lived service.

Why: glibc's malloc keeps memory a process freed inside its arenas (one per thread that allocated, up to 8 per
core) and returns it to the OS only from the top of each heap. A service that makes and drops many mid-sized
buffers from several threads (a gateway's tokenizer calls, HTTP bodies and gRPC messages; the trainer's per-step
tensors) then grows in RSS while its live heap stays flat. bench/soak.py measured it: a gateway serving agent
sessions went from 540 to 640 MB in 3 minutes with its Python objects and malloc's in-use bytes flat, and one
`malloc_trim(0)` brought it back from 633 to 521 MB (docs/benchmarks.md, "Soak"). `malloc_trim(0)` walks every
arena and releases whole free pages anywhere in them (glibc >= 2.8), in a few milliseconds.

`trim_heap()` does it once (a no-op returning None where the C library has no `malloc_trim`, e.g. musl or macOS);
`trim_heap_every(interval_s, stop)` runs it on a worker thread every `interval_s` until `stop` is set. The interval
comes from $FLEETRL_HEAP_TRIM_S (default 30 s; 0 turns it off), read by `heap_trim_interval()`.

`CyclicGarbage` runs a full `gc.collect()` at most every `interval_s` while work that leaves reference cycles goes
on (a gateway's agent sessions: `fleetrl.gateway.session_server`). Why: an agent's `openai.AsyncOpenAI` client per
session is left as cyclic garbage once used (httpx's response and connection objects refer to each other), and it
holds an `ssl.SSLContext` with the CA bundle loaded (about 1 MB of OpenSSL's native memory each, measured here),
which neither tracemalloc nor `malloc_trim` can give back while the client lives. Python frees cycles only in a full
collection, which in a service with a large long-lived heap (the tokenizer, the user's code) runs only once the
objects that survived since the last one reach 25 % of the long-lived ones: minutes apart in a gateway, so its RSS
rose ~0.8 MB a step and fell back at each full collection (the soak's sawtooth, docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import gc
import logging
import os
import time
from collections.abc import Callable
from functools import cache

log = logging.getLogger(__name__)

TRIM_ENV = "FLEETRL_HEAP_TRIM_S"
DEFAULT_TRIM_S = 30.0


@cache
def _malloc_trim() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


def trim_heap() -> bool | None:
    """Release free heap pages to the OS now. True if some memory was released, False if none could be, None where
    the C library has no `malloc_trim`."""
    trim = _malloc_trim()
    if trim is None:
        return None
    return bool(trim(0))


def heap_trim_interval(environ: dict[str, str] | None = None) -> float:
    """Seconds between trims from $FLEETRL_HEAP_TRIM_S (0 = off); a bad value is refused naming the variable."""
    raw = (os.environ if environ is None else environ).get(TRIM_ENV, "").strip()
    if not raw:
        return DEFAULT_TRIM_S
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{TRIM_ENV} must be a number of seconds (0 = off); got {raw!r}") from None
    if value < 0 or value != value:
        raise ValueError(f"{TRIM_ENV} must be >= 0 seconds (0 = off); got {raw!r}")
    return value


async def trim_heap_every(interval_s: float, stop: asyncio.Event, trim: Callable[[], bool | None] = trim_heap) -> int:
    """Call `trim` (on a worker thread) every `interval_s` seconds until `stop` is set; returns how many trims ran.
    Off (returns 0 at once) when `interval_s` is 0 or the C library cannot trim."""
    if interval_s <= 0 or _malloc_trim() is None:
        return 0
    trims = 0
    while True:
        try:
            await asyncio.wait_for(stop.wait(), timeout=interval_s)
            return trims
        except TimeoutError:
            pass
        await asyncio.to_thread(trim)
        trims += 1


class CyclicGarbage:
    """A full garbage collection at most every `interval_s` of `clock`, and only when `note()` said that work which
    leaves reference cycles ran since the last one (see the module docstring). `collect` is `gc.collect`."""

    def __init__(
        self,
        interval_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        collect: Callable[[], int] = gc.collect,
    ) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s: must be > 0, got {interval_s!r}")
        self.interval_s = interval_s
        self.clock = clock
        self.collect = collect
        self._pending = False
        self._last = clock()
        self.collections = 0
        self.freed = 0  # objects the collections found unreachable

    def note(self) -> None:
        """Work that may leave cycles ran (a session was opened)."""
        self._pending = True

    def collect_if_due(self) -> bool:
        """Collect now if work was noted and `interval_s` passed since the last collection; True if it ran."""
        now = self.clock()
        if not self._pending or now - self._last < self.interval_s:
            return False
        self._pending, self._last = False, now
        self.freed += self.collect()
        self.collections += 1
        return True
