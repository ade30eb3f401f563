"""SFT on the RL trainer (issue 44 item 2): rows rendered with the loss on completion tokens only, bad rows dropped
and counted by reason (never truncated), the trainer's loss equal to the completion NLL and the same packed and
padded, and `fleetrl sft CONFIG` end to end."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from fleetrl.commands.main import main as fleetrl_main
from fleetrl.rollout_group import RolloutGroup
from fleetrl.trainer.model import load_causal_lm
from fleetrl.trainer.policy_trainer import PolicyTrainer
from fleetrl.trainer.sft import (
    RowDropped,
    batches,
    completion_nll,
    examples_of,
    load_examples,
    render_row,
    trainer_config,
)

from .helpers import make_cfg


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_a_prompt_completion_row_trains_on_the_completion_and_end_of_text_only(tokenizer):
    example = render_row({"prompt": "3 + 4 =", "completion": " 7"}, tokenizer)
    prompt = tokenizer.encode("3 + 4 =")
    completion = [*tokenizer.encode(" 7", add_special_tokens=False), tokenizer.eos_token_id]
    assert example.tokens == prompt + completion
    assert example.loss_mask == [0] * len(prompt) + [1] * len(completion)


def test_a_chat_row_trains_on_every_assistant_message_as_the_template_renders_it(tokenizer):
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "2 + 2?"},
        {"role": "assistant", "content": "4"},
    ]
    example = render_row({"messages": messages}, tokenizer)
    assert example.tokens == list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"])
    trained = [t for t, m in zip(example.tokens, example.loss_mask, strict=True) if m]
    text = tokenizer.decode(trained)
    assert "hello" in text and "4" in text and "hi" not in text and "2 + 2?" not in text
    # the user's turns and the assistant headers are not trained
    before_first = tokenizer.apply_chat_template(messages[:1], add_generation_prompt=True, return_dict=True)[
        "input_ids"
    ]
    assert not any(example.loss_mask[: len(before_first)])


@pytest.mark.parametrize(
    ("row", "reason"),
    [
        ({"prompt": "1 + 1 =", "completion": "  "}, "empty_completion"),
        ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}]}, "empty_completion"),
        ({"messages": [{"role": "user", "content": "hi"}]}, "empty_completion"),
        ({"prompt": "1 + 1 =", "completion": " 2" * 100}, "too_long"),
        ({"prompt": 3, "completion": "x"}, "malformed"),
        ({"text": "no fields"}, "malformed"),
        ([1, 2], "malformed"),
        ({"messages": [{"role": "user"}]}, "malformed"),
    ],
)
def test_a_bad_row_is_refused_with_its_reason(tokenizer, row, reason):
    with pytest.raises(RowDropped) as info:
        render_row(row, tokenizer, max_seq_len=64)
    assert info.value.reason == reason


def test_a_template_that_cannot_render_or_rewrites_history_drops_the_row(tiny_model_dir):
    raising = AutoTokenizer.from_pretrained(tiny_model_dir)
    raising.chat_template = "{{ raise_exception('no system role') }}"
    row = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    with pytest.raises(RowDropped, match="cannot render") as info:
        render_row(row, raising)
    assert info.value.reason == "template"
    last_only = AutoTokenizer.from_pretrained(tiny_model_dir)  # renders only the newest message
    last_only.chat_template = "{{ messages[-1]['content'] }}{% if add_generation_prompt %}>{% endif %}"
    two = {"messages": [*row["messages"], {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]}
    with pytest.raises(RowDropped, match="not a prefix") as info:
        render_row(two, last_only)
    assert info.value.reason == "template"


def test_a_dataset_keeps_the_good_rows_and_counts_the_bad_by_reason(tmp_path, tokenizer):
    path = tmp_path / "rows.jsonl"
    lines = [
        json.dumps({"prompt": "1 + 1 =", "completion": " 2"}),
        json.dumps({"prompt": "1 + 2 =", "completion": ""}),
        "{not json",
        "",
        json.dumps({"prompt": "1 + 3 =", "completion": " 4" * 100}),
        json.dumps({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]}),
    ]
    path.write_text("\n".join(lines) + "\n")
    examples, dropped = load_examples(path, tokenizer, max_seq_len=64)
    assert len(examples) == 2
    assert dropped == {"empty_completion": 1, "malformed": 1, "too_long": 1}
    assert all(len(e.tokens) <= 64 for e in examples)  # dropped, never cut to fit
    with pytest.raises(FileNotFoundError, match=r"sft\.dataset"):
        load_examples(tmp_path / "missing.jsonl", tokenizer)


def test_batches_cover_every_example_once_per_epoch():
    got = [b for _, b in zip(range(3), batches(4, 4, seed=0), strict=False)]
    assert all(sorted(b) == [0, 1, 2, 3] for b in got)
    assert [b for _, b in zip(range(2), batches(3, 2, seed=0, shuffle=False), strict=False)] == [[0, 1], [2, 0]]


def sft_groups(tokenizer, first_row: int = 0) -> list[RolloutGroup]:
    rows = [
        {"prompt": "12 + 30 =", "completion": " 42"},
        {"prompt": "7 + 8 =", "completion": " 15 and a longer answer"},
        {"messages": [{"role": "user", "content": "name?"}, {"role": "assistant", "content": "fleetrl"}]},
    ]
    return [
        RolloutGroup(first_row + i, 0, [example.to_sample()]) for i, example in enumerate(examples_of(rows, tokenizer))
    ]


def reference_nll(model_dir: str, groups: list[RolloutGroup]) -> float:
    """The completion NLL of the batch by a plain padded forward of the untouched model."""
    model = load_causal_lm(model_dir, trainable=False)
    samples = [g.samples[0] for g in groups]
    width = max(len(s.tokens) for s in samples)
    tokens = torch.zeros(len(samples), width, dtype=torch.long)
    mask = torch.zeros(len(samples), width)
    for i, s in enumerate(samples):
        tokens[i, : len(s.tokens)] = torch.tensor(s.tokens)
        mask[i, : len(s.tokens)] = torch.tensor(s.loss_mask, dtype=torch.float32)
    with torch.no_grad():
        logits = model(input_ids=tokens[:, :-1]).logits
    logprobs = torch.log_softmax(logits.float(), -1).gather(-1, tokens[:, 1:, None])[..., 0]
    return float(completion_nll(logprobs, mask[:, 1:]))


def one_step(tiny_model_dir: str, log_path: Path, groups: list[RolloutGroup], packing: bool):
    cfg = trainer_config(make_cfg(tiny_model_dir, log_path, packing=packing, max_head_offpolicy_versions=0))
    trainer = PolicyTrainer(cfg, refuse_stale=False, total_steps=1)
    try:
        result = trainer.train_step(groups)
        weights = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    finally:
        trainer.close()
    return result, weights


def test_the_trainers_sft_loss_is_the_completion_nll_and_the_same_packed_and_padded(
    tiny_model_dir, tokenizer, tmp_path
):
    groups = sft_groups(tokenizer)
    expected = reference_nll(tiny_model_dir, groups)
    packed, packed_weights = one_step(tiny_model_dir, tmp_path / "packed", groups, packing=True)
    padded, padded_weights = one_step(tiny_model_dir, tmp_path / "padded", groups, packing=False)
    assert packed.row_ids == [0, 1, 2] and packed.skipped_row_ids == []  # groups of one train (advantage 1)
    assert packed.metrics["train/loss"] == pytest.approx(expected, rel=1e-4)
    assert padded.metrics["train/loss"] == pytest.approx(expected, rel=1e-4)
    # One AdamW step at lr 1e-3 moves a weight by up to ~1e-3; packed and padded agree to 1 % of that (Adam's
    # g / sqrt(v) amplifies the last bits of a near-zero gradient, so a tighter bound would test rounding).
    start = load_causal_lm(tiny_model_dir, trainable=False).state_dict()
    moved = max(float((packed_weights[k] - v).abs().max()) for k, v in start.items() if k in packed_weights)
    assert moved > 5e-4
    for name, value in packed_weights.items():
        torch.testing.assert_close(value, padded_weights[name], rtol=0, atol=1e-5)


def test_prompt_tokens_get_no_gradient(tokenizer):
    example = render_row({"prompt": "5 + 5 =", "completion": " 10"}, tokenizer)
    logprobs = torch.full((1, len(example.tokens) - 1), -2.0, requires_grad=True)
    mask = torch.tensor([example.loss_mask[1:]], dtype=torch.float32)
    completion_nll(logprobs, mask).backward()
    assert torch.equal(logprobs.grad != 0, mask.bool())


def write_config(tmp_path: Path, model_dir: str, dataset: Path, **sft: object) -> Path:
    path = tmp_path / "sft.toml"
    sft_lines = "\n".join(f"{k} = {json.dumps(v)}" for k, v in {"dataset": str(dataset), **sft}.items())
    path.write_text(
        f"""[run]
base_model = {json.dumps(model_dir)}
log_path = {json.dumps(str(tmp_path / "run"))}
max_steps = 3
learning_rate = 1e-3
max_seq_len = 48
max_completion_tokens = 8

[sft]
{sft_lines}
"""
    )
    return path


def test_fleetrl_sft_trains_counts_bad_rows_and_exports(tmp_path, tiny_model_dir, capsys):
    dataset = tmp_path / "rows.jsonl"
    good = [{"prompt": f"{a} + {a} =", "completion": f" {2 * a}"} for a in range(8)]
    bad = [{"prompt": "x", "completion": ""}, {"prompt": "y", "completion": " 1" * 60}]
    dataset.write_text("".join(json.dumps(r) + "\n" for r in [*good, *bad]))
    config = write_config(tmp_path, tiny_model_dir, dataset, batch_size=4)
    assert fleetrl_main(["sft", str(config)]) == 0
    out = capsys.readouterr().out
    assert "3 steps on 8 rows (dropped: 1 empty_completion, 1 too_long)" in out
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "train/loss" in r]
    assert len(steps) == 3 and all(math.isfinite(r["train/loss"]) for r in steps)
    assert steps[-1]["sft/rows_dropped/too_long"] == 1.0
    exported = tmp_path / "run" / "final"
    assert (exported / "config.json").is_file()
    load_causal_lm(str(exported), trainable=False)  # loadable by inference


@pytest.mark.parametrize(
    ("extra", "argv", "field"),
    [
        ({"batch_size": 0}, [], "sft.batch_size"),
        ({"batchsize": 4}, [], "sft.batchsize"),
        ({}, ["--set", "learning_rate=-1"], "learning_rate"),
    ],
)
def test_a_bad_config_fails_at_start_naming_the_field(tmp_path, tiny_model_dir, capsys, extra, argv, field):
    config = write_config(tmp_path, tiny_model_dir, tmp_path / "rows.jsonl", **extra)
    assert fleetrl_main(["sft", str(config), *argv]) == 2
    assert field in capsys.readouterr().err


def test_a_dataset_with_no_trainable_row_fails_naming_it(tmp_path, tiny_model_dir, capsys):
    dataset = tmp_path / "rows.jsonl"
    dataset.write_text(json.dumps({"prompt": "x", "completion": ""}) + "\n")
    assert fleetrl_main(["sft", str(write_config(tmp_path, tiny_model_dir, dataset))]) == 2
    assert "sft.dataset: no trainable row" in capsys.readouterr().err


def test_fleetrl_sft_trains_a_lora_adapter(tmp_path, tiny_model_dir, capsys):
    dataset = tmp_path / "rows.jsonl"
    dataset.write_text(
        "".join(json.dumps({"prompt": f"{a} + 1 =", "completion": f" {a + 1}"}) + "\n" for a in range(6))
    )
    config = write_config(tmp_path, tiny_model_dir, dataset, batch_size=3)
    assert fleetrl_main(["sft", str(config), "--set", "lora_rank=4", "--set", "max_steps=2"]) == 0
    assert "2 steps on 6 rows (dropped: none)" in capsys.readouterr().out
    assert (tmp_path / "run" / "final" / "adapter_config.json").is_file()  # a LoRA run exports its adapter


def test_the_shipped_sft_config_loads_both_tables():
    from fleetrl.commands.sft import load_config

    repo = Path(__file__).resolve().parents[3]
    cfg, settings = load_config(str(repo / "examples" / "arithmetic" / "sft.toml"), ["sft.batch_size=8"])
    assert cfg.max_steps == 2000 and cfg.lr_schedule == "linear" and cfg.shuffle is False
    assert settings.batch_size == 8 and settings.dataset.endswith("sft.jsonl")
