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
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
import os
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
