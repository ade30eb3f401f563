"""examples/custom_loss: its loss on hand-computed vectors (kept tokens get -clip(r) * A, clipped and stale tokens
nothing), and its run.toml names it by an import path the trainer's start-up check accepts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fleetrl import Config
from fleetrl.losses import resolve_loss_settings
from tests.unit.losses.helpers import from_ratios, run_loss, t

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "custom_loss"


@pytest.fixture
def on_path(monkeypatch: pytest.MonkeyPatch) -> str:
    """The example's folder on sys.path, as `fleetrl up` puts it on the trainer's PYTHONPATH."""
    monkeypatch.syspath_prepend(str(EXAMPLE))
    return "my_losses:clipped_ratio"


def test_kept_tokens_get_minus_clipped_ratio_times_advantage_and_the_others_nothing(on_path) -> None:
    old = t([[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]])
    # Sample 0 (A = +1): r = 1.1 kept, 1.5 clipped above (1 + 0.28), 0.5 kept with clip(r) = 0.8.
    # Sample 1 (A = -1): r = 0.5 clipped below (1 - 0.2), 1.5 kept with clip(r) = 1.28, 1.0 kept.
    pi = from_ratios(old, [[1.1, 1.5, 0.5], [0.5, 1.5, 1.0]])
    adv, mask = t([1.0, -1.0]), t([[1, 1, 1], [1, 1, 1]])
    run = run_loss(on_path, pi, old, old, adv, mask, eps_clip=0.2, eps_clip_high=0.28, loss_agg_mode="sum")
    expected = t([[-1.1, 0.0, -0.8], [0.0, 1.28, 1.0]])
    torch.testing.assert_close(run.grad, expected)
    assert run.metrics["clip_frac"] == pytest.approx(2 / 6)
    assert run.metrics["stale_frac"] == 0.0  # no versions given


def test_tokens_more_than_two_versions_stale_get_no_gradient(on_path) -> None:
    from fleetrl.losses import policy_loss

    old = t([[-1.0, -1.0, -1.0]])
    logprobs = old.clone().requires_grad_(True)
    versions = torch.tensor([[5, 3, 2]])  # newest 5: lags 0, 2 (kept), 3 (stale)
    loss, metrics = policy_loss(on_path, logprobs, old, old, t([1.0]), t([[1, 1, 1]]), versions=versions)
    loss.backward()
    torch.testing.assert_close(logprobs.grad, t([[-1 / 3, -1 / 3, 0.0]]))
    assert metrics["stale_frac"] == pytest.approx(1 / 3)


def test_run_toml_names_the_loss_by_an_import_path_the_trainer_accepts(on_path) -> None:
    cfg = Config.from_toml(EXAMPLE / "run.toml")
    assert cfg.policy_loss == on_path
    settings = resolve_loss_settings(cfg.policy_loss, cfg)  # what PolicyTrainer runs at start (trial call included)
    assert (settings.eps_clip, settings.eps_clip_high) == (0.2, 0.28)
