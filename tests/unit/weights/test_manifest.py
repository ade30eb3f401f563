"""Manifest building, wire encoding, checksums and chunk planning (pure, no sockets)."""

from __future__ import annotations

import json

import pytest
import torch

from fleetrl.weights import Manifest, TensorSpec, WeightTransferError, build_manifest
from fleetrl.weights.manifest import (
    checksum_bytes,
    decode_manifest,
    encode_manifest,
    plan_chunks,
    tensor_bytes,
    tensor_checksum,
)


def _state_dict() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(3, 5, generator=gen),
        "b16": torch.randn(7, 3, generator=gen).to(torch.bfloat16),
        "ids": torch.arange(11, dtype=torch.int64),
        "empty": torch.empty(0, 4),
        "scalar": torch.tensor(2.5),
        "mask": torch.tensor([True, False, True]),
    }


def test_build_manifest_describes_each_tensor_in_order():
    sd = _state_dict()
    manifest = build_manifest(4, sd)
    assert manifest.version == 4
    assert manifest.names == tuple(sd)
    by_name = {spec.name: spec for spec in manifest.tensors}
    assert by_name["b16"] == TensorSpec("b16", "bfloat16", (7, 3), 42, by_name["b16"].checksum)
    assert by_name["ids"].dtype == "int64" and by_name["ids"].nbytes == 88
    assert by_name["empty"].shape == (0, 4) and by_name["empty"].nbytes == 0
    assert by_name["scalar"].shape == () and by_name["scalar"].nbytes == 4
    assert by_name["mask"].dtype == "bool" and by_name["mask"].nbytes == 3
    assert manifest.total_bytes == 60 + 42 + 88 + 0 + 4 + 3
    assert manifest.spec("w").shape == (3, 5)
    with pytest.raises(KeyError, match="nope"):
        manifest.spec("nope")


def test_checksums_are_over_raw_bytes_and_detect_a_flipped_bit():
    t = torch.randn(64).to(torch.bfloat16)
    raw = bytes(tensor_bytes(t))
    assert len(raw) == 128
    assert raw == t.view(torch.int16).numpy().tobytes()
    assert tensor_checksum(t) == checksum_bytes(raw)
    flipped = bytearray(raw)
    flipped[77] ^= 0x01
    assert checksum_bytes(bytes(flipped)) != checksum_bytes(raw)


def test_non_contiguous_tensor_checksums_like_its_contiguous_copy():
    t = torch.randn(4, 6).t()
    assert not t.is_contiguous()
    assert tensor_checksum(t) == tensor_checksum(t.contiguous())
    with pytest.raises(ValueError, match="contiguous"):
        tensor_bytes(t)


def test_overall_checksum_identifies_the_weights_not_the_version():
    sd = _state_dict()
    assert build_manifest(1, sd).checksum == build_manifest(2, sd).checksum
    changed = dict(sd, ids=sd["ids"] + 1)
    assert build_manifest(1, changed).checksum != build_manifest(1, sd).checksum


def test_encode_decode_round_trip_is_json():
    manifest = build_manifest(9, _state_dict())
    wire = encode_manifest(manifest)
    obj = json.loads(wire)
    assert obj["format"] == "fleetrl.weights.manifest/1" and obj["checksum_algorithm"] == "xxh3_64"
    assert decode_manifest(wire) == manifest


def _tampered(edit) -> bytes:
    obj = json.loads(encode_manifest(build_manifest(3, _state_dict())))
    edit(obj)
    return json.dumps(obj).encode()


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda o: o["tensors"][0].update(shape=[5, 3]), "manifest checksum"),
        (lambda o: o["tensors"][0].update(checksum="0" * 16), "manifest checksum"),
        (lambda o: o["tensors"][0].update(nbytes=61), "nbytes 61 does not match"),
        (lambda o: o["tensors"][0].update(dtype="complex64"), "unknown dtype 'complex64'"),
        (lambda o: o["tensors"].append(dict(o["tensors"][0])), "appears twice"),
        (lambda o: o.update(format="other/2"), "format 'other/2'"),
        (lambda o: o.update(checksum_algorithm="md5"), "checksum algorithm 'md5'"),
        (lambda o: o.pop("version"), "version"),
        (lambda o: o.update(version=-1), "non-negative"),
        (lambda o: o["tensors"][1].pop("checksum"), "checksum"),
    ],
)
def test_decode_rejects_bad_manifests_with_a_clear_error(edit, message):
    with pytest.raises(WeightTransferError, match=message) as info:
        decode_manifest(_tampered(edit))
    assert info.value.reason == "protocol"


def test_decode_rejects_non_json():
    with pytest.raises(WeightTransferError, match="not valid JSON"):
        decode_manifest(b"\x80\x03}q\x00.")  # a pickle is not a manifest
    with pytest.raises(WeightTransferError, match="not a JSON object"):
        decode_manifest(b"[]")


def test_manifest_constructor_checks_its_checksum():
    manifest = build_manifest(1, _state_dict())
    with pytest.raises(ValueError, match="manifest checksum"):
        Manifest(version=1, tensors=manifest.tensors, checksum="deadbeef")


def test_unsupported_tensors_are_named():
    with pytest.raises(ValueError, match=r"'z'.*complex64"):
        build_manifest(1, {"z": torch.zeros(2, dtype=torch.complex64)})
    with pytest.raises(TypeError, match="'x' is a list"):
        build_manifest(1, {"x": [1, 2]})  # type: ignore[dict-item]


def test_plan_chunks_sends_small_tensors_whole_and_splits_large_ones():
    sd = {"a": torch.zeros(10), "empty": torch.zeros(0), "b": torch.zeros(3), "c": torch.zeros(4)}
    manifest = build_manifest(1, sd)  # 40, 0, 12, 16 bytes
    chunks = plan_chunks(manifest, 16)
    assert [(c.tensor_index, c.start, c.stop) for c in chunks] == [
        (0, 0, 16),
        (0, 16, 32),
        (0, 32, 40),
        (2, 0, 12),
        (3, 0, 16),
    ]
    assert [c.index for c in chunks] == list(range(5))
    assert sum(c.nbytes for c in chunks) == manifest.total_bytes
    split = plan_chunks(manifest, 16, split_bytes=6)
    assert [(c.tensor_index, c.start, c.stop) for c in split] == [
        *[(0, s, min(s + 6, 40)) for s in range(0, 40, 6)],
        (2, 0, 12),
        (3, 0, 16),
    ]
    with pytest.raises(ValueError, match="chunk_bytes"):
        plan_chunks(manifest, 0)
    with pytest.raises(ValueError, match="split_bytes"):
        plan_chunks(manifest, 16, split_bytes=17)


def test_adapter_manifest_round_trips_and_its_config_is_checksummed():
    sd = {"base_model.model.layers.0.q_proj.lora_A.weight": torch.ones(2, 4)}
    lora = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]}
    manifest = build_manifest(3, sd, adapter=lora)
    assert manifest.is_adapter and not build_manifest(3, sd).is_adapter
    decoded = decode_manifest(encode_manifest(manifest))
    assert decoded == manifest and decoded.adapter == lora
    # Another alpha on the same tensors is other weights: another checksum.
    assert build_manifest(3, sd, adapter={**lora, "lora_alpha": 8}).checksum != manifest.checksum
    assert build_manifest(3, sd).checksum != manifest.checksum
    # A manifest whose adapter was edited in transit fails its checksum.
    obj = json.loads(encode_manifest(manifest))
    obj["adapter"]["r"] = 4
    with pytest.raises(WeightTransferError, match="checksum"):
        decode_manifest(json.dumps(obj).encode())
