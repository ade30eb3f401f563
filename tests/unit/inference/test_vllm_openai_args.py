"""services/inference/vllm_openai.py without an engine: the `vllm serve` flags fleetrl's frontend runs with and
which responses count in the request metrics."""

from __future__ import annotations

import pytest

from fleetrl.services.inference.config import InferenceConfig
from fleetrl.services.inference.vllm_openai import request_outcome, serve_argv


def test_the_frontend_flags_name_the_model_the_served_name_and_the_tool_parser() -> None:
    argv = serve_argv(InferenceConfig(model="/models/tiny"), "/models/tiny")
    assert argv[:4] == ["--model", "/models/tiny", "--served-model-name", "tiny"]
    assert argv[argv.index("--tool-call-parser") + 1] == "hermes" and "--enable-auto-tool-choice" in argv


@pytest.mark.parametrize(
    ("fields", "parser", "auto"),
    [
        ({"tool_call_parser": "llama3_json"}, "llama3_json", True),
        ({"enable_auto_tool_choice": False}, "hermes", False),
        ({"tool_call_parser": None}, None, False),  # auto tool choice needs a parser: left out
        ({"tool_call_parser": ""}, None, False),
    ],
)
def test_tool_parsing_follows_the_config(fields, parser, auto: bool) -> None:
    argv = serve_argv(InferenceConfig(model="/m", served_model_name="policy", **fields), "/m")
    assert (argv[argv.index("--tool-call-parser") + 1] if parser else None) == parser
    assert ("--tool-call-parser" in argv) == (parser is not None)
    assert ("--enable-auto-tool-choice" in argv) == auto
    assert argv[argv.index("--served-model-name") + 1] == "policy"


def test_the_flags_parse_and_validate_as_vllm_serve_would() -> None:
    pytest.importorskip("vllm")
    from fleetrl.services.inference.vllm_openai import serve_args

    args = serve_args(InferenceConfig(model="/m", served_model_name="policy"), "/m")
    assert (args.model, args.served_model_name, args.tool_call_parser) == ("/m", ["policy"], "hermes")
    assert args.enable_auto_tool_choice and args.disable_log_stats and args.api_key is None


@pytest.mark.parametrize(
    ("path", "status", "counted"),
    [
        ("/v1/chat/completions", 200, ("chat", "ok")),
        ("/v1/completions", 400, ("completions", "invalid")),
        ("/v1/chat/completions", 503, ("chat", "error")),
        ("/tokenize", 200, None),
        ("/v1/models", 200, None),
    ],
)
def test_generate_responses_count_by_status(path: str, status: int, counted) -> None:
    assert request_outcome(path, status) == counted
