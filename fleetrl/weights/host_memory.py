"""Give freed heap memory back to the operating system (glibc's `malloc_trim`), after a large transient copy.

A replica that receives a new weight version holds the received tensors (a whole model) next to its own until the
swap has copied them in. Once they are freed, glibc keeps most of those pages: its dynamic mmap threshold rises after
the first large frees, so later large buffers come from the heap, which it does not shrink on its own. Measured with
the hf engine on a 0.73 GB float32 model (CPU, 2026-11-26): resident memory stayed at 1.64 GB after each swap, and
went back to 1.22 GB (the model and the libraries) after `malloc_trim(0)`. Elsewhere (musl, macOS) this does
nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging

logger = logging.getLogger(__name__)


@functools.cache
def _malloc_trim() -> object | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


def return_freed_memory() -> bool:
    """Ask the C allocator to return free heap pages to the OS; True when it could be asked (glibc)."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
