"""Agent sessions under load and abuse (issue 45, item 8): one session server in its own process, hit by 10,000
sessions opened and abandoned, 200 concurrent streaming clients, slow readers, bodies over the size limit, wrong
and missing keys and a connection flood; the server's RSS and open file descriptors after each phase, and whether
it still answers.

Command (from the repository root; a few minutes):

    python bench/agent_session_load.py [--sessions 10000] [--streams 200] [--idle-s 60] [--stall-s 30]

The server process (`--serve`, started by the bench) runs a `SessionServer` over the tiny model's tokenizer and an
instant scripted sampler (no model: what is measured is the session server, not generation), with
`session_idle_timeout_s = --idle-s` (60 s; the default is 600 s, which the bench would wait out) and the default
stall limit, `--stall-s` 30 s (keep it above uvicorn's 5 s keep-alive, which closes a client's pooled connection
first, gently, as the defaults do; and above the longest a starved client takes between connecting and sending:
on a loaded 2-core machine, 10 s limits expired sessions and cut connections before the bench's own calls came).
Its sessions are held by the process as a rollout waiting on an agent that never comes back would hold them: only
the idle limit expires them. Once a session expired (or closed) the process drops it, as a rollout drops a sample
that timed out, so the RSS is the server's own and not what rollouts kept to train on (each slow reader's session
recorded its 120,000-token turn, ~3 MB); `--keep-sessions` holds every session to the end instead. Its RSS and
descriptors are read from /proc.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LONG_REPLY_TOKENS = 60_000


def serve(args: argparse.Namespace) -> None:
    """The server process: commands on stdin ('open N', 'stats'), one JSON line each on stdout."""
    from transformers import AutoTokenizer

    from fleetrl.gateway.sampler import SampledCompletion
    from fleetrl.gateway.session_limits import SessionLimits
    from fleetrl.gateway.session_server import SessionServer
    from fleetrl.shell.heap import heap_trim_interval, trim_heap_every

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    short = tokenizer.encode("a short reply", add_special_tokens=False)
    long = tokenizer.encode("ab " * LONG_REPLY_TOKENS, add_special_tokens=False)

    class InstantSampler:
        async def sample_with_prompt_tokens(self, prompt, n=1, **kwargs):
            tokens = long if tokenizer.decode(prompt).count("LONG") else short
            m = len(tokens)
            return [SampledCompletion([*prompt, *tokens], len(prompt), [-0.5] * m, "stop", "", [0] * m)]

    async def main() -> None:
        limits = SessionLimits(idle_timeout_s=args.idle_s, stall_timeout_s=args.stall_s)
        server = SessionServer(InstantSampler(), tokenizer, sample_kwargs={"max_tokens": 10**6}, limits=limits)
        await server.start()
        # The gateway's service shell gives freed heap pages back every FLEETRL_HEAP_TRIM_S (fleetrl.shell.heap);
        # the bench's server does the same unless --no-trim, so its RSS is what a gateway's would be.
        trimmer = asyncio.create_task(trim_heap_every(0 if args.no_trim else heap_trim_interval(), asyncio.Event()))
        held = []  # abandoned sessions stay held, as a hung rollout would hold them (dropped once expired)
        print(json.dumps({"port": server.port, "key": server.api_key}), flush=True)
        loop = asyncio.get_running_loop()
        while line := await loop.run_in_executor(None, sys.stdin.readline):
            command = line.split()
            if command[0] == "open":
                opened = [await server.open() for _ in range(int(command[1]))]
                held += opened
                print(json.dumps([s.session_id for s in opened]), flush=True)
            elif command[0] == "stats":
                server.sweep_if_due()
                if not args.keep_sessions:  # a rollout drops a sample whose session expired or closed
                    held = [s for s in held if server.sessions.get(s.session_id) is not None]
                stats = {**server.stats, "tracked": server.sessions.tracked(), "connections": server.connections()}
                # what the connections' transports hold unsent (-1: a server from before it could say, to compare)
                stats["unsent_bytes"] = getattr(server, "unsent_bytes", lambda: -1)()
                stats["answered"] = sum(len(s.turns) for s in held)  # calls answered in the sessions still held
                print(json.dumps(stats), flush=True)
        trimmer.cancel()
        await server.close()

    asyncio.run(main())


class Server:
    """The server process and its figures."""

    def __init__(self, args: argparse.Namespace) -> None:
        command = [sys.executable, __file__, "--serve", "--model", args.model]
        command += ["--idle-s", str(args.idle_s), "--stall-s", str(args.stall_s)]
        command += (["--no-trim"] if args.no_trim else []) + (["--keep-sessions"] if args.keep_sessions else [])
        self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        hello = json.loads(self.proc.stdout.readline())
        self.port, self.key = hello["port"], hello["key"]

    def ask(self, line: str):
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def figures(self) -> tuple[float, int]:
        return self.status("VmRSS"), len(os.listdir(f"/proc/{self.proc.pid}/fd"))

    def status(self, field: str) -> float:
        """A /proc/<pid>/status figure in MiB (VmRSS: now; VmHWM: the peak so far)."""
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        return next(int(x.split()[1]) for x in status.splitlines() if x.startswith(f"{field}:")) / 1024

    def url(self, session_id: str) -> str:
        return f"http://127.0.0.1:{self.port}/sessions/{session_id}/v1"


async def settle(server: Server, timeout_s: float) -> dict:
    """Wait until the server holds no connection and no session (idle limit and stall limit passed)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = server.ask("stats")
        if (stats["connections"] == 0 and stats["tracked"] == 0) or time.monotonic() > deadline:
            return stats
        await asyncio.sleep(0.5)


async def run(args: argparse.Namespace) -> None:
    import httpx
    import openai

    server = Server(args)
    rows: list[tuple[str, str, float, int]] = []

    def record(phase: str, outcome: str) -> None:
        rss, fds = server.figures()
        rows.append((phase, outcome, rss, fds))
        stats = server.ask("stats")
        peak = server.status("VmHWM")
        line = f"{phase:44s} {outcome:40s} rss {rss:7.1f} MiB (peak {peak:7.1f})  fds {fds:5d}  {json.dumps(stats)}"
        print(line, flush=True)

    ask = {"model": "policy", "messages": [{"role": "user", "content": "hello"}]}
    try:
        record("start", "")
        # warm up: one call of each kind, so the first phase does not count the server's first allocations
        (sid,) = server.ask("open 1")
        async with openai.AsyncOpenAI(base_url=server.url(sid), api_key=server.key, max_retries=0) as c:
            await c.chat.completions.create(**ask)
            await c.chat.completions.create(**ask, stream=True)
        await settle(server, args.idle_s * 3 + args.stall_s * 3)
        record("warmed up (1 call, idle limit passed)", "")
        base = rows[-1]

        shared = openai.AsyncOpenAI(base_url=server.url(sid), api_key=server.key, max_retries=0)
        ok, errors = 0, {}
        for start in range(0, args.sessions, 100):
            ids = server.ask(f"open {min(100, args.sessions - start)}")  # opened, called once, then abandoned
            calls = (shared.with_options(base_url=server.url(s)).chat.completions.create(**ask) for s in ids)
            for r in await asyncio.gather(*calls, return_exceptions=True):
                if isinstance(r, Exception):
                    errors[type(r).__name__] = errors.get(type(r).__name__, 0) + 1
                else:
                    ok += r.choices[0].message.content == "a short reply"
        await shared.close()
        record(f"{args.sessions} sessions opened, 1 call each", f"{ok} replies, errors {errors}")
        stats = await settle(server, args.idle_s * 3 + args.stall_s * 3)
        record(
            "  abandoned, after the idle limit", f"{stats.get('sessions_expired', 0)} expired, {stats['tracked']} kept"
        )

        async def streamer(session_id: str) -> str:
            async with openai.AsyncOpenAI(base_url=server.url(session_id), api_key=server.key, max_retries=0) as c:
                stream = await c.chat.completions.create(**ask, stream=True, logprobs=True)
                return "".join([ch.choices[0].delta.content or "" async for ch in stream if ch.choices])

        whole, errors = 0, {}
        for _ in range(3):
            ids = server.ask(f"open {args.streams}")
            for r in await asyncio.gather(*(streamer(s) for s in ids), return_exceptions=True):
                if isinstance(r, Exception):
                    errors[type(r).__name__] = errors.get(type(r).__name__, 0) + 1
                else:
                    whole += r == "a short reply"
        record(
            f"{args.streams} streaming clients at once, 3 rounds",
            f"{whole} of {3 * args.streams} whole, errors {errors}",
        )

        for round_ in range(args.slow_rounds):
            answered = server.ask("stats")["answered"]
            ids = server.ask(f"open {args.slow_readers}")
            readers = []
            for s in ids:
                sock = socket.socket()
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                sock.connect(("127.0.0.1", server.port))
                body = json.dumps({**ask, "messages": [{"role": "user", "content": "LONG"}], "logprobs": True}).encode()
                head = f"POST /sessions/{s}/v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                head += f"Authorization: Bearer {server.key}\r\n"
                sock.sendall(
                    f"{head}Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body
                )
                readers.append(sock)
            deadline = time.monotonic() + args.stall_s
            while server.ask("stats")["answered"] < answered + len(ids) and time.monotonic() < deadline:
                await asyncio.sleep(0.5)  # until every reader's call was answered (its reply being written)
            record(f"{args.slow_readers} readers of ~10 MB replies that read nothing", f"round {round_ + 1}")
            stats = await settle(server, args.stall_s * 4 + args.idle_s * 3)
            record("  after the stall limit", f"{stats.get('connections_stalled', 0)} cut off")
            for sock in readers:
                sock.close()

        (sid,) = server.ask("open 1")
        big = b'{"model": "policy", "messages": [{"role": "user", "content": "' + b"a" * (64 * 2**20) + b'"}]}'
        codes: dict[int | str, int] = {}
        async with httpx.AsyncClient(timeout=60) as http:
            for _ in range(args.big_bodies):
                try:
                    r = await http.post(
                        server.url(sid) + "/chat/completions",
                        content=big,
                        headers={"authorization": f"Bearer {server.key}", "content-type": "application/json"},
                    )
                    codes[r.status_code] = codes.get(r.status_code, 0) + 1
                except httpx.TransportError as exc:  # the server answered 413 and closed while the body was sent
                    codes[type(exc).__name__] = codes.get(type(exc).__name__, 0) + 1
            record(f"{args.big_bodies} bodies of 64 MiB", json.dumps(codes))
            codes = {}
            for k in range(args.bad_keys):
                headers = {} if k % 2 else {"authorization": f"Bearer wrong-{k}"}
                url = server.url(sid if k % 3 else "0" * 32)
                r = await http.post(url + "/chat/completions", json=ask, headers=headers)
                codes[r.status_code] = codes.get(r.status_code, 0) + 1
            record(f"{args.bad_keys} calls with a wrong or missing key", json.dumps(codes))

        flood = []
        for _ in range(args.flood):
            sock = socket.socket()
            sock.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                sock.connect(("127.0.0.1", server.port))
            flood.append(sock)
        await asyncio.sleep(1.0)  # let the server accept what it will (a bench's pause, not a test's sync)
        stats = server.ask("stats")
        record(
            f"a flood of {args.flood} idle connections",
            f"{stats['connections']} open, {stats.get('connections_refused', 0)} refused",
        )
        stats = await settle(server, args.stall_s * 4 + args.idle_s * 3)
        record(
            "  after the stall limit",
            f"{stats['connections']} open, {stats.get('connections_stalled', 0)} stalled in all",
        )
        for sock in flood:
            sock.close()

        (sid,) = server.ask("open 1")
        async with openai.AsyncOpenAI(base_url=server.url(sid), api_key=server.key, max_retries=0) as c:
            reply = await c.chat.completions.create(**ask)
        await settle(server, args.idle_s * 3 + args.stall_s * 3)
        record("end: a call answered, idle limit passed", reply.choices[0].message.content)
        alive = server.proc.poll() is None
        rss, fds = rows[-1][2] - base[2], rows[-1][3] - base[3]
        print(f"server alive: {alive}; rss {rss:+.1f} MiB, fds {fds:+d} from warmed up")
    finally:
        server.proc.stdin.close()
        server.proc.wait(60)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", help="HF model folder (its tokenizer); default: a fresh tiny model")
    p.add_argument("--sessions", type=int, default=10_000)
    p.add_argument("--streams", type=int, default=200)
    p.add_argument("--slow-readers", type=int, default=50)
    p.add_argument("--slow-rounds", type=int, default=1, help="rounds of slow readers (RSS after a second one)")
    p.add_argument("--big-bodies", type=int, default=20)
    p.add_argument("--bad-keys", type=int, default=3000)
    p.add_argument("--flood", type=int, default=5000)
    p.add_argument("--idle-s", type=float, default=60.0)
    p.add_argument("--stall-s", type=float, default=30.0)
    p.add_argument("--no-trim", action="store_true", help="the server does not trim its heap (the shell's default)")
    p.add_argument(
        "--keep-sessions",
        action="store_true",
        help="the server's process holds every session to the end (default: drops each once it expired or closed)",
    )
    args = p.parse_args()
    if args.model is None:
        from fleetrl.tiny_model import build_tiny_model

        args.model = str(build_tiny_model(Path(tempfile.mkdtemp()) / "tiny"))
    if args.serve:
        serve(args)
    else:
        asyncio.run(run(args))


if __name__ == "__main__":
    main()
