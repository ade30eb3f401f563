"""Custom losses by import path: the contract (inputs, takes_over), the checks at start naming `policy_loss`, and
functions given to Config turned into import paths."""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch
from pydantic import ValidationError

from fleetrl import Config
from fleetrl.losses import loss_import_path, policy_loss, resolve_loss_settings
from fleetrl.losses.custom import load_custom_loss
from tests.unit.losses import custom_losses
from tests.unit.losses.helpers import run_loss, t

PATH = "tests.unit.losses.custom_losses"


@pytest.fixture
def batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    old = -torch.rand(3, 4, generator=g, dtype=torch.float64) - 0.2
    return {
        "pi": old + 0.3 * torch.randn(3, 4, generator=g, dtype=torch.float64),
        "old": old,
        "inf": old + 0.5 * torch.randn(3, 4, generator=g, dtype=torch.float64),
        "adv": t([1.0, -0.5, 2.0]),
        "mask": t([[0, 1, 1, 1], [0, 0, 1, 1], [1, 1, 1, 0]]),
        "ref": old + 0.1,
    }


@pytest.mark.parametrize("spec", [f"{PATH}:grpo_copy", f"{PATH}.grpo_copy"])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "sum"])
def test_a_copy_of_grpo_by_import_path_equals_the_builtin(batch, spec, agg) -> None:
    b = batch
    settings = {"loss_agg_mode": agg, "kl_beta": 0.1, "tis_cap": 1.2, "eps_clip": 0.1}
    builtin = run_loss("grpo", b["pi"], b["old"], b["inf"], b["adv"], b["mask"], b["ref"], **settings)
    custom = run_loss(spec, b["pi"], b["old"], b["inf"], b["adv"], b["mask"], b["ref"], **settings)
    assert torch.equal(custom.loss, builtin.loss)
    assert torch.equal(custom.grad, builtin.grad)
    assert custom.metrics == builtin.metrics
    assert builtin.metrics["clip_frac"] > 0 and builtin.metrics["tis_clip_frac"] > 0  # the clips were exercised


def test_a_loss_that_takes_over_aggregation_returns_the_scalar_fleetrl_uses(batch) -> None:
    b = batch
    builtin = run_loss("ppo", b["pi"], b["old"], b["inf"], b["adv"], b["mask"], loss_agg_mode="token-mean")
    # loss_agg_mode "sum" is ignored: the loss aggregates itself (token-mean), so the results are ppo's.
    custom = run_loss(f"{PATH}:ppo_token_mean", b["pi"], b["old"], b["inf"], b["adv"], b["mask"], loss_agg_mode="sum")
    torch.testing.assert_close(custom.loss, builtin.loss, rtol=0, atol=1e-15)
    torch.testing.assert_close(custom.grad, builtin.grad, rtol=0, atol=1e-15)

    worst = run_loss(f"{PATH}:worst_sequence", b["pi"], b["old"], b["inf"], b["adv"], b["mask"])
    per_seq = ((-b["adv"][:, None] * b["pi"] * b["mask"]).sum(-1) / b["mask"].sum(-1)).max()
    torch.testing.assert_close(worst.loss, per_seq)
    assert int((worst.grad != 0).any(dim=-1).sum()) == 1  # only the worst sequence gets a gradient


def test_without_takes_over_the_loss_sees_fleetrls_tis_weights_and_with_it_the_raw_ones(batch) -> None:
    b = batch
    custom_losses.SEEN.clear()
    run_loss(f"{PATH}:recording", b["pi"], b["old"], b["inf"], b["adv"], b["mask"], tis_cap=1.1)
    run_loss(f"{PATH}:recording_tis", b["pi"], b["old"], b["inf"], b["adv"], b["mask"], tis_cap=1.1)
    calls = [x for x in custom_losses.SEEN if x.mask.shape == (3, 4)]  # not the trial calls at resolve
    capped, raw = calls[0].tis_weights, calls[1].tis_weights
    keep = b["mask"].bool()
    expected_raw = torch.where(keep, torch.exp(b["old"] - b["inf"]), 1.0)
    torch.testing.assert_close(raw, expected_raw)
    torch.testing.assert_close(capped, expected_raw.clamp(max=1.1))
    assert bool((raw > 1.1).any())


def test_versions_reach_the_loss_masked_and_are_none_when_not_given(batch) -> None:
    b = batch
    versions = torch.tensor([[9, 4, 5, 5], [9, 9, 6, 7], [1, 2, 3, 9]])
    custom_losses.SEEN.clear()
    logprobs = b["pi"].clone().requires_grad_(True)
    _, metrics = policy_loss(f"{PATH}:recording", logprobs, b["old"], b["inf"], b["adv"], b["mask"], versions=versions)
    seen = custom_losses.SEEN[-1].versions
    assert seen.tolist() == [[-1, 4, 5, 5], [-1, -1, 6, 7], [1, 2, 3, -1]]
    assert metrics["version_mean"] == pytest.approx((4 + 5 + 5 + 6 + 7 + 1 + 2 + 3) / 8)
    with pytest.raises(ValueError, match="versions has shape"):
        policy_loss("grpo", logprobs, b["old"], b["inf"], b["adv"], b["mask"], versions=versions[:, :2])


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("tests.unit.losses.no_such_module:fn", "cannot import module 'tests.unit.losses.no_such_module'"),
        (f"{PATH}:missing", "has no attribute 'missing'"),
        (f"{PATH}:NOT_CALLABLE", "names a int, not a function"),
        (f"{PATH}:wrong_shape", r"returned loss_BT of shape \(2,\); it must be \[B, T\] = \[2, 3\]"),
        (f"{PATH}:returns_tuple", "returned a tuple; a loss returns fleetrl.losses.TokenLoss"),
        (f"{PATH}:raises", "raised RuntimeError: boom"),
        (f"{PATH}:no_gradient", "no gradient with respect to inputs.logprobs"),
        (f"{PATH}:takes_over_unknown", r"takes_over has \['optimizer'\]"),
        (f"{PATH}:aggregation_not_scalar", r"it must be a 0-dim scalar \(it takes over aggregation\)"),
        ("not a path", "unknown policy loss 'not a path'"),
    ],
)
def test_a_bad_custom_loss_fails_at_resolve_naming_policy_loss(spec, message) -> None:
    with pytest.raises(ValueError, match=message) as info:
        resolve_loss_settings(spec)
    assert str(info.value).startswith("policy_loss")


def test_a_loss_in_a_file_is_named_by_its_path(tmp_path, batch) -> None:
    path = tmp_path / "my_loss.py"
    path.write_text(
        textwrap.dedent(
            """
            from fleetrl.losses import TokenLoss

            def reinforce(x, s):
                return TokenLoss(-x.advantages_B1 * x.logprobs)
            """
        )
    )
    b = batch
    custom = run_loss(f"{path}:reinforce", b["pi"], b["old"], b["inf"], b["adv"], b["mask"])
    builtin = run_loss("reinforce", b["pi"], b["old"], b["inf"], b["adv"], b["mask"])
    assert torch.equal(custom.loss, builtin.loss) and torch.equal(custom.grad, builtin.grad)


def test_config_turns_a_module_level_function_into_its_import_path() -> None:
    cfg = Config(policy_loss=custom_losses.grpo_copy)
    assert cfg.policy_loss == f"{PATH}:grpo_copy"
    assert load_custom_loss(cfg.policy_loss) is custom_losses.grpo_copy
    cfg.policy_loss = custom_losses.recording  # validate_assignment: the same conversion
    assert cfg.policy_loss == f"{PATH}:recording"


def test_a_function_of_the_running_script_becomes_the_scripts_path(monkeypatch) -> None:
    main = sys.modules["__main__"]
    if not getattr(main, "__file__", None):
        monkeypatch.setattr(main, "__file__", "/somewhere/train.py", raising=False)

    def script_loss(x, s):  # stands for a function defined at the top of `python train.py`
        return custom_losses.recording(x, s)

    script_loss.__module__ = "__main__"
    script_loss.__qualname__ = "script_loss"
    monkeypatch.setattr(main, "script_loss", script_loss, raising=False)
    spec = loss_import_path(script_loss)
    assert spec.endswith(".py:script_loss") and spec.startswith("/")


def _closure_loss():
    def inner(x, s):
        return custom_losses.recording(x, s)

    return inner


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (lambda x, s: None, "is a lambda, which cannot reach the trainer process"),
        (_closure_loss(), "is a function defined inside another function, which cannot reach the trainer"),
        (42, "Input should be a valid string"),
    ],
)
def test_a_function_the_trainer_cannot_import_fails_at_config_naming_policy_loss(value, message) -> None:
    with pytest.raises(ValidationError, match=message) as info:
        Config(policy_loss=value)
    assert info.value.errors()[0]["loc"] == ("policy_loss",)


def test_main_refuses_a_lambda_loss_at_start_naming_policy_loss(tmp_path, capsys) -> None:
    import fleetrl

    cfg = Config(base_model=str(tmp_path / "model"), log_path=str(tmp_path / "run"))
    summary = fleetrl.main(cfg, "rollout.py:make_rollout_fn", policy_loss=lambda x, s: None)
    assert summary["exit_code"] == 2
    err = capsys.readouterr().err
    assert "policy_loss" in err and "is a lambda, which cannot reach the trainer process" in err
    assert not (tmp_path / "run").exists()  # refused before anything started or was written
