"""A plain OpenAI-SDK agent for the agent-session tests: a multi-turn loop that offers one tool and runs the tools
the model calls, written only against the `openai` client (nothing of fleetrl)."""

from __future__ import annotations

import json

import openai

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two numbers.",
            "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}},
        },
    }
]


async def chat_agent(client: openai.AsyncOpenAI, model: str, question: str, turns: int, stream: bool) -> list[dict]:
    """`turns` model calls: after each reply, a tool result for a tool call or a follow-up user message."""
    messages: list[dict] = [{"role": "user", "content": question}]
    for turn in range(turns):
        if stream:
            chunks = await client.chat.completions.create(
                model=model, messages=messages, tools=TOOLS, max_tokens=8, stream=True
            )
            content = ""
            async for chunk in chunks:
                for choice in chunk.choices:
                    content += choice.delta.content or ""
            message = {"role": "assistant", "content": content}
        else:
            response = await client.chat.completions.create(model=model, messages=messages, tools=TOOLS, max_tokens=8)
            message = response.choices[0].message.model_dump(exclude_none=True)
        messages.append(message)
        for call in message.get("tool_calls") or []:
            args = json.loads(call["function"]["arguments"] or "{}")
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": str(args)})
        if not message.get("tool_calls"):
            messages.append({"role": "user", "content": f"and then {turn}?"})
    return messages
