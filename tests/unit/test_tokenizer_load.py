"""The gateway's tokenizer and vocabulary size without importing torch (issue 40 item 1: `AutoTokenizer` and
`AutoConfig` import the auto-model registry and torch, about 4 s of CPU in every gateway while the trainer and the
replicas start on the same cores): the same tokenizer as AutoTokenizer's, AutoTokenizer itself when the class is not
certain, and a gateway built in a fresh process that never imports torch."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from transformers import AutoConfig, AutoTokenizer

from fleetrl.tokenizer_load import config_vocab_size, load_tokenizer, own_tokenizer_class

TEXTS = ["12+30=", "hello world", " leading space and\nnewline", "<|im_start|>user\nhi<|im_end|>", "ünïcödé ✓"]


def same_tokenizer(a: Any, b: Any) -> None:
    assert type(a) is type(b)
    assert len(a) == len(b) and a.all_special_tokens == b.all_special_tokens
    assert (a.eos_token_id, a.pad_token_id, a.bos_token_id) == (b.eos_token_id, b.pad_token_id, b.bos_token_id)
    for text in TEXTS:
        assert a(text)["input_ids"] == b(text)["input_ids"], text
        assert a.decode(a(text)["input_ids"]) == b.decode(b(text)["input_ids"])
    messages = [{"role": "user", "content": "1+2="}]
    assert a.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == b.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )


def test_the_tokenizer_is_autotokenizers(tiny_model_dir: str) -> None:
    assert own_tokenizer_class(tiny_model_dir) is not None, "the tiny model's class should be certain"
    same_tokenizer(load_tokenizer(tiny_model_dir), AutoTokenizer.from_pretrained(tiny_model_dir))
    assert config_vocab_size(tiny_model_dir) == AutoConfig.from_pretrained(tiny_model_dir).vocab_size


def test_what_is_not_certain_goes_through_autotokenizer(tiny_model_dir: str, tmp_path: Path) -> None:
    """A generic class, another model's class, remote code or a missing file: AutoTokenizer decides, as before."""
    cases = {
        "generic": {"tokenizer_class": "PreTrainedTokenizerFast"},
        "other_model": {"tokenizer_class": "LlamaTokenizer"},
        "remote_code": {"auto_map": {"AutoTokenizer": ["x.Tok", None]}},
        "no_class": {"tokenizer_class": None},
    }
    for name, change in cases.items():
        folder = tmp_path / name
        shutil.copytree(tiny_model_dir, folder)
        config = json.loads((folder / "tokenizer_config.json").read_text())
        config.update(change)
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
        assert own_tokenizer_class(folder) is None, name
        if name != "remote_code":  # AutoTokenizer would ask to trust remote code
            same_tokenizer(load_tokenizer(folder), AutoTokenizer.from_pretrained(str(folder)))
    assert own_tokenizer_class(tmp_path / "no-such-folder") is None


def test_a_config_without_vocab_size_asks_autoconfig(tiny_model_dir: str, tmp_path: Path) -> None:
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    vocab = config.pop("vocab_size")
    (folder / "config.json").write_text(json.dumps(config))
    assert config_vocab_size(folder) == AutoConfig.from_pretrained(str(folder)).vocab_size
    assert vocab > 0


PROBE = """
import json, sys
from fleetrl.config import Config
from fleetrl.gateway.config import GatewayConfig
from fleetrl.gateway.run import build_gateway
run = Config(base_model=sys.argv[1], dataset="unused", completions_per_prompt=2)
gateway = build_gateway(GatewayConfig(run=run, rollout="unused:unused", ready_file=sys.argv[2]), lambda setup: None)
print(json.dumps({"torch": "torch" in sys.modules, "vocab": gateway.tokenizer is not None and len(gateway.tokenizer)}))
"""


def test_a_gateway_builds_without_importing_torch(tiny_model_dir: str, tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, tiny_model_dir, str(tmp_path / "ready.json")],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["vocab"] == len(AutoTokenizer.from_pretrained(tiny_model_dir))
    assert out["torch"] is False, "building a gateway imported torch"


JUDGE_PROBE = """
import json, sys
from fleetrl.config import Config
from fleetrl.gateway.config import GatewayConfig
from fleetrl.gateway.judge import load_judge_tokenizer
run = Config(base_model=sys.argv[1], dataset="unused", completions_per_prompt=2)
config = GatewayConfig(run=run, rollout="unused:unused", judge=["127.0.0.1:1"], judge_model=sys.argv[1])
tokenizer = load_judge_tokenizer(config, None)
print(json.dumps({"torch": "torch" in sys.modules, "ids": tokenizer("12+30=")["input_ids"]}))
"""


def test_the_judge_tokenizer_loads_without_importing_torch(tiny_model_dir: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", JUDGE_PROBE, tiny_model_dir],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["ids"] == AutoTokenizer.from_pretrained(tiny_model_dir)("12+30=")["input_ids"]
    assert out["torch"] is False, "loading the judge's tokenizer imported torch"
