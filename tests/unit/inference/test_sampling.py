"""services/inference/sampling.py: the processed distribution (temperature, top-k, top-p) and sampling."""

from __future__ import annotations

import torch

from fleetrl.services.inference.sampling import processed_logprobs, sample_tokens


def _run(logits, temperature=1.0, top_k=0, top_p=1.0):
    b = logits.shape[0]
    return processed_logprobs(
        logits,
        torch.full((b,), temperature),
        torch.full((b,), top_k, dtype=torch.long),
        torch.full((b,), top_p),
    )


def test_temperature_only_is_a_tempered_log_softmax() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(_run(logits, 0.7), (logits / 0.7).log_softmax(-1))


def test_top_k_keeps_exactly_k_and_renormalises() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0, -1.0]])
    lp = _run(logits, top_k=2)
    assert torch.isinf(lp[0, [0, 2, 4]]).all()
    torch.testing.assert_close(lp[0, [1, 3]], torch.tensor([3.0, 2.0]).log_softmax(-1))


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    lp = _run(probs.log(), top_p=0.75)  # 0.5 < 0.75, 0.5 + 0.3 >= 0.75: keep two
    assert torch.isfinite(lp[0, :2]).all() and torch.isinf(lp[0, 2:]).all()
    torch.testing.assert_close(lp[0, :2].exp(), torch.tensor([0.625, 0.375]))
    lp = _run(probs.log(), top_p=0.01)  # the most likely token always survives
    assert lp[0, 0] == 0.0 and torch.isinf(lp[0, 1:]).all()


def test_rows_use_their_own_parameters() -> None:
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(1))
    lp = processed_logprobs(
        logits,
        torch.tensor([1.0, 0.5, 1.0]),
        torch.tensor([0, 0, 3]),
        torch.tensor([1.0, 1.0, 1.0]),
    )
    torch.testing.assert_close(lp[0], logits[0].log_softmax(-1))
    torch.testing.assert_close(lp[1], (logits[1] / 0.5).log_softmax(-1))
    assert torch.isfinite(lp[2]).sum() == 3


def test_greedy_rows_report_the_untempered_distribution_and_take_the_argmax() -> None:
    logits = torch.tensor([[0.1, 2.0, 0.3]])
    lp = _run(logits, temperature=0.0, top_k=1)
    torch.testing.assert_close(lp, logits.log_softmax(-1))
    token, logprob = sample_tokens(lp, torch.tensor([True]), [torch.Generator()])
    assert token.tolist() == [1] and float(logprob) == float(lp[0, 1])


def test_sampling_is_seeded_per_row_and_follows_the_distribution() -> None:
    lp = torch.tensor([[0.7, 0.2, 0.1]]).log().repeat(2, 1)
    draw = []
    for _ in range(2):
        gens = [torch.Generator().manual_seed(5), torch.Generator().manual_seed(6)]
        draw.append([sample_tokens(lp, torch.tensor([False, False]), gens)[0].tolist() for _ in range(200)])
    assert draw[0] == draw[1]
    first = [d[0] for d in draw[0]]
    assert 0.6 < first.count(0) / 200 < 0.8


def test_a_rows_draw_does_not_depend_on_the_rest_of_the_batch() -> None:
    logits = torch.randn(4, 1000, generator=torch.Generator().manual_seed(3))
    lp = processed_logprobs(logits, torch.ones(4), torch.zeros(4, dtype=torch.long), torch.full((4,), 0.9))
    alone = [sample_tokens(lp[2:3], torch.tensor([False]), [torch.Generator().manual_seed(7)])[0].item()]
    gens = [torch.Generator().manual_seed(s) for s in (1, 2, 7, 4)]
    batched = sample_tokens(lp, torch.tensor([False] * 4), gens)[0].tolist()
    assert batched[2] == alone[0]


def test_tokens_outside_top_k_are_never_drawn_even_at_the_top_of_the_range() -> None:
    lp = processed_logprobs(
        torch.tensor([[3.0, 1.0, 2.0, 0.5]]), torch.ones(1), torch.tensor([2]), torch.ones(1)
    )  # keeps tokens 0 and 2; the last kept token is 2, followed by -inf entries
    seen = set()
    for seed in range(300):
        token, logprob = sample_tokens(lp, torch.tensor([False]), [torch.Generator().manual_seed(seed)])
        seen.add(token.item())
        assert torch.isfinite(logprob).all()
    assert seen == {0, 2}


def test_a_152k_vocabulary_batch_samples_in_one_pass_per_step() -> None:
    """The whole batch is searched at once: the number of generator draws is one per row (a per-row multinomial
    over the vocabulary cost 5 ms a row on the CPU and held an H100 to 123 tokens/s)."""
    lp = torch.randn(32, 151_936).log_softmax(-1)

    gens = [torch.Generator().manual_seed(i) for i in range(32)]
    states = [g.get_state().clone() for g in gens]
    tokens, logprobs = sample_tokens(lp, torch.zeros(32, dtype=torch.bool), gens)
    for g, state in zip(gens, states, strict=True):
        fresh = torch.Generator()
        fresh.set_state(state)
        torch.rand(1, generator=fresh, dtype=torch.float64)
        assert torch.equal(fresh.get_state(), g.get_state())  # exactly one draw per row
    assert tokens.shape == (32,) and torch.equal(logprobs, lp.gather(1, tokens[:, None]).squeeze(1))


def test_non_finite_logprobs_still_draw_a_token_inside_the_vocabulary() -> None:
    lp = torch.full((2, 5), float("nan"))
    tokens, _ = sample_tokens(lp, torch.tensor([False, False]), [torch.Generator().manual_seed(s) for s in (1, 2)])
    assert ((tokens >= 0) & (tokens < 5)).all()
