"""services/inference/engine.py: request validation and weight checks (pure logic)."""

from __future__ import annotations

import pytest
import torch

from fleetrl.clients.inference_types import SamplingRequest, WeightLoadError
from fleetrl.services.inference.engine import check_state_dict_matches


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"prompt_token_ids": []}, "prompt_token_ids"),
        ({"prompt_token_ids": [1, 999]}, "prompt_token_ids"),
        ({"stop_token_ids": (1000,)}, "stop_token_ids"),
        ({"n": 0}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 100}, "max length"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"seed": -1}, "seed"),
        ({"stop": ("",)}, "stop"),
        ({"stop": ("x",) * 65}, "stop"),
    ],
)
def test_validate_names_the_bad_field(kwargs: dict, field: str) -> None:
    request = SamplingRequest(**{"prompt_token_ids": [1, 2, 3], **kwargs})
    with pytest.raises(ValueError, match=field):
        request.validate(vocab_size=512, max_model_len=100)


def test_a_good_request_validates() -> None:
    SamplingRequest([1, 2], n=4, max_tokens=8, temperature=0.0, top_k=5, top_p=0.5, seed=3).validate(512, 64)


def test_stop_strings_travel_in_the_grpc_request() -> None:
    from fleetrl.clients.inference_proto import request_from_proto, request_to_proto

    request = SamplingRequest([1, 2], max_tokens=8, stop=("</tool_call>", "\n\n"))
    assert request_from_proto(request_to_proto(request)).stop == ("</tool_call>", "\n\n")
    assert request_from_proto(request_to_proto(SamplingRequest([1]))).stop == ()


def test_state_dict_check_reports_every_kind_of_mismatch() -> None:
    expected = {"a": ((2, 3), "float32"), "b": ((4,), "float32"), "tied": ((2, 3), "float32")}
    good = {"a": torch.zeros(2, 3), "b": torch.zeros(4)}
    check_state_dict_matches(expected, good, optional=frozenset({"tied"}))
    with pytest.raises(WeightLoadError, match=r"missing tensors .*tied"):
        check_state_dict_matches(expected, good)
    bad = {"a": torch.zeros(3, 2), "b": torch.zeros(4, dtype=torch.bfloat16), "zzz": torch.zeros(1)}
    with pytest.raises(WeightLoadError) as info:
        check_state_dict_matches(expected, bad, optional=frozenset({"tied"}))
    message = str(info.value)
    assert "unknown tensor names ['zzz']" in message
    assert "a: shape [3, 2] != model's [2, 3]" in message
    assert "b: dtype bfloat16 != model's float32" in message
