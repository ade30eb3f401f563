"""The agent session server (fleetrl.gateway.session_server) with the real `openai` client over HTTP and a scripted
sampler: tool calls parsed, streaming, multi-turn recording of exactly what the sampler returned, the session's
affinity key on every call, refusals naming the field."""

from __future__ import annotations

import asyncio
import gc
import json
import socket
import sys

import openai
import pytest
from transformers import AutoTokenizer

from fleetrl import Config, RolloutSample, RolloutSetup
from fleetrl.gateway.config import GatewayConfig
from fleetrl.gateway.sampler import SampledCompletion
from fleetrl.gateway.sampling_seed import RolloutKey, derive_seed, next_rollout_seed, rollout_seed_scope
from fleetrl.gateway.session_server import SessionServer, session_hosts
from fleetrl.gateway.worker import Gateway

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


class ScriptedSampler:
    """Replays fixed replies (text -> tokens), recording each call's prompt and arguments."""

    def __init__(self, tokenizer, replies: list[str]) -> None:
        self.tokenizer, self.replies, self.calls = tokenizer, list(replies), []

    async def sample_with_prompt_tokens(self, prompt, n=1, **kwargs):
        self.calls.append((list(prompt), kwargs))
        text = self.replies.pop(0)
        end = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        tokens = [*self.tokenizer.encode(text, add_special_tokens=False), end]
        logprobs = [-0.1 * (i + 1) for i in range(len(tokens))]
        return [SampledCompletion(list(prompt) + tokens, len(prompt), logprobs, "stop", text, [3] * len(tokens))]


@pytest.fixture
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


async def run_agent(client: openai.AsyncOpenAI, model: str, stream: bool) -> list[dict]:
    """A plain OpenAI-SDK tool loop: ask, run the tools the model calls, ask again until it answers."""
    messages: list[dict] = [{"role": "user", "content": "What is 1 + 2?"}]
    for _ in range(4):
        if stream:
            chunks = await client.chat.completions.create(
                model=model, messages=messages, tools=TOOLS, stream=True, stream_options={"include_usage": True}
            )
            content, calls, finish = "", {}, None
            async for chunk in chunks:
                for choice in chunk.choices:
                    content += choice.delta.content or ""
                    for call in choice.delta.tool_calls or []:
                        calls.setdefault(
                            call.index, {"id": call.id, "type": "function", "function": {"name": "", "arguments": ""}}
                        )
                        calls[call.index]["function"]["name"] += call.function.name or ""
                        calls[call.index]["function"]["arguments"] += call.function.arguments or ""
                    finish = choice.finish_reason or finish
            message = {"role": "assistant", "content": content or None}
            if calls:
                message["tool_calls"] = [calls[k] for k in sorted(calls)]
        else:
            response = await client.chat.completions.create(model=model, messages=messages, tools=TOOLS)
            finish = response.choices[0].finish_reason
            message = response.choices[0].message.model_dump(exclude_none=True)
        messages.append(message)
        if finish != "tool_calls":
            return messages
        for call in message["tool_calls"]:
            args = json.loads(call["function"]["arguments"])
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": str(args["a"] + args["b"])})
    return messages


@pytest.mark.parametrize("stream", [False, True])
async def test_a_tool_using_openai_agent_runs_and_every_call_is_recorded(tokenizer, stream):
    replies = ['<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>', "The answer is 3."]
    sampler = ScriptedSampler(tokenizer, replies)
    server = SessionServer(sampler, tokenizer, model="policy", sample_kwargs={"temperature": 1.0, "max_tokens": 32})
    session = await server.open()
    client = openai.AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)
    try:
        messages = await run_agent(client, session.model, stream)
    finally:
        await client.close()
        await server.close()
    assert messages[1]["tool_calls"][0]["function"]["name"] == "add"
    assert json.loads(messages[1]["tool_calls"][0]["function"]["arguments"]) == {"a": 1, "b": 2}
    assert messages[2] == {"role": "tool", "tool_call_id": messages[1]["tool_calls"][0]["id"], "content": "3"}
    assert messages[3]["content"] == "The answer is 3."
    assert len(sampler.calls) == 2 and all(kw["user"] == session.session_id for _, kw in sampler.calls)
    first, second = session.turns
    assert first.prompt_token_ids == sampler.calls[0][0]  # the template's rendering with the tools
    assert "<tools>" in tokenizer.decode(first.prompt_token_ids)
    assert first.completion_token_ids[-1] == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert second.prompt_token_ids == sampler.calls[1][0]
    assert "<tool_response>\n3\n</tool_response>" in tokenizer.decode(second.prompt_token_ids)
    run = session.to_rollout_run(reward=1.0)
    samples = run.to_samples()
    trained = [(t, lp) for s in samples for t, lp, m in zip(s.tokens, s.logprobs, s.loss_mask, strict=True) if m]
    generated = [
        (t, lp) for turn in session.turns for t, lp in zip(turn.completion_token_ids, turn.logprobs, strict=True)
    ]
    assert trained == generated  # the model's tokens and logprobs, verbatim, each once
    assert samples[0].metrics["session_turns"] == 2.0
    assert samples[0].metrics["session_splits"] == float(len(samples) - 1)


async def test_calls_use_the_runs_sampling_settings_and_refuse_what_a_session_cannot_do(tokenizer):
    sampler = ScriptedSampler(tokenizer, ["hi"])
    kwargs = {"temperature": 0.9, "top_p": 0.95, "max_tokens": 16}
    server = SessionServer(sampler, tokenizer, model="policy", sample_kwargs=kwargs, max_seq_len=200)
    session = await server.open()
    client = openai.AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)
    try:
        with pytest.raises(openai.BadRequestError, match="n: a session call samples one completion"):
            await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "x"}], n=2)
        with pytest.raises(openai.BadRequestError, match="model: unknown model 'gpt-4o'"):
            await client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "x"}])
        with pytest.raises(openai.BadRequestError, match="messages"):
            await client.chat.completions.create(model="policy", messages=[])
        ask = {"model": "policy", "messages": [{"role": "user", "content": "x"}]}
        with pytest.raises(openai.BadRequestError, match="response_format: structured outputs"):
            await client.chat.completions.create(**ask, response_format={"type": "json_object"})
        with pytest.raises(openai.BadRequestError, match="presence_penalty: the sampled distribution"):
            await client.chat.completions.create(**ask, presence_penalty=0.5)
        with pytest.raises(openai.BadRequestError, match="top_logprobs"):
            await client.chat.completions.create(**ask, logprobs=True, top_logprobs=3)
        wrong_key = openai.AsyncOpenAI(base_url=session.base_url, api_key="nope", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            await wrong_key.chat.completions.create(model="policy", messages=[{"role": "user", "content": "x"}])
        await wrong_key.close()
        r = await client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "x"}], temperature=0.2, max_tokens=100, logprobs=True
        )
        assert r.choices[0].message.content == "hi" and r.choices[0].finish_reason == "stop"
        assert [x.logprob for x in r.choices[0].logprobs.content] == session.turns[0].logprobs
        ((_, args),) = sampler.calls
        assert (args["temperature"], args["top_p"], args["max_tokens"], args["max_seq_len"]) == (0.9, 0.95, 16, 200)
        models = await client.models.list()
        assert [m.id for m in models.data] == ["policy"]
    finally:
        await client.close()
        await server.close()


class SeedRecordingSampler(ScriptedSampler):
    """Records the seed the gateway's sampler would draw for each call (fleetrl.gateway.sampling_seed)."""

    def __init__(self, tokenizer, replies: list[str]) -> None:
        super().__init__(tokenizer, replies)
        self.seeds: list[int | None] = []

    async def sample_with_prompt_tokens(self, prompt, n=1, **kwargs):
        self.seeds.append(next_rollout_seed())
        return await super().sample_with_prompt_tokens(prompt, n, **kwargs)


async def test_a_sessions_calls_are_seeded_from_the_rollout_that_opened_it_and_may_run_in_parallel(tokenizer):
    sampler = SeedRecordingSampler(tokenizer, ["a", "b", "c", "d"])
    server = SessionServer(sampler, tokenizer, sample_kwargs={"max_tokens": 4})
    key = RolloutKey(run_seed=1, row_id=2, version=0, sample_index=3)
    with rollout_seed_scope(key):
        session = await server.open()
    outside = await server.open()
    client = openai.AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)
    other = openai.AsyncOpenAI(base_url=outside.base_url, api_key=outside.api_key, max_retries=0)
    ask = {"model": "policy", "messages": [{"role": "user", "content": "x"}]}
    try:
        await asyncio.gather(client.chat.completions.create(**ask), client.chat.completions.create(**ask))
        await client.chat.completions.create(**ask)
        await other.chat.completions.create(**ask)
    finally:
        await client.close()
        await other.close()
        await server.close()
    expected = [derive_seed(1, 2, 0, 3, call) for call in range(3)]
    assert sorted(sampler.seeds[:2]) == sorted(expected[:2]) and sampler.seeds[2] == expected[2]
    assert sampler.seeds[3] is None  # opened outside a rollout: unseeded, as the sampler is there
    assert len(session.turns) == 3 and len(outside.turns) == 1


async def run_tool_session(tokenizer, replies: list[str], exact_history: bool, edit_history: bool = False):
    sampler = ScriptedSampler(tokenizer, replies)
    server = SessionServer(sampler, tokenizer, sample_kwargs={"max_tokens": 64})
    session = await server.open(exact_history=exact_history)
    client = openai.AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)
    try:
        messages = [{"role": "user", "content": "What is 1 + 2?"}]
        first = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        messages.append(first.choices[0].message.model_dump(exclude_none=True))
        messages.append({"role": "tool", "tool_call_id": "c", "content": "3"})
        if edit_history:
            messages[0] = {"role": "user", "content": "What is 1 + 2? Be brief."}
        await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
    finally:
        await client.close()
        await server.close()
    return session, sampler


def non_canonical(tokenizer, text: str) -> list[int]:
    """Tokens of `text` that are not its canonical tokenization (its first multi-character token spelt one token per
    character), as a sampled model may write it: decoded and re-encoded, they come back otherwise."""
    tokens = tokenizer.encode(text, add_special_tokens=False)
    for i, piece in enumerate(tokenizer.convert_ids_to_tokens(tokens)):
        chars = [tokenizer.convert_tokens_to_ids(ch) for ch in piece]
        if len(piece) > 1 and all(c is not None and c != tokenizer.unk_token_id for c in chars):
            return [*tokens[:i], *chars, *tokens[i + 1 :]]
    raise AssertionError(f"every token of {text!r} is one character")


class NonCanonicalSampler(ScriptedSampler):
    """Replies with the non-canonical tokens of each reply."""

    async def sample_with_prompt_tokens(self, prompt, n=1, **kwargs):
        self.calls.append((list(prompt), kwargs))
        text = self.replies.pop(0)
        tokens = [*non_canonical(self.tokenizer, text), self.tokenizer.convert_tokens_to_ids("<|im_end|>")]
        n_gen = len(tokens)
        return [SampledCompletion([*prompt, *tokens], len(prompt), [-0.5] * n_gen, "stop", text, [0] * n_gen)]


@pytest.mark.parametrize("exact_history", [True, False])
async def test_an_exact_history_session_appends_the_next_call_to_the_models_own_tokens(tokenizer, exact_history):
    replies = ['<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>', "The answer is 3."]
    sampler = NonCanonicalSampler(tokenizer, replies)
    server = SessionServer(sampler, tokenizer, sample_kwargs={"max_tokens": 64})
    session = await server.open(exact_history=exact_history)
    client = openai.AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)
    try:
        messages = [{"role": "user", "content": "What is 1 + 2?"}]
        first = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        assert first.choices[0].finish_reason == "tool_calls"
        messages.append(first.choices[0].message.model_dump(exclude_none=True))
        messages.append({"role": "tool", "tool_call_id": "c", "content": "3"})
        await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
    finally:
        await client.close()
        await server.close()
    one, two = session.turns
    so_far = one.prompt_token_ids + one.completion_token_ids
    assert "<tool_response>\n3\n</tool_response>" in tokenizer.decode(two.prompt_token_ids)
    if exact_history:  # the model sees its own tokens, verbatim, and the turns join into one sample
        assert two.prompt_token_ids[: len(so_far)] == so_far
        assert session.metrics()["session_splits"] == 0.0
        sample = session.to_rollout_sample(reward=1.0)
        assert sum(sample.loss_mask) == len(one.completion_token_ids) + len(two.completion_token_ids)
    else:  # re-rendered: the template spells the reply canonically, so the second call starts a new sample
        assert two.prompt_token_ids[: len(so_far)] != so_far
        assert session.metrics()["session_splits"] == 1.0


async def test_an_exact_history_session_renders_an_edited_history_whole(tokenizer):
    replies = ['<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>', "3"]
    session, sampler = await run_tool_session(tokenizer, replies, exact_history=True, edit_history=True)
    second_prompt = sampler.calls[1][0]
    assert tokenizer.decode(second_prompt).count("Be brief.") == 1  # the whole edited history, rendered
    assert session.metrics()["session_splits"] == 1.0


async def test_sessions_are_kept_only_while_open_and_held(tokenizer):
    server = SessionServer(ScriptedSampler(tokenizer, []), tokenizer)
    try:
        done, dropped, held = await server.open(), await server.open(), await server.open()
        done.closed = True  # as to_rollout_run leaves it
        dropped_id = dropped.session_id
        del dropped  # a rollout that failed half-way: nothing holds its session any more
        gc.collect()
        await server.open()
        assert done.session_id not in server.sessions and dropped_id not in server.sessions
        assert server.sessions[held.session_id] is held
    finally:
        await server.close()


async def test_the_runs_setup_carries_the_cookbooks_endpoint_fields_and_opens_sessions(tokenizer, tiny_model_dir):
    run = Config(base_model=tiny_model_dir, dataset="unused", max_completion_tokens=5)
    setup = RolloutSetup.for_run(run, tokenizer, ScriptedSampler(tokenizer, ["unrecorded"]))
    assert (setup.model, setup.tokenizer_id) == ("policy", tiny_model_dir)
    try:
        base_url, api_key = setup.inference_base_url, setup.api_key  # from the start, before any session
        assert base_url.endswith("/v1") and api_key.startswith("fleetrl-session-")
        session = await setup.open_session()
        assert (setup.inference_base_url, setup.api_key) == (base_url, api_key) and session.api_key == api_key
        assert session.base_url.startswith(setup.inference_base_url.removesuffix("/v1") + "/sessions/")
        async with openai.AsyncOpenAI(base_url=setup.inference_base_url, api_key=setup.api_key, max_retries=0) as c:
            reply = await c.chat.completions.create(model=setup.model, messages=[{"role": "user", "content": "x"}])
        assert reply.choices[0].message.content == "unrecorded" and session.turns == []  # served, recorded nowhere
        assert setup.sessions.sampler.calls[0][1]["max_tokens"] == 5  # the run's max_completion_tokens
    finally:
        await setup.sessions.close()


def make_cookbook_rollout_fn(setup: RolloutSetup):
    """A cookbook rollout in the shape of its examples/rl/eval_protocol_chat/rollout.py: it reads
    `setup.inference_base_url` (in the factory and per row) and never opens a session; its agent calls that
    endpoint with logprobs, and the sample is built from the token ids and logprobs the replies carry."""
    assert setup.inference_base_url is not None, "the cookbook's factory reads it before any rollout"

    async def rollout_fn(row: dict) -> RolloutSample | None:
        params = {"model": setup.model, "base_url": setup.inference_base_url, "logprobs": True}
        async with openai.AsyncOpenAI(base_url=params["base_url"], api_key=setup.api_key, max_retries=0) as client:
            reply = await client.chat.completions.create(
                model=params["model"], messages=row["messages"], logprobs=params["logprobs"]
            )
        choice = reply.choices[0].model_dump()
        prompt, completion = choice["prompt_token_ids"], choice["token_ids"]
        return RolloutSample(
            tokens=prompt + completion,
            logprobs=[0.0] * len(prompt) + choice["token_logprobs"],
            loss_mask=[0] * len(prompt) + [1] * len(completion),
            reward=float(choice["message"]["content"] == row["answer"]),
        )

    return rollout_fn


async def test_a_cookbook_rollout_that_reads_the_setup_url_trains_exactly_what_was_generated(tokenizer, tiny_model_dir):
    run = Config(base_model=tiny_model_dir, dataset="unused", max_completion_tokens=8)
    sampler = ScriptedSampler(tokenizer, ["4", "5"])
    gateway = Gateway(
        GatewayConfig(run=run, rollout="unused:unused"),
        rollout_factory=make_cookbook_rollout_fn,
        tokenizer=tokenizer,
        sampler=sampler,
    )
    setup = await gateway.prepare_rollouts()
    try:
        row = {"messages": [{"role": "user", "content": "2+2="}], "answer": "4"}
        right, wrong = [await gateway.rollout_fn(row) for _ in range(2)]
    finally:
        await setup.sessions.close()
    for sample, (prompt, _), text in zip((right, wrong), sampler.calls, ["4", "5"], strict=True):
        end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        generated = [*tokenizer.encode(text, add_special_tokens=False), end]
        assert sample.tokens == prompt + generated  # the replica's ids, not a re-tokenisation of the reply's text
        assert sample.logprobs[len(prompt) :] == [-0.1 * (i + 1) for i in range(len(generated))]
    assert (right.reward, wrong.reward) == (1.0, 0.0)


async def test_a_setup_made_without_a_running_loop_fills_the_url_at_the_first_session(tokenizer, tiny_model_dir):
    run = Config(base_model=tiny_model_dir, dataset="unused")
    setup = await asyncio.to_thread(RolloutSetup.for_run, run, tokenizer, ScriptedSampler(tokenizer, []))
    assert setup.inference_base_url is None  # nothing to serve on in that thread: nothing bound
    try:
        await setup.open_session()
        assert setup.inference_base_url.endswith("/v1")
    finally:
        await setup.sessions.close()
    with pytest.raises(RuntimeError, match="open_session: this RolloutSetup has no session server"):
        await RolloutSetup().open_session()


AGENT_ELSEWHERE = """
import sys, openai
client = openai.OpenAI(base_url=sys.argv[1], api_key=sys.argv[2], max_retries=0, timeout=60)
reply = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hello?"}])
print(reply.choices[0].message.content)
"""


async def test_an_agent_in_another_process_reaches_its_session_at_the_advertised_host(tokenizer, monkeypatch):
    """FLEETRL_SESSION_HOST binds every interface, FLEETRL_SESSION_ADVERTISE_HOST is the host session URLs name
    (127.0.0.2: another address of this machine, reachable only through the wildcard bind). Before, the server
    always bound 127.0.0.1 and named it, so an agent in a sandbox container could not reach its session."""
    with socket.socket() as probe:  # a port free now, as the chart's fixed agentSessions.port
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setenv("FLEETRL_SESSION_HOST", "0.0.0.0")
    monkeypatch.setenv("FLEETRL_SESSION_ADVERTISE_HOST", "127.0.0.2")
    monkeypatch.setenv("FLEETRL_SESSION_PORT", str(port))
    sampler = ScriptedSampler(tokenizer, ["hi there"])
    server = SessionServer(sampler, tokenizer, model="policy", sample_kwargs={"max_tokens": 16}, max_seq_len=200)
    session = await server.open()
    try:
        assert session.base_url.startswith(f"http://127.0.0.2:{port}/sessions/") and server.host == "0.0.0.0"
        agent = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            AGENT_ELSEWHERE,
            session.base_url,
            session.api_key,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(agent.communicate(), 120)
    finally:
        await server.close()
    assert agent.returncode == 0, err.decode()[-2000:]
    assert out.decode().strip() == "hi there"
    (turn,) = session.turns
    assert turn.completion_token_ids[:-1] == tokenizer.encode("hi there", add_special_tokens=False)


def test_session_hosts_default_to_the_loopback_and_a_wildcard_bind_names_this_hosts_address(monkeypatch):
    monkeypatch.delenv("FLEETRL_SESSION_HOST", raising=False)
    monkeypatch.delenv("FLEETRL_SESSION_ADVERTISE_HOST", raising=False)
    assert session_hosts() == ("127.0.0.1", "127.0.0.1")
    bind, shown = session_hosts("0.0.0.0")
    assert bind == "0.0.0.0" and shown == socket.gethostbyname(socket.gethostname())
    monkeypatch.setenv("FLEETRL_SESSION_ADVERTISE_HOST", "0.0.0.0")
    with pytest.raises(ValueError, match=r"FLEETRL_SESSION_ADVERTISE_HOST: '0\.0\.0\.0' is a wildcard"):
        session_hosts("0.0.0.0")


@pytest.mark.parametrize("value", ["http", "70000", "-1"])
def test_a_bad_session_port_is_refused_naming_the_variable(tokenizer, monkeypatch, value):
    monkeypatch.setenv("FLEETRL_SESSION_PORT", value)
    with pytest.raises(ValueError, match=r"FLEETRL_SESSION_PORT: .* is not a port number"):
        SessionServer(ScriptedSampler(tokenizer, []), tokenizer)


async def test_an_openai_client_reads_each_logprob_entrys_text_and_bytes(tokenizer):
    server = SessionServer(ScriptedSampler(tokenizer, ["a\nb é"]), tokenizer, sample_kwargs={"max_tokens": 16})
    try:
        session = await server.open()
        async with openai.AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0) as client:
            r = await client.chat.completions.create(
                model="policy", messages=[{"role": "user", "content": "x"}], logprobs=True
            )
        entries = r.choices[0].logprobs.content
        assert "Ċ" not in [e.token for e in entries] and "\n" in [e.token for e in entries]
        assert b"".join(bytes(e.bytes) for e in entries) == "a\nb é<|im_end|>".encode()
    finally:
        await server.close()


async def test_a_streamed_reply_that_is_only_a_tool_call_carries_the_logprobs_of_the_unstreamed_one(tokenizer):
    """Before: the logprobs rode on the content chunk only, so a reply that was only a tool call streamed none."""
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    server = SessionServer(ScriptedSampler(tokenizer, [call, call]), tokenizer, sample_kwargs={"max_tokens": 64})
    session = await server.open()
    ask = {"model": "policy", "messages": [{"role": "user", "content": "1 + 2?"}], "tools": TOOLS, "logprobs": True}
    try:
        async with openai.AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0) as client:
            whole = await client.chat.completions.create(**ask)
            stream = await client.chat.completions.create(**ask, stream=True)
            streamed = [e async for chunk in stream for c in chunk.choices if c.logprobs for e in c.logprobs.content]
    finally:
        await server.close()
    assert whole.choices[0].finish_reason == "tool_calls" and whole.choices[0].message.content is None
    entries = whole.choices[0].logprobs.content
    assert [e.logprob for e in entries] == session.turns[0].logprobs
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in entries]


async def test_a_chat_template_that_ignores_tools_is_warned_about_once_naming_the_model(tiny_model_dir, caplog):
    plain = AutoTokenizer.from_pretrained(tiny_model_dir)
    plain.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    server = SessionServer(ScriptedSampler(plain, ["a", "b", "c"]), plain, tokenizer_id="my-org/no-tools-model")
    session = await server.open()
    ask = {"model": "policy", "messages": [{"role": "user", "content": "1 + 2?"}]}
    try:
        async with openai.AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0) as client:
            with caplog.at_level("WARNING", logger="fleetrl.openai_chat"):
                for _ in range(3):
                    await client.chat.completions.create(**ask, tools=TOOLS)
    finally:
        await server.close()
    warnings = [r.getMessage() for r in caplog.records if "ignores `tools`" in r.getMessage()]
    assert len(warnings) == 1 and "my-org/no-tools-model" in warnings[0]
