"""What an agent session's HTTP hop costs: the same chat calls through the session server with the official `openai`
client, and straight through the gateway's sampler (the chat template applied by hand), on one hf replica.

Command (from the repository root; about a minute):

    python bench/agent_session.py [--model DIR] [--sessions 8] [--turns 3] [--max-tokens 8] [--rounds 5]

One process, one torch thread: an hf engine behind its gRPC server on loopback, a `Sampler`, a `SessionServer` and
`openai.AsyncOpenAI` clients, all in it (so the client's and the server's costs count). Each round runs `--sessions`
conversations at once, `--turns` calls each (a user message appended after each reply), in three arms alternating
per round: `session` (through the session server, every call recorded, a new `AsyncOpenAI` client per session as
examples/openai_agent does), `session_shared_client` (the same, one client's connection pool shared by every
session through `with_options(base_url=...)`) and `sampler` (the same prompts rendered
with the tokenizer's chat template and sampled with `sample_with_prompt_tokens`, what a hand-written rollout does).
Reported: mean wall seconds and process CPU seconds per round of the middle rounds (fastest and slowest dropped),
and the difference per call.
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import statistics
import tempfile
import time
from pathlib import Path


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def run(args: argparse.Namespace) -> None:
    import openai
    import torch
    from transformers import AutoTokenizer

    from fleetrl.gateway.sampler import Sampler
    from fleetrl.gateway.session_server import SessionServer
    from fleetrl.openai_chat import render_chat_prompt
    from fleetrl.services.inference.config import InferenceConfig
    from fleetrl.services.inference.server import create_server, make_engine

    torch.set_num_threads(1)
    config = InferenceConfig(model=args.model, engine="hf", grpc_port=0, http_port=None, metrics_port=None)
    service = create_server(config, make_engine(config))
    await service.start()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    sampler = Sampler(tokenizer)
    sampler.set_replicas([f"127.0.0.1:{service.grpc_port}"])
    sampling = {"temperature": 1.0, "max_tokens": args.max_tokens}
    server = SessionServer(sampler, tokenizer, sample_kwargs=sampling)
    await server.start()

    async def by_session(k: int) -> None:
        session = await server.open()
        async with openai.AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0) as client:
            messages = [{"role": "user", "content": f"count {k} to {k + 3}:"}]
            for turn in range(args.turns):
                reply = await client.chat.completions.create(model="policy", messages=messages)
                messages += [{"role": "assistant", "content": reply.choices[0].message.content or ""}]
                messages += [{"role": "user", "content": f"and {turn}?"}]
        session.to_rollout_run(reward=0.0)

    shared = openai.AsyncOpenAI(base_url=server.base_url, api_key=server.api_key, max_retries=0)

    async def by_session_shared_client(k: int) -> None:
        session = await server.open()
        client = shared.with_options(base_url=session.base_url)  # one connection pool for every session
        messages = [{"role": "user", "content": f"count {k} to {k + 3}:"}]
        for turn in range(args.turns):
            reply = await client.chat.completions.create(model="policy", messages=messages)
            messages += [{"role": "assistant", "content": reply.choices[0].message.content or ""}]
            messages += [{"role": "user", "content": f"and {turn}?"}]
        session.to_rollout_run(reward=0.0)

    async def by_sampler(k: int) -> None:
        messages = [{"role": "user", "content": f"count {k} to {k + 3}:"}]
        for turn in range(args.turns):
            prompt = render_chat_prompt(tokenizer, messages)
            (c,) = await sampler.sample_with_prompt_tokens(prompt, n=1, user=f"s{k}", **sampling)
            messages += [{"role": "assistant", "content": c.text}, {"role": "user", "content": f"and {turn}?"}]

    arms = {"session": by_session, "session_shared_client": by_session_shared_client, "sampler": by_sampler}
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in arms}
    try:
        for _ in range(args.rounds):
            for name, arm in arms.items():
                t, c = time.perf_counter(), cpu_s()
                await asyncio.gather(*(arm(k) for k in range(args.sessions)))
                results[name].append((time.perf_counter() - t, cpu_s() - c))
    finally:
        await shared.close()
        await server.close()
        await sampler.close()
        await service.stop()
    calls = args.sessions * args.turns
    means = {}
    for name, rows in results.items():
        middle = sorted(rows)[1:-1] if len(rows) > 2 else rows
        means[name] = (statistics.mean(w for w, _ in middle), statistics.mean(c for _, c in middle))
        print(f"{name:22s} wall {means[name][0]:.3f} s  cpu {means[name][1]:.3f} s  per round of {calls} calls")
    for name in ("session", "session_shared_client"):
        wall = (means[name][0] - means["sampler"][0]) / calls * 1e3
        cpu = (means[name][1] - means["sampler"][1]) / calls * 1e3
        print(f"{name} - sampler: {wall:+.2f} ms wall, {cpu:+.2f} ms cpu per call")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="HF model folder; default: a fresh tiny model")
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    if args.model is None:
        from fleetrl.tiny_model import build_tiny_model

        args.model = str(build_tiny_model(Path(tempfile.mkdtemp()) / "tiny"))
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
