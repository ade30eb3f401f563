"""The OpenAI chat-completions format as fleetrl serves it: the prompt the chat template gives a request, tool calls
parsed from what the model wrote, and the response body, whole or as a server-sent-event stream.

Pure logic (no sockets), shared by the hf engine's OpenAI endpoint (services/inference/http_api.py) and the agent
session server (fleetrl.gateway.session_server):

    prompt_ids = render_chat_prompt(tokenizer, body["messages"], tools=body.get("tools"))
    ... generate ...
    message, finish = assistant_message(text, finish_reason, tools_offered=bool(tools), tool_choice=...)
    body = chat_completion_body(model, [choice(0, message, finish)], usage)
    events = stream_events(body)   # for stream=True: "data: {chunk}\\n\\n" ... "data: [DONE]\\n\\n"

Tool calls are read in the `hermes` format (Qwen2.5, Hermes, the tiny model's template): each
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` block the model wrote becomes an OpenAI tool call; text
before the first block is the message's content. A block that is not valid JSON with a name leaves the whole reply
as plain content (finish_reason unchanged), as vLLM's hermes parser does.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import time
import uuid
from collections.abc import Sequence
from typing import Any

log = logging.getLogger(__name__)

END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")
"""End-of-turn markers of common chat formats; whichever the tokenizer has ends a chat completion."""
_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


class ChatRequestError(ValueError):
    """A chat request that cannot be served (HTTP 400), naming the field."""


def chat_stop_ids(tokenizer: Any) -> tuple[int, ...]:
    """The ids of the end-of-turn markers the tokenizer has (they end a chat completion)."""
    ids = []
    for marker in END_OF_TURN:
        i = tokenizer.convert_tokens_to_ids(marker)
        if i is not None and i >= 0 and i != getattr(tokenizer, "unk_token_id", None):
            ids.append(int(i))
    return tuple(ids)


def _text_of(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: only text ones
        parts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text":
                raise ChatRequestError(f"{where}.content[{i}]: only text content parts are supported")
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise ChatRequestError(f"{where}.content: must be a string or a list of text parts")


def template_messages(messages: Sequence[Any]) -> list[dict[str, Any]]:
    """OpenAI request messages in the form chat templates read: text content as one string, an assistant's tool
    call arguments (a JSON string on the wire) as a dict, as vLLM hands them to templates."""
    if not isinstance(messages, list | tuple) or not messages:
        raise ChatRequestError("messages: must be a non-empty list")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ChatRequestError(f"messages[{i}]: must be an object with a role")
        m = dict(message)
        m["content"] = _text_of(m.get("content"), f"messages[{i}]")
        calls = m.get("tool_calls")
        if calls:
            fixed = []
            for call in calls:
                call = dict(call)
                function = dict(call.get("function") or {})
                arguments = function.get("arguments")
                if isinstance(arguments, str):
                    with contextlib.suppress(json.JSONDecodeError):  # else the template writes the string
                        function["arguments"] = json.loads(arguments)
                call["function"] = function
                fixed.append(call)
            m["tool_calls"] = fixed
        out.append(m)
    return out


def render_chat_prompt(
    tokenizer: Any,
    messages: Sequence[Any],
    *,
    tools: Sequence[Any] | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """The prompt token ids of a chat request: the tokenizer's chat template over `messages` (and `tools`), with
    the generation prompt."""
    kwargs = dict(chat_template_kwargs or {})
    if tools:
        kwargs["tools"] = list(tools)
    try:
        ids = tokenizer.apply_chat_template(
            template_messages(messages), add_generation_prompt=True, tokenize=True, **kwargs
        )
    except ChatRequestError:
        raise
    except Exception as exc:  # template errors come as jinja/ValueError/KeyError/TypeError types
        raise ChatRequestError(f"messages: the chat template failed: {exc}") from exc
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # transformers may return a BatchEncoding
        ids = ids["input_ids"]
    return [int(t) for t in ids]


class ToolsIgnoredCheck:
    """Warns once, naming the model, when its chat template ignores `tools` (the prompt rendered with a request's
    tools is the one rendered without them): the model would never see the tools the agent offers. Checked on the
    first request that offers tools (one more rendering, once)."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.checked = False

    def check(
        self,
        tokenizer: Any,
        messages: Sequence[Any],
        tools: Sequence[Any] | None,
        prompt_ids: Sequence[int],
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> bool:
        """Whether this request showed the template ignoring its tools (True only the one time it warns)."""
        if self.checked or not tools:
            return False
        self.checked = True
        without = render_chat_prompt(tokenizer, messages, chat_template_kwargs=chat_template_kwargs)
        if list(without) != list(prompt_ids):
            return False
        log.warning(
            "the chat template of %s ignores `tools`: a request's tool list is not in the prompt, so the model "
            "never sees it (use a template that renders tools, e.g. pass chat_template with a tools section)",
            self.model,
        )
        return True


def parse_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool calls) of a reply in the hermes format; no valid block: (text, [])."""
    blocks = _TOOL_CALL.findall(text)
    if not blocks:
        return text, []
    calls = []
    for block in blocks:
        try:
            parsed = json.loads(block)
        except json.JSONDecodeError:
            return text, []
        if not isinstance(parsed, dict) or not isinstance(parsed.get("name"), str):
            return text, []
        arguments = parsed.get("arguments", {})
        calls.append(
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {
                    "name": parsed["name"],
                    "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments),
                },
            }
        )
    content = text[: text.index("<tool_call>")].strip()
    return content or None, calls


def assistant_message(
    text: str, finish_reason: str, *, tools_offered: bool, tool_choice: Any = None
) -> tuple[dict[str, Any], str]:
    """The response message for the model's `text` and the choice's finish reason ("tool_calls" when it called
    tools: only when tools were offered and tool_choice is not "none")."""
    if tools_offered and tool_choice != "none":
        content, calls = parse_tool_calls(text)
        if calls:
            return {"role": "assistant", "content": content, "tool_calls": calls}, "tool_calls"
    return {"role": "assistant", "content": text}, finish_reason


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte as the printable character byte-level BPE vocabularies spell it with
    (Radford et al. 2019, `encoder.py`; the tokenizers of GPT-2, Qwen, Llama 3 and the tiny model use it)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


_BYTE_OF_CHAR = {c: b for b, c in _bytes_to_unicode().items()}
_SENTENCEPIECE_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def token_bytes(tokenizer: Any, token_ids: Sequence[int]) -> list[bytes]:
    """The exact bytes each token stands for (a token may hold part of a UTF-8 character): special and added tokens
    as their text, SentencePiece's `<0xNN>` as that byte and `▁` as a space, a byte-level tokenizer's symbols (`Ċ`
    for a newline) through GPT-2's alphabet; any other token as the tokenizer decodes it alone."""
    added = set(getattr(tokenizer, "all_special_tokens", ()) or ()) | set(
        (getattr(tokenizer, "get_added_vocab", dict)() or {}).keys()
    )
    byte_level = _is_byte_level(tokenizer)
    pieces = []
    for symbol in tokenizer.convert_ids_to_tokens(list(token_ids)):
        symbol = symbol or ""
        if symbol in added:
            pieces.append(symbol.encode())
        elif match := _SENTENCEPIECE_BYTE.fullmatch(symbol):
            pieces.append(bytes([int(match.group(1), 16)]))
        elif "▁" in symbol:
            pieces.append(symbol.replace("▁", " ").encode())
        elif byte_level and all(c in _BYTE_OF_CHAR for c in symbol):
            pieces.append(bytes(_BYTE_OF_CHAR[c] for c in symbol))
        elif hasattr(tokenizer, "convert_tokens_to_string"):
            pieces.append(tokenizer.convert_tokens_to_string([symbol]).encode())
        else:  # a tokenizer whose symbols are their text
            pieces.append(symbol.encode())
    return pieces


def _is_byte_level(tokenizer: Any) -> bool:
    """Whether the tokenizer spells bytes in GPT-2's alphabet (a slow one's `byte_decoder`, a fast one's ByteLevel
    decoder)."""
    if getattr(tokenizer, "byte_decoder", None):
        return True
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend is not None and "ByteLevel" in repr(getattr(backend, "decoder", None))


def token_texts(tokenizer: Any, token_ids: Sequence[int]) -> list[tuple[str, bytes]]:
    """(text, bytes) of each token as the OpenAI API gives them: the text piece (a token holding only part of a
    character shows as U+FFFD) and its exact UTF-8 bytes, not the vocabulary's internal symbol."""
    return [(raw.decode("utf-8", errors="replace"), raw) for raw in token_bytes(tokenizer, token_ids)]


def token_logprobs(tokenizer: Any, token_ids: Sequence[int], logprobs: Sequence[float]) -> dict[str, Any]:
    """A choice's `logprobs` object: one entry per generated token (its text and bytes; no top alternatives)."""
    return {
        "content": [
            {"token": text, "logprob": float(x), "bytes": list(raw), "top_logprobs": []}
            for (text, raw), x in zip(token_texts(tokenizer, token_ids), logprobs, strict=True)
        ]
    }


def chat_completion_body(
    model: str, choices: list[dict[str, Any]], usage: dict[str, int], *, completion_id: str | None = None
) -> dict[str, Any]:
    """A `chat.completion` response body."""
    return {
        "id": completion_id or f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage,
    }


def _event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def stream_events(body: dict[str, Any], *, include_usage: bool = False) -> list[str]:
    """A whole chat completion as the server-sent events of `stream=True`: per choice a role chunk, its content,
    its tool calls (each complete in one delta) and its finish reason; the usage chunk when asked for; [DONE].
    The choice's `logprobs` (every generated token's) ride on its first chunk that carries the reply: the content,
    or for a reply that is only tool calls the first tool call, so a client that gathers them from the stream
    gets what the unstreamed reply carries. fleetrl's extra choice fields (token ids, logprobs, versions) ride on
    each choice's last chunk."""
    base = {k: body[k] for k in ("id", "created", "model")}
    base["object"] = "chat.completion.chunk"
    events = []
    for choice in body["choices"]:
        index, message = choice["index"], choice["message"]
        events.append(_event({**base, "choices": [{"index": index, "delta": {"role": "assistant", "content": ""}}]}))
        logprobs = choice.get("logprobs")
        deltas = [{"content": message["content"]}] if message.get("content") else []
        deltas += [{"tool_calls": [{"index": k, **call}]} for k, call in enumerate(message.get("tool_calls") or [])]
        for k, delta in enumerate(deltas):
            chunk: dict[str, Any] = {"index": index, "delta": delta}
            if k == 0 and logprobs is not None:
                chunk["logprobs"] = logprobs
            events.append(_event({**base, "choices": [chunk]}))
        extras = {k: v for k, v in choice.items() if k not in ("index", "message", "logprobs", "finish_reason")}
        last = {"index": index, "delta": {}, "finish_reason": choice["finish_reason"], **extras}
        events.append(_event({**base, "choices": [last]}))
    if include_usage:
        events.append(_event({**base, "choices": [], "usage": body["usage"]}))
    events.append("data: [DONE]\n\n")
    return events


def stop_text_cut(text: str, stop: str | Sequence[str] | None) -> str:
    """`text` cut before the first stop string it holds (OpenAI leaves the stop string out of the content)."""
    stops = [stop] if isinstance(stop, str) else [s for s in stop or () if isinstance(s, str) and s]
    hits = [text.find(s) for s in stops if s and s in text]
    return text[: min(hits)] if hits else text
