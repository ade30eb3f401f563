"""loss_agg_mode on a hand example: L = [[1, 2, 3], [4, 5, 6]], mask = [[1, 1, 0], [1, 0, 0]]."""

from __future__ import annotations

import pytest
import torch

from fleetrl.losses import AGG_MODES, LossSettings, aggregate_loss, policy_loss
from tests.unit.losses.helpers import t

LOSS = t([[1, 2, 3], [4, 5, 6]])
MASK = t([[1, 1, 0], [1, 0, 0]])


@pytest.mark.parametrize(
    ("mode", "constant", "expected"),
    [
        ("token-mean", None, (1 + 2 + 4) / 3),
        ("seq-mean-token-mean", None, ((1 + 2) / 2 + 4 / 1) / 2),
        ("seq-mean-token-sum-norm", None, ((1 + 2) / 3 + 4 / 3) / 2),  # constant = T = 3
        ("seq-mean-token-sum-norm", 2.0, ((1 + 2) / 2 + 4 / 2) / 2),
        ("sum", None, 1 + 2 + 4),
    ],
)
def test_each_mode_on_hand_example(mode: str, constant: float | None, expected: float) -> None:
    assert aggregate_loss(LOSS, MASK, mode, constant).item() == pytest.approx(expected)


def test_modes_differ_on_the_example() -> None:
    values = {aggregate_loss(LOSS, MASK, mode).item() for mode in AGG_MODES}
    assert len(values) == len(AGG_MODES)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_sequence_without_masked_tokens_is_left_out(mode: str) -> None:
    loss = torch.cat([LOSS, t([[100, 100, 100]])])
    mask = torch.cat([MASK, t([[0, 0, 0]])])
    assert aggregate_loss(loss, mask, mode).item() == pytest.approx(aggregate_loss(LOSS, MASK, mode).item())


@pytest.mark.parametrize("mode", AGG_MODES)
def test_no_masked_token_gives_zero_loss_with_a_graph(mode: str) -> None:
    loss = LOSS.clone().requires_grad_(True)
    out = aggregate_loss(loss, torch.zeros_like(MASK), mode)
    out.backward()
    assert out.item() == 0.0
    assert loss.grad is not None and torch.equal(loss.grad, torch.zeros_like(LOSS))


def test_token_mean_gradient_is_mask_over_count() -> None:
    loss = LOSS.clone().requires_grad_(True)
    aggregate_loss(loss, MASK, "token-mean").backward()
    torch.testing.assert_close(loss.grad, MASK / 3)


def test_seq_mean_token_mean_gradient_weights_short_sequences_more() -> None:
    loss = LOSS.clone().requires_grad_(True)
    aggregate_loss(loss, MASK, "seq-mean-token-mean").backward()
    torch.testing.assert_close(loss.grad, t([[0.25, 0.25, 0], [0.5, 0, 0]]))


def test_unknown_mode_is_rejected() -> None:
    with pytest.raises(ValueError, match="token-sum"):
        aggregate_loss(LOSS, MASK, "token-sum")


@pytest.mark.parametrize(
    ("mode", "constant"),
    [("token-mean", None), ("seq-mean-token-mean", None), ("seq-mean-token-sum-norm", 4.0)],
)
def test_policy_loss_reads_agg_mode_from_cfg(mode: str, constant: float | None) -> None:
    # reinforce's per-token loss is -A * pi, so with A = 1 the loss is the aggregate of -pi.
    pi = -LOSS
    loss, _ = policy_loss(
        "reinforce",
        pi,
        pi,
        pi,
        t([1, 1]),
        MASK,
        cfg=LossSettings(loss_agg_mode=mode, loss_agg_constant=constant),  # type: ignore[arg-type]
    )
    assert loss.item() == pytest.approx(aggregate_loss(LOSS, MASK, mode, constant).item())
