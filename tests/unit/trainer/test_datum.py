import torch

from fleetrl import RolloutSample
from fleetrl.trainer.datum import build_datum, collate, gather_target_logprobs, samples_to_batch


def test_one_position_shift_on_interleaved_multi_turn_mask():
    # Two turns: [prompt prompt asst asst user user asst asst]
    tokens = [10, 11, 12, 13, 14, 15, 16, 17]
    mask = [0, 0, 1, 1, 0, 0, 1, 1]
    logprobs = [0.0, 0.0, -0.2, -0.3, 0.0, 0.0, -0.6, -0.7]
    d = build_datum(RolloutSample(tokens, logprobs, mask, reward=1.0))
    assert len(d) == 7  # N-1 positions for N tokens
    assert d.input_tokens == [10, 11, 12, 13, 14, 15, 16]
    assert d.target_tokens == [11, 12, 13, 14, 15, 16, 17]
    assert d.weights == [0, 1, 1, 0, 0, 1, 1]
    assert d.rollout_logprobs == [0.0, -0.2, -0.3, 0.0, 0.0, -0.6, -0.7]
    # Each weighted target is an assistant token, predicted from the token just before it.
    for i, w in enumerate(d.weights):
        assert w == mask[i + 1]
        assert d.target_tokens[i] == tokens[i + 1]
        if w:
            assert d.rollout_logprobs[i] == logprobs[i + 1]


def test_collate_pads_right_with_zero_weight():
    a = RolloutSample([1, 2, 3], [0.0, -0.1, -0.2], [0, 1, 1], 0.0, versions=[0, 2, 2])
    b = RolloutSample([4, 5, 6, 7, 8], [0.0, 0.0, -0.3, -0.4, -0.5], [0, 0, 1, 1, 1], 1.0)
    batch = samples_to_batch([a, b], pad_token_id=99)
    assert batch.shape == (2, 4)
    assert batch.input_tokens_BT.tolist() == [[1, 2, 99, 99], [4, 5, 6, 7]]
    assert batch.target_tokens_BT.tolist() == [[2, 3, 99, 99], [5, 6, 7, 8]]
    assert batch.mask_BT.tolist() == [[1, 1, 0, 0], [0, 1, 1, 1]]
    assert batch.attention_mask_BT.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]
    assert torch.allclose(batch.rollout_logprobs_BT[0], torch.tensor([-0.1, -0.2, 0.0, 0.0]))
    assert batch.lengths_B.tolist() == [2, 4]
    assert build_datum(a).versions == [2, 2]


def test_collate_pad_to_and_empty():
    d = build_datum(RolloutSample([1, 2], [0.0, -1.0], [0, 1], 0.0))
    assert collate([d], pad_to=5).shape == (1, 5)
    try:
        collate([])
    except ValueError as exc:
        assert "no datums" in str(exc)
    else:
        raise AssertionError("collate([]) must raise")


def test_gather_target_logprobs_matches_log_softmax():
    logits = torch.tensor([[[0.0, 1.0, 2.0], [3.0, 0.0, 0.0]]])
    targets = torch.tensor([[2, 0]])
    out = gather_target_logprobs(logits, targets)
    expected = [
        2.0 - torch.logsumexp(torch.tensor([0.0, 1, 2]), 0),
        3.0 - torch.logsumexp(torch.tensor([3.0, 0, 0]), 0),
    ]
    assert torch.allclose(out[0], torch.stack(expected))


def test_collate_refuses_a_datum_whose_lists_differ_in_length_naming_it():
    import pytest

    from fleetrl.trainer.datum import Datum

    good = Datum([1, 2, 3], [2, 3, 4], [0, 1, 1], [0.0, -0.5, -0.25])
    short = Datum([1, 2], [2, 3], [1], [-0.5, -0.25])  # one weight for two tokens
    with pytest.raises(ValueError, match="datum 1 has 1 weights for 2 input tokens"):
        collate([good, short])
    batch = collate([good, Datum([5], [6], [1], [-1.0], versions=[3])])
    assert batch.input_tokens_BT.tolist() == [[1, 2, 3], [5, 0, 0]]
    assert batch.rollout_logprobs_BT.tolist() == [[0.0, -0.5, -0.25], [-1.0, 0.0, 0.0]]
    assert batch.attention_mask_BT.tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch.versions_BT.tolist() == [[-1, -1, -1], [3, -1, -1]]
    assert batch.input_tokens_BT.dtype == torch.long and batch.mask_BT.dtype == torch.float32
