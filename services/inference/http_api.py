"""OpenAI-compatible HTTP API of the inference server (FastAPI + uvicorn), so agent frameworks can point
`base_url` at fleetrl.

Routes: GET /v1/models, POST /v1/completions (text or token-id prompts), POST /v1/chat/completions (the
tokenizer's chat template). No streaming. Besides the OpenAI fields every choice carries `token_ids`,
`token_logprobs` (per generated token, under the distribution sampled from), `versions` (policy version per
token) and `prompt_token_ids`. Extra request fields accepted as in vLLM: top_k, stop_token_ids, ignore_eos.
String `stop`s are applied after generation: the completion is cut before the first stop string, tokens
included. With an auth token configured, requests need `Authorization: Bearer <token>` (the client's api_key).
"""

from __future__ import annotations

import asyncio
import hmac
import socket
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from fleetrl.rpc import resolve_auth_token
from fleetrl.services.inference.config import InferenceConfig
from fleetrl.services.inference.engine import (
    FINISH_STOP,
    Completion,
    EngineError,
    InferenceEngine,
    SamplingRequest,
)
from fleetrl.services.inference.metrics import InferenceMetrics

# End-of-turn markers of common chat formats; whichever the tokenizer has ends a chat completion.
_END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool = False


class CompletionBody(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = None
    logprobs: int | None = None
    echo: bool = False


class ChatBody(_Sampling):
    messages: list[dict[str, Any]]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=0)


class _BadRequest(ValueError):
    pass


def _error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse(status_code=status, content={"error": {"message": message, "type": kind, "code": status}})


def create_app(engine: InferenceEngine, tokenizer: Any, metrics: InferenceMetrics, config: InferenceConfig) -> FastAPI:
    """The FastAPI app serving `engine` (tokenizer: the model's AutoTokenizer)."""
    app = FastAPI(title="fleetrl inference", docs_url=None, redoc_url=None)
    token = resolve_auth_token(config.auth_token)
    chat_stops = tuple(i for t in _END_OF_TURN if (i := tokenizer.convert_tokens_to_ids(t)) is not None and i >= 0)
    created = int(time.time())
    max_len = engine.max_model_len or config.max_model_len

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        if token is not None:
            sent = request.headers.get("authorization", "")
            if not hmac.compare_digest(sent.encode(), f"Bearer {token}".encode()):
                return _error(401, "missing or wrong 'Authorization: Bearer <token>'", "auth_error")
        return await call_next(request)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        parts = [f"{'.'.join(str(p) for p in e['loc'][1:])}: {e['msg']}" for e in exc.errors()]
        return _error(400, "; ".join(parts))

    def sampling(body: _Sampling, prompt: list[int], max_tokens: int, stops: tuple) -> SamplingRequest:
        if body.stream:
            raise _BadRequest("stream: streaming is not supported")
        if body.model not in (None, config.model_name):
            raise _BadRequest(f"model: unknown model {body.model!r}; serving {config.model_name!r}")
        return SamplingRequest(
            prompt_token_ids=prompt,
            n=body.n,
            max_tokens=max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=max(body.top_k or 0, 0),  # OpenAI-style -1 also means off
            stop_token_ids=tuple(body.stop_token_ids or ()) + stops,
            seed=body.seed,
            ignore_eos=body.ignore_eos,
        )

    def cut_at_stop(c: Completion, stop: str | list[str] | None) -> tuple[str, Completion]:
        """The completion's text (special tokens skipped) and the completion cut at a stop string."""
        text = tokenizer.decode(c.token_ids, skip_special_tokens=True)
        stops = [stop] if isinstance(stop, str) else [s for s in stop or [] if s]
        hits = [text.find(s) for s in stops if s in text]
        if not hits:
            return text, c
        cut = min(hits)
        for k in range(1, len(c.token_ids) + 1):  # fewest tokens whose text reaches the stop
            prefix = tokenizer.decode(c.token_ids[:k], skip_special_tokens=True)
            if any(s in prefix for s in stops):
                c = Completion(c.token_ids[:k], c.logprobs[:k], FINISH_STOP, c.prompt_len, c.versions[:k])
                break
        return text[:cut], c

    async def run(api: str, requests: list[SamplingRequest]) -> list[list[Completion]]:
        async with metrics.track_request(api):
            results = await asyncio.gather(*(engine.generate(r) for r in requests))
        for completions in results:
            metrics.observe_completions(completions)
        return list(results)

    def choice_extras(c: Completion, prompt: list[int]) -> dict[str, Any]:
        return {
            "token_ids": c.token_ids,
            "token_logprobs": c.logprobs,
            "versions": c.versions,
            "prompt_token_ids": prompt,
        }

    def usage(prompts: list[list[int]], choices: list[Completion]) -> dict[str, int]:
        p, g = sum(len(x) for x in prompts), sum(len(c.token_ids) for c in choices)
        return {"prompt_tokens": p, "completion_tokens": g, "total_tokens": p + g}

    async def guarded(api: str, handler, body) -> JSONResponse:
        try:
            return JSONResponse(await handler(body))
        except (_BadRequest, ValueError) as exc:
            return _error(400, str(exc))
        except EngineError as exc:
            return _error(503, str(exc), "engine_error")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {"id": config.model_name, "object": "model", "created": created, "owned_by": "fleetrl"}
        return {"object": "list", "data": [dict(card, root=config.model, max_model_len=max_len)]}

    async def _completions(body: CompletionBody) -> dict[str, Any]:
        if body.echo:
            raise _BadRequest("echo: not supported")
        raw = body.prompt
        if isinstance(raw, str):
            prompts = [tokenizer.encode(raw)]
        elif raw and all(isinstance(x, int) for x in raw):
            prompts = [list(raw)]
        elif raw and all(isinstance(x, str) for x in raw):
            prompts = [tokenizer.encode(x) for x in raw]
        else:
            prompts = [list(x) for x in raw]
        if not prompts or any(not p for p in prompts):
            raise _BadRequest("prompt: must not be empty")
        max_tokens = body.max_tokens or config.default_max_tokens
        requests = [sampling(body, p, max_tokens, ()) for p in prompts]
        results = await run("completions", requests)
        choices, flat = [], []
        for prompt, completions in zip(prompts, results, strict=True):
            for c in completions:
                text, c = cut_at_stop(c, body.stop)
                lp = None
                if body.logprobs is not None:
                    toks = tokenizer.convert_ids_to_tokens(c.token_ids)
                    lp = {"tokens": toks, "token_logprobs": c.logprobs, "top_logprobs": None}
                choices.append(
                    {
                        "index": len(choices),
                        "text": text,
                        "logprobs": lp,
                        "finish_reason": c.finish_reason,
                        **choice_extras(c, prompt),
                    }
                )
                flat.append(c)
        return {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": config.model_name,
            "choices": choices,
            "usage": usage(prompts, flat),
        }

    async def _chat(body: ChatBody) -> dict[str, Any]:
        if not body.messages:
            raise _BadRequest("messages: must not be empty")
        try:
            prompt = tokenizer.apply_chat_template(
                body.messages, add_generation_prompt=True, tokenize=True, return_dict=False
            )
        except Exception as exc:  # template errors come as jinja/ValueError/KeyError types
            raise _BadRequest(f"messages: the chat template failed: {exc}") from exc
        prompt = list(prompt)
        max_tokens = body.max_completion_tokens or body.max_tokens
        if max_tokens is None:  # OpenAI default: up to the context length
            max_tokens = (max_len - len(prompt)) if max_len else config.default_max_tokens
        (completions,) = await run("chat", [sampling(body, prompt, max_tokens, chat_stops)])
        choices = []
        for c0 in completions:
            text, c = cut_at_stop(c0, body.stop)
            lp = None
            if body.logprobs:
                toks = tokenizer.convert_ids_to_tokens(c.token_ids)
                lp = {
                    "content": [
                        {"token": t, "logprob": x, "bytes": list(t.encode()), "top_logprobs": []}
                        for t, x in zip(toks, c.logprobs, strict=True)
                    ]
                }
            choices.append(
                {
                    "index": len(choices),
                    "logprobs": lp,
                    "finish_reason": c.finish_reason,
                    "message": {"role": "assistant", "content": text},
                    **choice_extras(c, prompt),
                }
            )
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": config.model_name,
            "choices": choices,
            "usage": usage([prompt], [c for c in completions]),
        }

    @app.post("/v1/completions")
    async def completions(body: CompletionBody) -> JSONResponse:
        return await guarded("completions", _completions, body)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatBody) -> JSONResponse:
        return await guarded("chat", _chat, body)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    return app


class HttpServer:
    """A uvicorn server running `app` as a task in the current event loop."""

    def __init__(self, server: Any, task: asyncio.Task) -> None:
        self._server, self._task = server, task

    async def stop(self, timeout_s: float = 10.0) -> None:
        self._server.should_exit = True
        try:
            await asyncio.wait_for(self._task, timeout_s)
        except TimeoutError:
            self._task.cancel()


async def start_http_server(
    config: InferenceConfig, engine: InferenceEngine, metrics: InferenceMetrics
) -> tuple[HttpServer, int]:
    """Serve the OpenAI API on config.host:config.http_port (0 = pick); returns (server, port)."""
    import contextlib

    import uvicorn
    from transformers import AutoTokenizer

    class _Server(uvicorn.Server):
        def capture_signals(self):  # the service owns SIGINT/SIGTERM, not uvicorn
            return contextlib.nullcontext()

    tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, config.model)
    app = create_app(engine, tokenizer, metrics, config)
    family = socket.AF_INET6 if ":" in config.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.bind((config.host, config.http_port or 0))
    except OSError as exc:
        sock.close()
        raise OSError(f"could not bind HTTP API to {config.host}:{config.http_port}: {exc}") from exc
    port = int(sock.getsockname()[1])
    uv_config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off")
    server = _Server(uv_config)
    task = asyncio.create_task(server.serve(sockets=[sock]), name="http-api")
    deadline = time.monotonic() + 30.0
    while not server.started:
        if task.done():
            task.result()  # raises the startup error
            raise RuntimeError("the HTTP API stopped during startup")
        if time.monotonic() > deadline:
            task.cancel()
            raise TimeoutError("the HTTP API did not start within 30 s")
        await asyncio.sleep(0.01)
    return HttpServer(server, task), port
