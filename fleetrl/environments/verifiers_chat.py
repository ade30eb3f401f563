"""`fleetrl.environments.verifiers_chat`: a verifiers harness that runs its chat loop in-process.

verifiers (0.4.0, `verifiers.v1`) runs each agent turn as a program in a runtime (its built-in `null` and `bash`
harnesses are PEP 723 scripts that `uv sync` installs at the first rollout); inside a gateway that is a package
download and a subprocess per turn for what is one chat completion. This harness makes that call itself, through
the rollout's interception endpoint (so verifiers records the turn on its trace and scores it as usual) with the
official `openai` client. It is the harness `fleetrl.environments.verifiers` pins for a taskset that ships none.

verifiers finds a harness by a top-level module name (`{"id": NAME}` imports `verifiers.v1.harnesses.NAME`, else
`NAME`; a dotted name fails on the first part), and the module exports one `Harness` subclass through `__all__`.
`register()` enters this module in `sys.modules` as `HARNESS_ID`, which is how verifiers then finds it.
"""

from __future__ import annotations

import sys
from typing import Any, ClassVar

import openai
from verifiers.v1.clients import ModelContext
from verifiers.v1.configs.harness import HarnessConfig
from verifiers.v1.dialects.chat import message_to_wire
from verifiers.v1.harness import Harness
from verifiers.v1.runtimes import ProgramResult, Runtime
from verifiers.v1.task import TaskData
from verifiers.v1.trace import Trace

HARNESS_ID = "fleetrl_verifiers_chat"


class InProcessChatConfig(HarnessConfig):
    pass


class InProcessChatHarness(Harness[InProcessChatConfig]):
    """One chat completion per segment, no tools: the reply ends the segment (the env's `run()` decides whether
    the exchange goes on, as with verifiers' `null` harness)."""

    APPENDS_SYSTEM_PROMPT: ClassVar[bool] = True
    SUPPORTS_RESUME: ClassVar[bool] = True
    EXECUTES_CODE: ClassVar[bool] = False
    NEEDS_CONTAINER: ClassVar[bool] = False

    async def launch(  # type: ignore[override]
        self,
        ctx: ModelContext,
        trace: Trace,
        runtime: Runtime,
        endpoint: str,
        secret: str,
        mcp_urls: dict[str, str],
        data: TaskData,
        tool_interception_url: str | None = None,
    ) -> ProgramResult:
        if mcp_urls:
            raise ValueError(f"harness {HARNESS_ID!r} runs no tools; the task asks for {sorted(mcp_urls)}")
        system_prompt, prompt = self.resolve_prompt(data)
        messages: list[dict[str, Any]] = [{"role": "system", "content": system_prompt}] if system_prompt else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        elif prompt is not None:
            messages += [message_to_wire(m) for m in prompt]
        async with openai.AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0) as client:
            reply = await client.chat.completions.create(model=ctx.model, messages=messages)  # type: ignore[arg-type]
        return ProgramResult(exit_code=0, stdout=reply.choices[0].message.content or "", stderr="")


def register() -> str:
    """Make this harness findable by verifiers as `HARNESS_ID`; returns the id."""
    sys.modules.setdefault(HARNESS_ID, sys.modules[__name__])
    return HARNESS_ID


__all__ = ["InProcessChatHarness"]
