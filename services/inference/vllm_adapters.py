"""The LoRA adapter versions a vLLM engine has loaded: which one new requests get, and which older ones nothing can
use any more (pure bookkeeping; the VLLMEngine makes the vLLM calls).

    book = AdapterBook()
    book.replace(Adapter(3, lora_request, path))   # version 3 serves new requests; 2 (if any) is retiring
    adapter = book.current; adapter.users += 1     # a gRPC request keeps its adapter to the end
    book.hold(arrived)                             # an HTTP request that arrived while `arrived` was loaded
    ...
    for old in book.take_unused(): ...             # remove_lora, delete the folder

A gRPC request counts itself on the adapter it took. A request through vLLM's OpenAI serving layer picks its
adapter inside vLLM (the `lora_requests` entry `watch` keeps pointing at the newest), so it cannot be counted on
one: it holds every adapter from the version loaded when it arrived on, since a newer one may have replaced the
current before vLLM looked it up. An adapter retires once no gRPC request uses it and no HTTP request holds it.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(eq=False)
class Adapter:
    """One adapter version loaded into vLLM, and how many gRPC requests in flight use it."""

    version: int
    request: Any  # vllm LoRARequest
    path: Path
    users: int = 0


class AdapterBook:
    """The newest adapter, the retiring ones, and the HTTP requests holding them."""

    def __init__(self) -> None:
        self.current: Adapter | None = None
        self._retiring: list[Adapter] = []
        self._holds: collections.Counter[int] = collections.Counter()  # arrival version -> HTTP requests
        self._listeners: list[Callable[[Any], None]] = []

    def watch(self, listener: Callable[[Any], None]) -> None:
        """Call `listener(lora_request or None)` now and whenever the newest adapter changes (None: no adapter,
        requests run on the base weights)."""
        self._listeners.append(listener)
        listener(None if self.current is None else self.current.request)

    def replace(self, adapter: Adapter | None) -> None:
        """`adapter` serves new requests from now on (None: a full-weight version, no adapter); the previous one
        retires."""
        old, self.current = self.current, adapter
        if old is not None:
            self._retiring.append(old)
        for listener in self._listeners:
            listener(None if adapter is None else adapter.request)

    def hold(self, arrived: int) -> None:
        """An HTTP request that arrived while version `arrived` was loaded: it may use any adapter from it on."""
        self._holds[arrived] += 1

    def release(self, arrived: int) -> None:
        """That request finished."""
        self._holds[arrived] -= 1
        if self._holds[arrived] <= 0:
            del self._holds[arrived]

    def take_unused(self) -> list[Adapter]:
        """Remove and return the retiring adapters that no request can still use."""
        floor = min(self._holds) if self._holds else None

        def unused(adapter: Adapter) -> bool:
            return adapter.users == 0 and (floor is None or adapter.version < floor)

        gone = [a for a in self._retiring if unused(a)]
        self._retiring = [a for a in self._retiring if not unused(a)]
        return gone

    @property
    def retiring(self) -> list[Adapter]:
        """Older adapters still in use (oldest first)."""
        return list(self._retiring)
