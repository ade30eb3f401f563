"""examples/tool_use: the calculator, the transcript's token bookkeeping, and rollouts overlapping on the tool."""

from __future__ import annotations

import asyncio
import json

import pytest

from fleetrl import RolloutSetup
from tests.unit.examples.helpers import ScriptedSampler, generated_spans, load_example_module

calculator = load_example_module("tool_use", "calculator")
rollout = load_example_module("tool_use", "rollout")
train = load_example_module("tool_use", "train")
ROW = {"question": "What is 37 * 12 + 5?", "answer": "449"}


@pytest.mark.parametrize(
    ("expression", "value"),
    [("37*12+5", "449"), (" 37 * 12 + 5 =", "449"), ("(1+2)**3", "27"), ("7/2", "3.5"), ("-3 + 1", "-2"),
     ("10 / 4 * 2", "5"), ("6 × 7", "42"), ("2^10", "1024"), ("1/3", "0.333333")],
)  # fmt: skip
def test_calculator_values(expression, value):
    assert calculator.format_value(calculator.evaluate(expression)) == value


@pytest.mark.parametrize(
    ("expression", "error"),
    [("", "empty"), ("1/0", "division by zero"), ("__import__('os')", "unsupported syntax: Call"),
     ("x + 1", "unsupported syntax: Name"), ("9**99999", "power too large"), ("1 +", "cannot parse"),
     ("10**15 * 10**15", "out of range"), ("1" * 300, "longer than"), ("True + 1", "unsupported syntax")],
)  # fmt: skip
def test_calculator_refuses(expression, error):
    with pytest.raises(calculator.CalculatorError, match=error):
        calculator.evaluate(expression)


def test_the_tool_awaits_its_latency_and_reports_errors_as_text(monkeypatch):
    waits: list[float] = []

    async def fake_sleep(seconds: float) -> None:
        waits.append(seconds)

    monkeypatch.setattr(calculator.asyncio, "sleep", fake_sleep)
    assert asyncio.run(calculator.calculator("2+2", 0.7)) == "4"
    assert asyncio.run(calculator.calculator("2+", 0.7)).startswith("error: cannot parse")
    assert waits == [0.7, 0.7]


def test_first_line_length(tokenizer):
    def pieces(*texts: str) -> list[list[int]]:
        return [tokenizer.encode(t, add_special_tokens=False) for t in texts]

    line, newline, rest = pieces("37*12+5", "\n", "Value")
    assert rollout.first_line_length(tokenizer, line + newline + rest) == len(line) + len(newline)
    blank, line, newline, rest = pieces("\n\n", " 3+4", "\n", "more\n")  # leading blank lines end nothing
    assert rollout.first_line_length(tokenizer, blank + line + newline + rest) == len(blank + line + newline)
    assert rollout.first_line_length(tokenizer, line) == len(line)  # no newline: all of it


def make_setup(tokenizer, sampler, **extras) -> RolloutSetup:
    extras = {"tool_latency_s": 0.0, **extras}
    return RolloutSetup(tokenizer=tokenizer, sampler=sampler, sample_kwargs={"max_tokens": 16}, extras=extras)


def test_tool_results_are_appended_after_the_models_own_tokens(tokenizer):
    def enc(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    # Turn 1 runs past its first line: only the line is kept. Turn 2 calls again; turn 3 is the answer.
    replies = [enc(" 37*12+5\nblah blah"), enc(" 449"), enc(" 449\n")]
    sampler = ScriptedSampler(tokenizer, replies)
    sample = asyncio.run(rollout.make_rollout_fn(make_setup(tokenizer, sampler, tool_calls=2))(ROW))
    prompts, generated = sampler.prompts, sampler.generated
    assert len(prompts) == 3
    kept = [enc(" 37*12+5\n"), enc(" 449"), generated[2]]
    observations = [prompts[i + 1][len(prompts[i]) + len(kept[i]) :] for i in range(2)]
    assert tokenizer.decode(observations[0]) == "Value: 449\nCalculator:"
    assert tokenizer.decode(observations[1]) == "\nValue: 449\nAnswer:"
    for i in range(2):
        assert prompts[i + 1] == prompts[i] + kept[i] + observations[i]
    assert sample.tokens == prompts[2] + generated[2]
    assert tokenizer.decode(prompts[0]).endswith("Question: What is 37 * 12 + 5?\nCalculator:")
    spans = [(len(p), len(p) + len(k)) for p, k in zip(prompts, kept, strict=True)]
    assert generated_spans(sample.loss_mask) == spans
    for call, (start, end) in enumerate(spans):
        assert sample.logprobs[start:end] == [-(call + 1) - 0.01 * i for i in range(end - start)]
    assert sample.reward == 1.0 and sample.metrics == {"correct": 1.0, "tool_error_frac": 0.0}
    sample.validate()


def test_an_unusable_tool_call_still_costs_a_call_and_gets_the_error_back(tokenizer):
    replies = [[tokenizer.eos_token_id], tokenizer.encode(" 12", add_special_tokens=False)]
    sampler = ScriptedSampler(tokenizer, replies)
    sample = asyncio.run(rollout.make_rollout_fn(make_setup(tokenizer, sampler))(ROW))
    assert tokenizer.decode(sampler.prompts[1]).endswith("Calculator:\nValue: error: empty expression\nAnswer:")
    assert sample.reward == 0.0 and sample.metrics["tool_error_frac"] == 1.0
    sample.validate()


def test_rollouts_overlap_while_they_await_the_tool(tokenizer, monkeypatch):
    """G rollouts of a row await the slow tool together: the gateway (and the trainer, when async) work on while
    one waits. Counted with the tool's sleep, not timed."""
    in_flight, peak = 0, 0
    real_sleep = asyncio.sleep

    async def counting_sleep(seconds: float) -> None:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        await real_sleep(0.01)
        in_flight -= 1

    sampler = ScriptedSampler(tokenizer, lambda prompt: tokenizer.encode(" 1+1\n", add_special_tokens=False))
    rollout_fn = rollout.make_rollout_fn(make_setup(tokenizer, sampler, tool_latency_s=1.0))
    monkeypatch.setattr(rollout.calculator.__globals__["asyncio"], "sleep", counting_sleep)

    async def group():
        return await asyncio.gather(*(rollout_fn(ROW) for _ in range(4)))

    samples = asyncio.run(group())
    assert len(samples) == 4 and peak == 4


def test_config_modes():
    sync = train.build_config(train.parse_args(["--model", "m", "--sync", "--tool-latency", "0.2"]))
    assert sync.synchronous_training and sync.max_head_offpolicy_versions == 0
    assert sync.rollout_extras == {"tool_latency_s": 0.2, "tool_calls": 1}
    async_ = train.build_config(train.parse_args(["--model", "m", "--offpolicy", "2"]))
    assert not async_.synchronous_training and async_.max_head_offpolicy_versions == 2


def test_samples_per_s_is_wall_clock_throughput_after_the_first_step(tmp_path):
    lines = [
        {"step": 1, "time": 100.0, "data/samples": 16, "perf/wait_time_ratio": 0.9},
        {"step": 1, "time": 100.5, "eval/accuracy": 0.0},  # an evaluation line is not a step
        {"step": 2, "time": 102.0, "data/samples": 16, "perf/wait_time_ratio": 0.5},
        {"step": 3, "time": 104.0, "data/samples": 16, "perf/wait_time_ratio": 0.1},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    assert train.samples_per_s(tmp_path) == pytest.approx(
        {"steps": 3.0, "samples_per_s": 32 / 4.0, "mean_wait_time_ratio": 0.3}
    )
