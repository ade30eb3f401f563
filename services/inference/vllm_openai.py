"""vLLM's own OpenAI serving layer on the VLLMEngine's `AsyncLLM`: one engine, two front doors (fleetrl's gRPC
API through `VLLMEngine.generate`, and the app `vllm serve` would build, with its streaming, tool parsers,
`top_logprobs`, stop strings inside the engine, `response_format`/structured outputs, /tokenize, ...).

    app = await build_vllm_openai_app(config, engine)   # a FastAPI app bound to engine.async_llm

In a LoRA run (max_lora_rank > 0) the served model name maps to the newest adapter version (the engine's
`watch_adapter`), so requests run on the current policy; a response's `model` is that adapter's name,
`fleetrl-v<version>`, as vLLM names a response after the adapter that served it.

http_server.py serves it under uvicorn in the service's event loop (lifespan off: vLLM's lifespan would freeze
the gc heap for the whole process and delete app.state on exit) and wraps it in http_auth.py's middleware (the
run's token, the policy-version headers). VLLM_SERVER_DEV_MODE stays off, so no /pause or /update_weights routes;
the elastic expert-parallel scaling routes are removed.
"""

from __future__ import annotations

import argparse
from typing import Any

from fleetrl.services.inference.config import InferenceConfig

# Routes of vLLM's app that would reconfigure the engine behind fleetrl's back: removed from the app.
_DROPPED_ROUTES = frozenset({"/scale_elastic_ep", "/is_scaling_elastic_ep"})
# The OpenAI routes counted in fleetrl_inference_requests_total{api} (the hf app's names).
_COUNTED_ROUTES = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}


def serve_argv(config: InferenceConfig, model_path: str) -> list[str]:
    """The `vllm serve` flags of the frontend fleetrl runs (engine flags are the VLLMEngine's business)."""
    argv = ["--model", model_path, "--served-model-name", config.model_name]
    if config.tool_call_parser:
        argv += ["--tool-call-parser", config.tool_call_parser]
        if config.enable_auto_tool_choice:
            argv.append("--enable-auto-tool-choice")
    # Stats: the engine runs with disable_log_stats; no request logging, no uvicorn access log, no /docs.
    argv += ["--disable-log-stats", "--disable-uvicorn-access-log", "--disable-fastapi-docs"]
    return argv


def serve_args(config: InferenceConfig, model_path: str) -> argparse.Namespace:
    """The Namespace `vllm serve` would parse and validate for serve_argv (a bare Namespace lacks defaults)."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    args = make_arg_parser(FlexibleArgumentParser()).parse_args(serve_argv(config, model_path))
    validate_parsed_serve_args(args)
    return args


async def build_vllm_openai_app(config: InferenceConfig, engine: Any) -> Any:
    """vLLM's OpenAI FastAPI app with its state initialised on `engine.async_llm` (a started VLLMEngine)."""
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.entrypoints.launchers.app import build_app

    llm = engine.async_llm
    args = serve_args(config, engine.model_path)
    supported_tasks = await llm.get_supported_tasks()
    app = build_app(args, supported_tasks, llm.model_config)
    # The router reads its route list per request: dropping routes works after the middleware stack was built.
    app.router.routes = [r for r in app.router.routes if getattr(r, "path", None) not in _DROPPED_ROUTES]
    await init_app_state(llm, app.state, args, supported_tasks)
    if config.max_lora_rank:
        engine.watch_adapter(_served_adapter(app.state.openai_serving_models, config.model_name))
    return app


def _served_adapter(models: Any, name: str) -> Any:
    """A listener that maps the served model name to the newest adapter version in vLLM's model registry: vLLM
    looks a request's `model` up in `lora_requests` before the base models, so requests naming the model run on
    the current policy (no entry: on the full weights)."""

    def point(lora_request: Any) -> None:
        if lora_request is None:
            models.lora_requests.pop(name, None)
        else:
            models.lora_requests[name] = lora_request

    return point


def request_outcome(path: str, status: int) -> tuple[str, str] | None:
    """(api, outcome) to count for a response of vLLM's app, as the hf app counts its requests; None = not a
    generate route. Outcome by status: ok (< 400), invalid (4xx), error (5xx). A streaming response counts as it
    starts (200), so an error later in the stream is not seen here."""
    api = _COUNTED_ROUTES.get(path)
    if api is None:
        return None
    return api, "ok" if status < 400 else "invalid" if status < 500 else "error"
