"""The HTTP routes of the agent session server (fleetrl.gateway.session_server), kept apart so the gateway imports
FastAPI only when a rollout opens its first session."""

from __future__ import annotations

import asyncio
import logging
import secrets
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from fleetrl.agent_session import AgentSession, SessionError
from fleetrl.openai_chat import ChatRequestError, stream_events

if TYPE_CHECKING:
    from fleetrl.gateway.session_server import SessionServer

log = logging.getLogger(__name__)


def error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    """An OpenAI-shaped error body."""
    return JSONResponse(status_code=status, content={"error": {"message": message, "type": kind, "code": status}})


def build_session_app(server: SessionServer) -> FastAPI:
    """The session routes over `server` (its sessions, key, model and `chat`)."""
    app = FastAPI(title="fleetrl agent sessions", docs_url=None, redoc_url=None, openapi_url=None)

    def authorised(request: Request) -> bool:
        return secrets.compare_digest(request.headers.get("authorization", ""), f"Bearer {server.api_key}")

    async def respond(request: Request, session: AgentSession | None) -> Any:
        if not authorised(request):
            return error(401, "invalid api key: use the session's api_key", "authentication_error")
        try:
            body = await request.json()
        except ValueError:
            return error(400, "the body is not JSON")
        if not isinstance(body, dict):
            return error(400, "the body must be a JSON object")
        try:
            work = server.chat(body, session)
            if session is not None and session.context is not None:
                result = await asyncio.create_task(work, context=session.context)
            else:
                result = await work
        except (ChatRequestError, SessionError, TypeError, ValueError) as exc:  # the request's fault (named)
            return error(400, str(exc))
        except Exception as exc:  # no replica, a failed call: the agent may retry
            log.warning("agent session call failed: %s", exc)
            return error(503, f"sampling failed: {exc}", "engine_error")
        if body.get("stream"):
            options = body.get("stream_options") or {}
            events = stream_events(result, include_usage=bool(options.get("include_usage")))
            return StreamingResponse(iter(events), media_type="text/event-stream")
        return JSONResponse(result)

    async def session_chat(session_id: str, request: Request) -> Any:
        session = server.sessions.get(session_id)
        if session is None:
            return error(404, f"no open session {session_id}", "not_found_error")
        return await respond(request, session)

    async def chat(request: Request) -> Any:
        return await respond(request, None)

    async def models(request: Request, session_id: str | None = None) -> Any:
        if not authorised(request):
            return error(401, "invalid api key: use the session's api_key", "authentication_error")
        card = {"id": server.model, "object": "model", "created": 0, "owned_by": "fleetrl"}
        return JSONResponse({"object": "list", "data": [card]})

    app.post("/sessions/{session_id}/v1/chat/completions")(session_chat)
    app.get("/sessions/{session_id}/v1/models")(models)
    app.post("/v1/chat/completions")(chat)
    app.get("/v1/models")(models)
    return app
