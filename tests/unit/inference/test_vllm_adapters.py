"""AdapterBook (services/inference/vllm_adapters.py): which LoRA adapter versions a vLLM engine may remove."""

from __future__ import annotations

from pathlib import Path

from fleetrl.services.inference.vllm_adapters import Adapter, AdapterBook


def _adapter(version: int) -> Adapter:
    return Adapter(version, f"lora-v{version}", Path(f"/tmp/v{version}"))


def test_listeners_see_the_newest_adapter_and_none_for_full_weights():
    book, seen = AdapterBook(), []
    book.watch(seen.append)
    book.replace(_adapter(1))
    book.replace(_adapter(2))
    book.replace(None)
    assert seen == [None, "lora-v1", "lora-v2", None]
    late = []
    book.watch(late.append)
    assert late == [None]


def test_an_adapter_retires_once_no_grpc_request_uses_it():
    book = AdapterBook()
    first = _adapter(1)
    book.replace(first)
    first.users += 1
    book.replace(_adapter(2))
    assert book.take_unused() == [] and book.retiring == [first]
    first.users -= 1
    assert book.take_unused() == [first] and book.retiring == []
    assert book.current.version == 2  # the newest never retires


def test_an_http_request_holds_every_adapter_from_its_arrival_version_on():
    book = AdapterBook()
    v1, v2, v3 = _adapter(1), _adapter(2), _adapter(3)
    book.replace(v1)
    book.hold(1)  # arrived while v1 was loaded: vLLM may have given it v1 or any newer adapter
    book.replace(v2)
    book.hold(2)
    book.replace(v3)
    assert book.take_unused() == []
    book.release(1)
    assert book.take_unused() == [v1]  # the request holding from 2 on keeps v2
    book.release(2)
    assert book.take_unused() == [v2] and book.retiring == []


def test_holds_from_the_same_version_are_counted():
    book = AdapterBook()
    v1 = _adapter(1)
    book.replace(v1)
    book.hold(1)
    book.hold(1)
    book.replace(_adapter(2))
    book.release(1)
    assert book.take_unused() == []
    book.release(1)
    assert book.take_unused() == [v1]


def test_a_hold_from_a_newer_version_does_not_keep_older_adapters():
    book = AdapterBook()
    v1 = _adapter(1)
    book.replace(v1)
    book.replace(_adapter(2))
    book.hold(2)
    assert book.take_unused() == [v1]
