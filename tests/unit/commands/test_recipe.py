"""The recipes' shared command line: flags and defaults, config precedence (--set last), --write-rows, up options."""

from __future__ import annotations

import argparse
import json

import pytest

from fleetrl import Config, ConfigError
from fleetrl.commands.recipe import add_rows_args, add_run_args, add_up_args, recipe_config, up_options, write_rows

DEFAULTS = {"completions_per_prompt": 4, "max_completion_tokens": 16, "max_seq_len": 256, "kl_beta": 0.0}


def parser(*, steps: int = 20, num_rows: int = 512) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    add_run_args(p, log_path="runs/recipe", steps=steps)
    add_rows_args(p, data_help="JSONL rows", num_rows=num_rows)
    add_up_args(p)
    return p


def test_defaults_of_every_flag():
    args = parser().parse_args(["--model", "m"])
    assert vars(args) == {
        "model": "m",
        "steps": 20,
        "log_path": "runs/recipe",
        "data": None,
        "num_rows": 512,
        "write_rows": None,
        "engine": "hf",
        "inference_args": "",
        "trainer_args": "",
        "set": [],
        "resume": False,
        "overwrite": False,
    }


def test_recipe_defaults_and_flags_parse():
    argv = ["--model", "m", "--steps", "3", "--log-path", "x", "--data", "d.jsonl", "--num-rows", "7"]
    argv += ["--write-rows", "out.jsonl", "--engine", "vllm", "--set", "a=1", "--set", "b=2"]
    args = parser(steps=100, num_rows=1024).parse_args(argv)
    assert (args.steps, args.log_path, args.data, args.num_rows, args.write_rows) == (3, "x", "d.jsonl", 7, "out.jsonl")
    assert (args.engine, args.set) == ("vllm", ["a=1", "b=2"])
    defaults = parser(steps=100, num_rows=1024).parse_args(["--model", "m"])
    assert (defaults.steps, defaults.num_rows) == (100, 1024)


def test_help_texts(capsys):
    p = argparse.ArgumentParser()
    add_rows_args(p, data_help="my rows", num_rows_help="how many", write_rows_help="dump them")
    add_up_args(p)
    with pytest.raises(SystemExit) as exc:
        p.parse_args(["--help"])
    assert exc.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    for text in ("my rows", "how many", "--write-rows PATH dump them", "inference engine (vllm on a GPU)"):
        assert text in out
    assert "--set KEY=VALUE any Config field" in out


def test_bad_engine_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        parser().parse_args(["--model", "m", "--engine", "sglang"])
    assert exc.value.code == 2
    assert "invalid choice: 'sglang'" in capsys.readouterr().err


def test_config_takes_defaults_then_flags():
    cfg = recipe_config(parser().parse_args(["--model", "m", "--steps", "3", "--log-path", "x"]), DEFAULTS)
    assert (cfg.base_model, cfg.max_steps, cfg.log_path) == ("m", 3, "x")
    assert (cfg.completions_per_prompt, cfg.max_seq_len) == (4, 256)
    assert isinstance(cfg, Config)


def test_fields_win_over_defaults_and_flags():
    args = parser().parse_args(["--model", "m", "--log-path", "x"])
    cfg = recipe_config(args, DEFAULTS, max_seq_len=512, log_path="y", rollout_extras={"k": 1})
    assert (cfg.max_seq_len, cfg.log_path, cfg.rollout_extras) == (512, "y", {"k": 1})


def test_set_wins_over_everything_and_parses_toml_values():
    argv = ["--model", "m", "--steps", "3", "--set", "max_steps=9", "--set", "max_seq_len=1024"]
    argv += ["--set", "base_model=other", "--set", "rollout_extras={k = 2}", "--set", "dtype=bfloat16"]
    cfg = recipe_config(parser().parse_args(argv), DEFAULTS, max_seq_len=512, rollout_extras={"k": 1})
    assert (cfg.max_steps, cfg.max_seq_len, cfg.base_model) == (9, 1024, "other")
    assert (cfg.rollout_extras, cfg.dtype) == ({"k": 2}, "bfloat16")


def test_set_last_one_wins():
    args = parser().parse_args(["--model", "m", "--set", "seed=1", "--set", "seed=2"])
    assert recipe_config(args, DEFAULTS).seed == 2


def test_set_without_equals_raises_config_error():
    args = parser().parse_args(["--model", "m", "--set", "seed"])
    with pytest.raises(ConfigError, match=r"override 'seed' must look like key=value"):
        recipe_config(args, DEFAULTS)


@pytest.mark.parametrize(
    ("sets", "fields", "match", "source"),
    [
        (["completions_per_prompt=1"], {}, "completions_per_prompt must be >= 2", "train.py"),
        (["no_such_field=1"], {}, "no_such_field: unknown field", "--set"),
        (["max_step=3"], {}, "max_step: unknown field, did you mean max_steps[?]", "--set"),
        ([], {"max_seq_len": 1}, "max_seq_len", "train.py"),
    ],
)
def test_invalid_config_raises_config_error_blaming_its_source(sets, fields, match, source):
    # A bad --set is the flag's fault, not train.py's.
    argv = ["--model", "m"] + [arg for s in sets for arg in ("--set", s)]
    with pytest.raises(ConfigError, match=match) as exc:
        recipe_config(parser().parse_args(argv), DEFAULTS, **fields)
    assert str(exc.value).startswith(f"{source}: invalid config")


def test_defaults_are_not_modified():
    before = dict(DEFAULTS)
    recipe_config(parser().parse_args(["--model", "m", "--set", "max_seq_len=128"]), DEFAULTS, kl_beta=0.1)
    assert before == DEFAULTS


def test_write_rows_makes_folders_and_writes_jsonl(tmp_path, capsys):
    rows = [{"question": "1 + 1", "answer": "2"}, {"prompt_tokens": [1, 2, 3], "answer": "é"}]
    path = tmp_path / "a" / "b" / "rows.jsonl"
    write_rows(str(path), rows)
    lines = path.read_text().splitlines()
    assert [json.loads(line) for line in lines] == rows
    assert path.read_text().endswith("\n")
    assert capsys.readouterr().out == f"wrote 2 rows to {path}\n"


def test_write_rows_empty_and_overwrite(tmp_path, capsys):
    path = tmp_path / "rows.jsonl"
    path.write_text("old\n")
    write_rows(path, [])
    assert path.read_text() == ""
    assert capsys.readouterr().out == f"wrote 0 rows to {path}\n"


def test_up_options_split_like_a_shell():
    argv = ["--model", "m", "--engine", "vllm", "--inference-args", "--dtype bfloat16 --name 'a b'"]
    argv += ["--trainer-args", "--device cuda"]
    assert up_options(parser().parse_args(argv)) == {
        "engine": "vllm",
        "inference_args": ["--dtype", "bfloat16", "--name", "a b"],
        "trainer_args": ["--device", "cuda"],
        "resume": False,
        "overwrite": False,
    }


def test_up_options_defaults_are_empty():
    assert up_options(parser().parse_args(["--model", "m"])) == {
        "engine": "hf",
        "inference_args": [],
        "trainer_args": [],
        "resume": False,
        "overwrite": False,
    }


def test_resume_and_overwrite_go_to_fleetrl_main_and_exclude_each_other(capsys):
    options = up_options(parser().parse_args(["--model", "m", "--resume"]))
    assert (options["resume"], options["overwrite"]) == (True, False)
    with pytest.raises(SystemExit):
        parser().parse_args(["--model", "m", "--resume", "--overwrite"])
    assert "not allowed with argument" in capsys.readouterr().err
