"""Which samples of a step are logged and how they are decoded (fleetrl.sample_log): pure, with a scripted decode."""

from __future__ import annotations

from fleetrl.rollout import RolloutSample
from fleetrl.sample_log import SAMPLE_COLUMNS, choose_samples, logged_samples, samples_due, split_prompt


def test_samples_are_due_every_interval_and_never_at_zero():
    assert [s for s in range(1, 11) if samples_due(s, 4)] == [4, 8]
    assert not any(samples_due(s, 0) for s in range(1, 5))


def test_samples_are_taken_from_the_rows_in_turn():
    rows = [7, 7, 7, 9, 9, 12]
    assert choose_samples(rows, 3) == [0, 3, 5]  # one per row first
    assert choose_samples(rows, 5) == [0, 3, 5, 1, 4]  # then the second of each
    assert choose_samples(rows, 10) == [0, 3, 5, 1, 4, 2]  # no more than there are
    assert choose_samples([], 4) == []


def test_the_prompt_ends_at_the_first_generated_token():
    assert split_prompt([1, 2, 3, 4, 5], [0, 0, 1, 0, 1]) == ([1, 2], [3, 4, 5])  # a tool turn stays in
    assert split_prompt([1, 2], [0, 0]) == ([1, 2], [])


def test_logged_samples_are_decoded_with_their_row_reward_and_offset():
    a = RolloutSample([10, 11, 12], [0.0] * 3, [0, 1, 1], reward=1.0, finish_reason="length", text="ignored")
    b = RolloutSample([20, 21], [0.0] * 2, [0, 1], reward=0.0, text="b's text")
    decode = lambda tokens: "".join(chr(ord("a") + t % 26) for t in tokens)  # noqa: E731 - a scripted tokenizer
    (first, second) = logged_samples(3, [a, b], row_ids=[5, 6], version_offsets=[1, 0], count=2, decode=decode)
    assert first.as_row() == {
        "step": 3,
        "row_id": 5,
        "prompt": "k",
        "completion": "lm",
        "reward": 1.0,
        "version_offset": 1,
        "finish_reason": "length",
    }
    assert tuple(first.as_row()) == SAMPLE_COLUMNS
    assert (second.row_id, second.prompt, second.completion) == (6, "u", "v")
    # Without a tokenizer the completion is the sample's own text.
    (only,) = logged_samples(3, [b], row_ids=[6], version_offsets=[0], count=4, decode=None)
    assert (only.prompt, only.completion) == ("", "b's text")


def test_with_token_ids_each_logged_sample_carries_what_was_trained_through_the_trainers_reply():
    """`log_samples_token_ids`: the trainer's logged samples carry their token ids, the TrainStep reply (a real
    protobuf message, serialized and parsed) carries them, the controller's samples.jsonl rows hold them, and a
    resumed trainer's step record keeps them; without the option no row has them."""
    from fleetrl.sample_log import TOKEN_ID_COLUMNS
    from fleetrl.services.controller.orchestrator import Orchestrator
    from fleetrl.services.trainer.servicer import step_to_proto
    from fleetrl.trainer.policy_trainer import StepResult
    from fleetrl.trainer.step_records import result_fields, step_record
    from fleetrl.v1 import trainer_pb2

    a = RolloutSample([10, 11, 12, 13, 14], [0.0] * 5, [0, 0, 1, 0, 1], reward=1.0)
    b = RolloutSample([20, 21], [0.0] * 2, [0, 1], reward=0.0)
    decode = lambda tokens: " ".join(map(str, tokens))  # noqa: E731 - a scripted tokenizer
    for token_ids in (True, False):
        logged = logged_samples(5, [a, b], [3, 4], [0, 1], 2, decode, token_ids=token_ids)
        result = StepResult(step=5, version=5, metrics={}, row_ids=[3, 4], samples=logged)
        reply = trainer_pb2.TrainStepResponse.FromString(step_to_proto(result, "").SerializeToString())
        rows = Orchestrator._sample_rows(5, reply)
        replayed = [s.as_row() for s in result_fields(step_record(result))["samples"]]
        if token_ids:
            assert [(r["prompt_token_ids"], r["completion_token_ids"]) for r in rows] == [
                ([10, 11], [12, 13, 14]),  # the tool turn (13) stays in the completion, as trained around it
                ([20], [21]),
            ]
            assert rows[0]["prompt"] == "10 11" and replayed == rows
        else:
            assert not any(k in r for r in rows + replayed for k in TOKEN_ID_COLUMNS)
            assert set(rows[0]) == set(SAMPLE_COLUMNS)
