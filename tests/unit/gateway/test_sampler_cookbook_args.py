"""The cookbook's sampling arguments on the sampler: honoured (stop strings, max_seq_len, http_timeout, logprobs)
or refused saying what to do instead (echo, top-N logprobs). The replica is a script (no sockets)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from fleetrl.gateway.sampler import Sampler
from fleetrl.services.inference.engine import Completion, SamplingRequest


class CharTokenizer:
    """Token id i is the character chr(ord('a') + i)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + i) for i in ids)


class ScriptedSampler(Sampler):
    def __init__(self, answer: list[int], delay_s: float = 0.0, **kwargs: Any) -> None:
        super().__init__(CharTokenizer(), **kwargs)
        self.answer, self.delay_s = answer, delay_s
        self.requests: list[SamplingRequest] = []

    async def generate(self, request: SamplingRequest) -> list[Completion]:
        self.requests.append(request)
        if self.delay_s:
            await asyncio.Event().wait()  # never answers: only the call's timeout ends it
        n = len(self.answer)
        return [Completion(list(self.answer), [-0.5] * n, "length", len(request.prompt_token_ids), [3] * n)]


async def test_a_stop_string_cuts_the_completion_after_the_token_that_completes_it():
    sampler = ScriptedSampler([0, 1, 2, 3, 4])  # "abcde"
    (c,) = await sampler.sample_with_prompt_tokens([7, 8], stop=["cd", "zz"], logprobs=True)
    assert c.completion_tokens == [0, 1, 2, 3] and c.text == "abcd" and c.finish_reason == "stop"
    assert c.sampling_logprobs == c.inference_logprobs == [-0.5] * 4 and c.versions == [3] * 4
    (c,) = await sampler.sample_with_prompt_tokens([7, 8], stop="q")  # no stop string: left as it came
    assert c.completion_tokens == [0, 1, 2, 3, 4] and c.finish_reason == "length"


async def test_stop_strings_go_to_the_engine():
    sampler = ScriptedSampler([0, 1])
    await sampler.sample_with_prompt_tokens([7, 8], stop=["cd", 5, "zz"])
    assert sampler.requests[0].stop == ("cd", "zz") and sampler.requests[0].stop_token_ids == (5,)
    await sampler.sample_with_prompt_tokens([7, 8])
    assert sampler.requests[1].stop == ()


async def test_token_id_stops_go_to_the_engine_and_max_seq_len_caps_max_tokens():
    sampler = ScriptedSampler([0])
    await sampler.sample_with_prompt_tokens([7, 8, 9], stop=[5], max_tokens=64, max_seq_len=10)
    assert sampler.requests[0].stop_token_ids == (5,) and sampler.requests[0].max_tokens == 7
    with pytest.raises(ValueError, match="leaves no room under max_seq_len 3"):
        await sampler.sample_with_prompt_tokens([7, 8, 9], max_seq_len=3)


async def test_http_timeout_bounds_the_whole_call():
    sampler = ScriptedSampler([0], delay_s=1.0)
    with pytest.raises(TimeoutError):
        await sampler.sample_with_prompt_tokens([7], http_timeout=0.05)


@pytest.mark.parametrize(
    ("kwargs", "advice"),
    [
        ({"echo": True}, "already carries its prompt"),
        ({"logprobs": 5}, "pass logprobs=True or leave it out"),
        ({"stop": [""]}, "non-empty strings"),
        ({"frequency_penalty": 1.0}, "unknown sampling arguments"),
    ],
)
async def test_arguments_fleetrl_cannot_honour_are_refused_saying_what_to_do(kwargs, advice):
    with pytest.raises(TypeError, match=advice):
        await ScriptedSampler([0]).sample_with_prompt_tokens([7], **kwargs)
