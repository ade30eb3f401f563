"""The hf engine's OpenAI chat endpoint, served for real and called with the `openai` client, as agents use it:
`tools` reach the chat template, and a streamed completion is the same completion as the unstreamed one."""

from __future__ import annotations

import openai
import pytest
from transformers import AutoTokenizer

from fleetrl.openai_chat import render_chat_prompt
from fleetrl.services.inference.config import InferenceConfig
from fleetrl.services.inference.hf_engine import HFEngine
from fleetrl.services.inference.server import create_server
from tests.integration.inference.agent_loop import TOOLS

pytestmark = pytest.mark.integration


async def test_tools_reach_the_template_and_a_stream_is_the_same_completion(tiny_model_dir):
    config = InferenceConfig(
        model=tiny_model_dir, engine="hf", grpc_port=0, http_port=0, metrics_port=None, served_model_name="tiny"
    )
    service = create_server(config, HFEngine(tiny_model_dir))
    await service.start()
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{service.http_port}/v1", api_key="x", max_retries=0)
    messages = [{"role": "user", "content": "What is 1 + 2?"}]
    try:
        whole = await client.chat.completions.create(
            model="tiny", messages=messages, tools=TOOLS, max_tokens=8, seed=3, logprobs=True
        )
        chunks = await client.chat.completions.create(
            model="tiny", messages=messages, tools=TOOLS, max_tokens=8, seed=3, stream=True
        )
        content, last = "", None
        async for chunk in chunks:
            for choice in chunk.choices:
                content += choice.delta.content or ""
                last = choice
    finally:
        await client.close()
        await service.stop()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    choice = whole.choices[0]
    assert choice.model_extra["prompt_token_ids"] == render_chat_prompt(tokenizer, messages, tools=TOOLS)
    assert "<tools>" in tokenizer.decode(choice.model_extra["prompt_token_ids"])
    assert content == (choice.message.content or "")
    assert last.model_extra["token_ids"] == choice.model_extra["token_ids"]
    assert last.finish_reason == choice.finish_reason
