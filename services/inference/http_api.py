"""OpenAI-compatible HTTP API of the inference server (FastAPI), so agent frameworks can point `base_url` at
fleetrl; http_server.py runs it under uvicorn.

Routes: GET /v1/models, POST /v1/completions (text or token-id prompts), POST /v1/chat/completions (the
tokenizer's chat template, with `tools`; tool calls the model writes in the hermes format come back as OpenAI tool
calls, and `stream=True` is answered as server-sent events of the finished completion: fleetrl.openai_chat), GET
/health. /v1/completions does not stream. Besides the OpenAI fields every choice carries `token_ids`,
`token_logprobs` (per generated token, under the distribution sampled from), `versions` (policy version per
token) and `prompt_token_ids`. Extra request fields accepted as in vLLM: top_k, stop_token_ids, ignore_eos.
String `stop`s go to the engine, which ends generation at the token that completes one; the text is cut before
the stop string, the tokens keep it. Auth (the run's bearer token) and the policy-version headers come from
http_auth.py's middleware, which http_server.py wraps around this app.

    api = OpenAIApi(engine, tokenizer, metrics, config)   # the routes' state; one method per route
    app = create_app(engine, tokenizer, metrics, config)  # the FastAPI app with those routes

The pure pieces (request building, stop-string cutting, usage, response choices) are module functions.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Awaitable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from fleetrl.gateway.sampler import cut_at_stop
from fleetrl.openai_chat import (
    ToolsIgnoredCheck,
    assistant_message,
    chat_completion_body,
    render_chat_prompt,
    stream_events,
    token_logprobs,
    token_texts,
)
from fleetrl.openai_chat import chat_stop_ids as chat_stop_ids
from fleetrl.services.inference.config import InferenceConfig
from fleetrl.services.inference.engine import (
    FINISH_STOP,
    Completion,
    EngineError,
    InferenceEngine,
    SamplingRequest,
)
from fleetrl.services.inference.metrics import InferenceMetrics


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
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    stream_options: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class BadRequest(ValueError):
    """A request the API refuses (HTTP 400)."""


def error_response(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    """An OpenAI-shaped error body."""
    return JSONResponse(status_code=status, content={"error": {"message": message, "type": kind, "code": status}})


# -- pure pieces ---------------------------------------------------------------------------------------------------


def sampling_request(
    body: _Sampling, prompt: list[int], max_tokens: int, stops: tuple[int, ...], model_name: str
) -> SamplingRequest:
    """The engine request for one prompt of `body`; refuses streaming and a model other than `model_name`."""
    if body.stream:
        raise BadRequest("stream: streaming is not supported")
    if body.model not in (None, model_name):
        raise BadRequest(f"model: unknown model {body.model!r}; serving {model_name!r}")
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
        stop=(body.stop,) if isinstance(body.stop, str) and body.stop else tuple(s for s in body.stop or () if s),
    )


def completion_prompts(raw: str | list[str] | list[int] | list[list[int]], tokenizer: Any) -> list[list[int]]:
    """The token ids of each prompt of a /v1/completions `prompt` (text, texts, ids or lists of ids)."""
    if isinstance(raw, str):
        prompts = [tokenizer.encode(raw)]
    elif raw and all(isinstance(x, int) for x in raw):
        prompts = [list(raw)]
    elif raw and all(isinstance(x, str) for x in raw):
        prompts = [tokenizer.encode(x) for x in raw]
    else:
        prompts = [list(x) for x in raw]
    if not prompts or any(not p for p in prompts):
        raise BadRequest("prompt: must not be empty")
    return prompts


def stop_completion(c: Completion, stop: str | list[str] | None, tokenizer: Any) -> tuple[str, Completion]:
    """The completion's text (special tokens skipped) and the completion cut at a stop string: its tokens up to
    the one that completes the first stop string (`fleetrl.gateway.sampler.cut_at_stop`, the one stop cut), its
    text up to where that string starts."""
    text = tokenizer.decode(c.token_ids, skip_special_tokens=True)
    stops = [stop] if isinstance(stop, str) else [s for s in stop or [] if s]
    hits = [text.find(s) for s in stops if s in text]
    if not hits:
        return text, c
    keep = cut_at_stop(tokenizer, c.token_ids, stops)
    if keep is not None:
        c = Completion(c.token_ids[:keep], c.logprobs[:keep], FINISH_STOP, c.prompt_len, c.versions[:keep])
    return text[: min(hits)], c


def choice_extras(c: Completion, prompt: list[int]) -> dict[str, Any]:
    """The fleetrl fields every choice carries besides the OpenAI ones."""
    return {
        "token_ids": c.token_ids,
        "token_logprobs": c.logprobs,
        "versions": c.versions,
        "prompt_token_ids": prompt,
    }


def usage(prompts: list[list[int]], choices: list[Completion]) -> dict[str, int]:
    p, g = sum(len(x) for x in prompts), sum(len(c.token_ids) for c in choices)
    return {"prompt_tokens": p, "completion_tokens": g, "total_tokens": p + g}


# -- the routes ------------------------------------------------------------------------------------------------------


class OpenAIApi:
    """The state of the OpenAI routes (engine, tokenizer, metrics, settings) and one handler per route."""

    def __init__(
        self, engine: InferenceEngine, tokenizer: Any, metrics: InferenceMetrics, config: InferenceConfig
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.config = config
        self.chat_stops = chat_stop_ids(tokenizer)
        self.tools_check = ToolsIgnoredCheck(config.model)
        self.created = int(time.time())
        self.max_len = engine.max_model_len or config.max_model_len

    # error handler

    async def invalid(self, request: Request, exc: RequestValidationError) -> JSONResponse:
        """A body that does not parse: 400 naming the fields."""
        parts = [f"{'.'.join(str(p) for p in e['loc'][1:])}: {e['msg']}" for e in exc.errors()]
        return error_response(400, "; ".join(parts))

    # routes

    async def models(self) -> dict[str, Any]:
        """GET /v1/models: the one served model."""
        config = self.config
        card = {"id": config.model_name, "object": "model", "created": self.created, "owned_by": "fleetrl"}
        return {"object": "list", "data": [dict(card, root=config.model, max_model_len=self.max_len)]}

    async def completions(self, body: CompletionBody) -> JSONResponse:
        """POST /v1/completions."""
        return await self._guarded(self.complete(body))

    async def chat(self, body: ChatBody) -> Response:
        """POST /v1/chat/completions."""
        response = await self._guarded(self.chat_complete(body))
        if not body.stream or response.status_code != 200:
            return response
        options = body.stream_options or {}
        events = stream_events(json.loads(response.body), include_usage=bool(options.get("include_usage")))
        return StreamingResponse(iter(events), media_type="text/event-stream")

    async def health(self) -> dict[str, str]:
        """GET /health."""
        return {"status": "ok"}

    # the work behind the routes (raise BadRequest / ValueError / EngineError)

    async def complete(self, body: CompletionBody) -> dict[str, Any]:
        """A /v1/completions response body."""
        if body.echo:
            raise BadRequest("echo: not supported")
        prompts = completion_prompts(body.prompt, self.tokenizer)
        max_tokens = body.max_tokens or self.config.default_max_tokens
        model_name = self.config.model_name
        requests = [sampling_request(body, p, max_tokens, (), model_name) for p in prompts]
        results = await self.generate("completions", requests)
        choices, flat = [], []
        for prompt, completions in zip(prompts, results, strict=True):
            for c in completions:
                text, c = stop_completion(c, body.stop, self.tokenizer)
                lp = None
                if body.logprobs is not None:
                    toks = [text for text, _ in token_texts(self.tokenizer, c.token_ids)]
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
            "model": model_name,
            "choices": choices,
            "usage": usage(prompts, flat),
        }

    async def chat_complete(self, body: ChatBody) -> dict[str, Any]:
        """A /v1/chat/completions response body (streamed or not, the body is the whole completion)."""
        if not body.messages:
            raise BadRequest("messages: must not be empty")
        prompt = render_chat_prompt(
            self.tokenizer, body.messages, tools=body.tools, chat_template_kwargs=body.chat_template_kwargs
        )
        self.tools_check.check(self.tokenizer, body.messages, body.tools, prompt, body.chat_template_kwargs)
        max_tokens = body.max_completion_tokens or body.max_tokens
        if max_tokens is None:  # OpenAI default: up to the context length
            max_tokens = (self.max_len - len(prompt)) if self.max_len else self.config.default_max_tokens
        whole = body.model_copy(update={"stream": False})  # a stream is the finished completion as events
        request = sampling_request(whole, prompt, max_tokens, self.chat_stops, self.config.model_name)
        (completions,) = await self.generate("chat", [request])
        choices = []
        for c0 in completions:
            text, c = stop_completion(c0, body.stop, self.tokenizer)
            lp = None
            if body.logprobs:
                lp = token_logprobs(self.tokenizer, c.token_ids, c.logprobs)
            message, finish = assistant_message(
                text, c.finish_reason, tools_offered=bool(body.tools), tool_choice=body.tool_choice
            )
            choices.append(
                {
                    "index": len(choices),
                    "logprobs": lp,
                    "finish_reason": finish,
                    "message": message,
                    **choice_extras(c, prompt),
                }
            )
        # usage counts the completions before any stop-string cut
        return chat_completion_body(self.config.model_name, choices, usage([prompt], list(completions)))

    async def generate(self, api: str, requests: list[SamplingRequest]) -> list[list[Completion]]:
        """Run `requests` on the engine together, counted in the metrics under `api`."""
        async with self.metrics.track_request(api):
            results = await asyncio.gather(*(self.engine.generate(r) for r in requests))
        for completions in results:
            self.metrics.observe_completions(completions)
        return list(results)

    @staticmethod
    async def _guarded(work: Awaitable[dict[str, Any]]) -> JSONResponse:
        """The response body of `work`, or an OpenAI-shaped 400 (bad request) / 503 (engine error)."""
        try:
            return JSONResponse(await work)
        except ValueError as exc:  # BadRequest included
            return error_response(400, str(exc))
        except EngineError as exc:
            return error_response(503, str(exc), "engine_error")


def create_app(engine: InferenceEngine, tokenizer: Any, metrics: InferenceMetrics, config: InferenceConfig) -> FastAPI:
    """The FastAPI app serving `engine` (tokenizer: the model's AutoTokenizer)."""
    api = OpenAIApi(engine, tokenizer, metrics, config)
    app = FastAPI(title="fleetrl inference", docs_url=None, redoc_url=None)
    app.exception_handler(RequestValidationError)(api.invalid)
    app.get("/v1/models")(api.models)
    app.post("/v1/completions")(api.completions)
    app.post("/v1/chat/completions")(api.chat)
    app.get("/health")(api.health)
    return app
