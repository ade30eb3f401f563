"""A tool-using agent written only against the official `openai` client: nothing here knows about fleetrl.

    answer = await solve(openai.AsyncOpenAI(base_url=..., api_key=...), model, "What is 3 + 4?")

It offers one tool (`add`), runs the tools the model calls and sends the results back, and, when the model answers
without a tool, asks it once to confirm: a multi-turn conversation of chat completions with tool calls, as agent
code written for any OpenAI-compatible endpoint looks.
"""

from __future__ import annotations

import json

import openai

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "a + b",
            "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}},
        },
    }
]


def run_tool(name: str, arguments: str) -> str:
    """The tool's result as text (an error message for a bad call: the model reads it and goes on)."""
    try:
        args = json.loads(arguments or "{}")
        if name != "add":
            return f"error: unknown tool {name}"
        return str(args["a"] + args["b"])
    except (ValueError, KeyError, TypeError) as exc:
        return f"error: {exc}"


async def solve(client: openai.AsyncOpenAI, model: str, question: str, *, max_turns: int = 3) -> str:
    """The model's final answer to `question` after at most `max_turns` chat completions."""
    messages: list[dict] = [{"role": "user", "content": question}]
    confirmed = False
    answer = ""
    for _ in range(max_turns):
        response = await client.chat.completions.create(model=model, messages=messages, tools=TOOLS)
        message = response.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if message.tool_calls:
            for call in message.tool_calls:
                result = run_tool(call.function.name, call.function.arguments)
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
            continue
        answer = message.content or ""
        if confirmed:
            break
        confirmed = True
        messages.append({"role": "user", "content": "Are you sure? Reply with the number only."})
    return answer
