"""The sampler handed to rollout functions: the Fireworks cookbook interface over fleetrl's inference gRPC API.

`SamplerLike` is the interface (what `RolloutSetup.sampler` holds: a rollout needs only these calls, so a fake or
another client fits); `Sampler` is fleetrl's implementation, used by every gateway and by `fleetrl eval`.

    completions = await setup.sampler.sample_with_prompt_tokens(prompt_ids, n=4, **setup.sample_kwargs)
    completions = await setup.sampler.sample_with_tokens(messages=[{"role": "user", "content": q}], n=1)
    c = completions[0]; c.full_tokens, c.prompt_len, c.inference_logprobs, c.finish_reason, c.text, c.versions

The cookbook's other sampling arguments: `stop` (a string or strings: the replica ends the completion with the
token that completes one, finish_reason "stop", so it does not run on to max_tokens; the sampler cuts there too,
for a replica older than the request's `stop` field), `max_seq_len` (max_tokens is capped so prompt + completion fit),
`http_timeout` (seconds for the whole call, retries included), `logprobs=True` (always on: `inference_logprobs`,
also readable as `sampling_logprobs`); `echo=True` and `logprobs=N` (top-N) are refused with what to use instead.
`user` (the current cookbook's session affinity key, a string) routes every call of that key to one replica while it
stays routable (its prefix cache), and moves the key only when that replica is fenced or fails the call; such calls
are not coalesced. `include_routing_matrix=True` (MoE router replay) is refused: fleetrl returns no expert routes.

Requests go to the live replica with the fewest calls in flight; a call that fails with UNAVAILABLE,
DEADLINE_EXCEEDED or RESOURCE_EXHAUSTED is retried on another replica. When no replica is left to try (the only
one crashed and is restarting, or is being brought to the current version), the call waits with backoff for the
controller's list to change (the gateway refreshes it while `wants_replicas`), up to `replica_wait_s`: a replica
restart is a slow call to the rollout, not a failed one. Slow failures (DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED) are
tried `max_attempts` times at most.

Every reply is checked before a rollout sees it (fleetrl.gateway.replica_replies): a token outside the vocabulary,
a non-finite or positive logprob, lists of different lengths, or a version that is negative or newer than the run
can have produced is the replica's fault. It is counted against the replica (`bad_replies`), the call goes to
another replica, and a replica that answers garbage 3 times in a row is routed around (`health`) for 30 s, doubling
while it goes on. A rollout never sees such a reply; when no other replica is left, the call waits as in an outage.

A call without a `seed` (in its arguments or the run's sample_kwargs) made inside a gateway rollout is seeded from
the rollout (run seed, row, version, sample index, call index: fleetrl.gateway.sampling_seed); elsewhere it is unseeded.
Seeded calls of one prompt and settings made together (a row's G rollouts) go to the replica as one request with a
seed per completion (fleetrl.gateway.sampler_coalesce): one prefill and one gRPC call instead of G, the same tokens.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import grpc

from fleetrl.clients.inference import InferenceClient
from fleetrl.clients.inference_types import SamplingRequest
from fleetrl.gateway.replica_replies import ReplicaHealth, newest_version, reply_fault
from fleetrl.gateway.sampler_coalesce import RequestCoalescer
from fleetrl.gateway.sampling_seed import next_rollout_seed

log = logging.getLogger(__name__)
REPLICA_DROPPED = "replica left the routable set"
RETRYABLE_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED)
"""The gRPC codes of a transient failure (the one list): a Generate call is retried on another replica, a rollout
that failed with one is run again, and a gateway's controller call that failed with one is made again until the
controller has been unreachable for `controller_lost_s` (a lease or heartbeat by the gateway's loop; a row or
evaluation report resent until delivered: fleetrl.gateway.worker.Gateway._deliver)."""
MAX_BACKOFF_S = 2.0
MAX_AFFINITY_KEYS = 100_000
"""Session affinity keys (`user=`) remembered at most; the least recently used is forgotten first."""


class NoReplicaError(RuntimeError):
    """No live inference replica to sample from (for `replica_wait_s`): an outage, not the rollout's fault."""


@dataclass
class SampledCompletion:
    """One completion, shaped as the Fireworks cookbook's sampler returns it."""

    full_tokens: list[int]  # prompt + generated tokens
    prompt_len: int
    inference_logprobs: list[float]  # one per generated token
    finish_reason: str
    text: str
    versions: list[int]  # policy version per generated token

    @property
    def completion_tokens(self) -> list[int]:
        return self.full_tokens[self.prompt_len :]

    @property
    def sampling_logprobs(self) -> list[float]:
        """The current cookbook's name for `inference_logprobs`."""
        return self.inference_logprobs

    @property
    def logprobs(self) -> list[float]:
        return self.inference_logprobs


@runtime_checkable
class SamplerLike(Protocol):
    """What a rollout function may call on `RolloutSetup.sampler` (the Fireworks cookbook's sampler interface)."""

    async def sample_with_prompt_tokens(
        self, prompt_token_ids: Sequence[int], n: int = 1, **kwargs: Any
    ) -> list[SampledCompletion]:
        """`n` completions of a tokenized prompt (kwargs: the run's sampling settings, `stop`, `seed`, ...)."""
        ...

    async def sample_with_tokens(
        self,
        messages: Sequence[dict[str, Any]],
        n: int = 1,
        chat_template_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> list[SampledCompletion]:
        """`n` completions of chat `messages`, the chat template applied with the generation prompt."""
        ...


def cookbook_sampling_args(params: dict[str, Any], prompt_len: int) -> tuple[list[str], float | None]:
    """Take the cookbook's extra sampling arguments out of `params` (in place): returns the stop strings and the
    call's timeout; caps `max_tokens` by `max_seq_len`. Arguments fleetrl cannot honour raise saying what to do."""
    stop = params.pop("stop", None)
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if any(isinstance(x, int) and not isinstance(x, bool) for x in stops):
        params["stop_token_ids"] = (
            *tuple(params.get("stop_token_ids", ()) or ()),
            *(x for x in stops if isinstance(x, int)),
        )
        stops = [x for x in stops if not isinstance(x, int)]
    if not all(isinstance(x, str) and x for x in stops):
        raise TypeError(f"stop must be a string or a list of non-empty strings (or token ids), got {stop!r}")
    logprobs = params.pop("logprobs", None)
    if logprobs not in (None, True, False, 0, 1):
        raise TypeError(
            f"logprobs={logprobs!r}: top-N logprobs are not returned; the sampled token's logprob always is "
            "(completion.inference_logprobs): pass logprobs=True or leave it out"
        )
    if params.pop("include_routing_matrix", False):
        raise TypeError(
            "include_routing_matrix=True is not supported: fleetrl's replicas return no MoE expert routes (router "
            "replay is not implemented); leave include_routing_matrix out"
        )
    if params.pop("echo", False):
        raise TypeError(
            "echo=True is not supported: every completion already carries its prompt (full_tokens[:prompt_len]); "
            "leave echo out"
        )
    max_seq_len = params.pop("max_seq_len", None)
    if max_seq_len is not None:
        room = int(max_seq_len) - prompt_len
        if room < 1:
            raise ValueError(f"the prompt ({prompt_len} tokens) leaves no room under max_seq_len {max_seq_len}")
        params["max_tokens"] = min(int(params.get("max_tokens", 64)), room)
    timeout = params.pop("http_timeout", None)
    return stops, None if timeout is None else float(timeout)


def cut_at_stop(tokenizer: Any, token_ids: list[int], stops: Sequence[str]) -> int | None:
    """How many of `token_ids` to keep so the completion ends with the token that completes the first stop string
    (None: no stop string in it). Binary search over decoded prefixes: a prefix that holds a stop string stays
    holding it as tokens are added."""

    def holds(n: int) -> bool:
        text = tokenizer.decode(token_ids[:n], skip_special_tokens=True)
        return any(s in text for s in stops)

    if not stops or not token_ids or not holds(len(token_ids)):
        return None
    low, high = 1, len(token_ids)
    while low < high:
        mid = (low + high) // 2
        if holds(mid):
            high = mid
        else:
            low = mid + 1
    return low


class Sampler:
    """`SamplerLike` over fleetrl's inference replicas (see the module docstring)."""

    def __init__(
        self,
        tokenizer: Any = None,
        *,
        auth_token: str | None = None,
        request_timeout_s: float = 600.0,
        max_attempts: int = 4,
        backoff_s: float = 0.2,
        replica_wait_s: float = 300.0,
        default_kwargs: dict[str, Any] | None = None,
        coalesce: bool = True,
        vocab_size: int | None = None,
        version_probe: Callable[[], Awaitable[int | None]] | None = None,
        health: ReplicaHealth | None = None,
        check_replies: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.auth_token = auth_token
        self.request_timeout_s = request_timeout_s
        self.max_attempts = max_attempts
        self.backoff_s = backoff_s
        self.replica_wait_s = replica_wait_s
        self.default_kwargs = dict(default_kwargs or {})
        self._clients: dict[str, InferenceClient] = {}
        self._in_flight: dict[str, int] = {}
        self._calls: dict[str, set[asyncio.Task[Any]]] = {}  # calls in flight per replica
        self._routable: list[str] = []
        self._affinity: OrderedDict[str, str] = OrderedDict()  # user= key -> its replica
        # Seeded calls of one prompt made together go out as one request (fleetrl.gateway.sampler_coalesce).
        self.coalescer = RequestCoalescer(self.generate) if coalesce else None
        self.calls = 0
        self.retries = 0
        self.wants_replicas = False  # a call found no replica to try since the last set_replicas: refresh the list
        # Replies are checked (False: trusted as they come, for scripted replicas in tests that answer names).
        self.check_replies = check_replies
        self.vocab_size = vocab_size  # token ids must be below it (None: only non-negative)
        # The newest version a replica may serve as far as the controller's last reply said (None: unknown), and a
        # call that asks the controller afresh (the newest trained version) before a newer one is called garbage.
        self.max_version: int | None = None
        self.version_probe = version_probe
        self.health = health if health is not None else ReplicaHealth()

    # --- replicas ------------------------------------------------------------------------------
    def set_replicas(self, addresses: Sequence[str]) -> None:
        """The live, unfenced replicas (from the controller); calls go only to these."""
        for address in addresses:
            if address not in self._clients:
                self._clients[address] = InferenceClient(address, auth_token=self.auth_token)
                self._in_flight[address] = 0
        dropped = set(self._routable) - set(addresses)
        self._routable = [a for a in addresses]
        self.wants_replicas = False
        for address in dropped:  # fenced (hung, stopped, behind): its calls in flight are retried elsewhere now
            calls = list(self._calls.get(address, ()))
            for call in calls:
                call.cancel(REPLICA_DROPPED)
            if calls:
                log.warning(
                    "replica %s left the routable set: %d calls in flight retried elsewhere", address, len(calls)
                )

    def set_version(self, version: int) -> None:
        """The run's live version (the controller's lease reply): a replica may serve it, or the next one being
        pushed; a reply naming a newer one makes the sampler ask `version_probe` before refusing it."""
        self.max_version = max(self.max_version or 0, version + 1)

    @property
    def bad_replies(self) -> dict[str, int]:
        """Garbage replies per replica address (refused, retried elsewhere)."""
        return dict(self.health.bad_replies)

    async def _reply_fault(self, request: SamplingRequest, completions: list[Any]) -> str | None:
        fault = reply_fault(request, completions, vocab_size=self.vocab_size, max_version=self.max_version)
        newest = newest_version(completions)
        if fault is None or self.version_probe is None or self.max_version is None or newest is None:
            return fault
        if newest <= self.max_version:
            return fault
        # Newer than the controller's last word: it may have trained and pushed since. Ask it before judging.
        probed = await self.version_probe()
        if probed is None:
            return fault
        self.max_version = max(self.max_version, probed)
        return reply_fault(request, completions, vocab_size=self.vocab_size, max_version=self.max_version)

    @property
    def replicas(self) -> list[str]:
        return list(self._routable)

    def _pick(self, avoid: set[str], affinity: str | None = None) -> str | None:
        """The replica `affinity` is pinned to while it is routable and not in `avoid`; else the least busy routable
        replica not in `avoid` (which `affinity` is then pinned to), or None."""
        if affinity is not None:
            pinned = self._affinity.get(affinity)
            usable = pinned is not None and not self.health.fenced(pinned, time.monotonic())
            if usable and pinned in self._routable and pinned not in avoid:
                self._affinity.move_to_end(affinity)
                return pinned
        now = time.monotonic()
        candidates = [a for a in self._routable if a not in avoid and not self.health.fenced(a, now)]
        if not candidates:
            return None
        least = min(self._in_flight[a] for a in candidates)
        address = random.choice([a for a in candidates if self._in_flight[a] == least])
        if affinity is not None:
            self._affinity[affinity] = address
            self._affinity.move_to_end(affinity)
            if len(self._affinity) > MAX_AFFINITY_KEYS:
                self._affinity.popitem(last=False)
        return address

    async def generate(self, request: SamplingRequest, affinity: str | None = None) -> list[Any]:
        """Engine completions for one request, retried on another replica when one is unavailable, waiting (up
        to `replica_wait_s`) when none is left to try. `affinity` (a session key) keeps to one replica."""
        tried: set[str] = set()
        self.calls += 1
        slow_failures, waits = 0, 0
        deadline = time.monotonic() + self.replica_wait_s
        last_error: grpc.aio.AioRpcError | None = None
        while True:
            address = self._pick(tried, affinity)
            if address is None:  # none routable, or every one failed this call: wait for the list to change
                self.wants_replicas = True
                if time.monotonic() >= deadline:
                    if last_error is not None and self._routable:
                        raise last_error
                    now = time.monotonic()
                    garbage = sum(self.health.fenced(a, now) for a in self._routable)
                    why = f" ({garbage} routed around for answering garbage)" if garbage else ""
                    raise NoReplicaError(
                        f"no live inference replica to sample from for {self.replica_wait_s:.0f} s{why}"
                    )
                await asyncio.sleep(min(self.backoff_s * 2**waits, MAX_BACKOFF_S))
                waits += 1
                tried.clear()  # those that failed may be back (or replaced) by now
                continue
            self._in_flight[address] += 1
            call = asyncio.ensure_future(self._clients[address].generate(request, timeout_s=self.request_timeout_s))
            self._calls.setdefault(address, set()).add(call)
            completions: list[Any] | None = None
            try:
                completions = await asyncio.shield(call)
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if not call.cancelled() or (current is not None and current.cancelling()):
                    call.cancel()
                    raise  # the caller itself was cancelled (a rollout timeout, shutdown)
                tried.add(address)  # set_replicas cancelled it: the replica was fenced
                self.retries += 1
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in RETRYABLE_CODES:
                    raise
                if exc.code() != grpc.StatusCode.UNAVAILABLE:
                    slow_failures += 1
                    if slow_failures >= self.max_attempts:
                        raise
                tried.add(address)
                last_error = exc
                self.retries += 1
                # Once per replica and call; a call going round the list again while one restarts logs quietly.
                level = logging.WARNING if waits == 0 else logging.DEBUG
                log.log(level, "replica %s: %s; retrying (elsewhere if another is routable)", address, exc.code().name)
            finally:
                self._in_flight[address] -= 1
                self._calls[address].discard(call)
            if completions is None:
                continue
            fault = await self._reply_fault(request, completions) if self.check_replies else None
            if fault is None:
                self.health.good(address)
                return completions
            tried.add(address)
            self.retries += 1
            fenced_s = self.health.bad(address, time.monotonic())
            log.warning("replica %s answered garbage (%s); asking another replica", address, fault)
            if fenced_s is not None:
                log.warning(
                    "replica %s answered garbage %d times in a row: not routed to for %.0f s",
                    address,
                    self.health.max_bad_in_a_row,
                    fenced_s,
                )

    # --- the cookbook interface -----------------------------------------------------------------
    async def sample_with_prompt_tokens(
        self, prompt_token_ids: Sequence[int], n: int = 1, **kwargs: Any
    ) -> list[SampledCompletion]:
        params = {**self.default_kwargs, **kwargs}
        stops, timeout_s = cookbook_sampling_args(params, len(prompt_token_ids))
        if stops and self.tokenizer is None:
            raise RuntimeError("stop strings need a tokenizer (RolloutSetup.tokenizer); or pass stop_token_ids")
        user = params.pop("user", None)
        if user is not None and not isinstance(user, str):
            raise TypeError(f"user must be a string (a session affinity key) or None, got {type(user).__name__}")
        seed = params.pop("seed", None)
        if seed is None:  # an explicit seed wins; the rollout's own seed is drawn only when it is used
            seed = next_rollout_seed()
        request = SamplingRequest(
            prompt_token_ids=list(prompt_token_ids),
            n=n,
            max_tokens=int(params.pop("max_tokens", 64)),
            temperature=float(params.pop("temperature", 1.0)),
            top_p=float(params.pop("top_p", 1.0)),
            top_k=int(params.pop("top_k", 0) or 0),
            stop_token_ids=tuple(params.pop("stop_token_ids", ()) or ()),
            seed=seed,
            stop=tuple(stops),
        )
        if params:
            raise TypeError(f"unknown sampling arguments: {sorted(params)}")
        prompt = list(prompt_token_ids)
        if user is not None:  # a session's call goes to its replica, not merged with other sessions' calls
            call = self.generate(request, affinity=user)
        else:
            call = self.generate(request) if self.coalescer is None else self.coalescer.generate(request)
        completions = await (call if timeout_s is None else asyncio.wait_for(call, timeout=timeout_s))
        out = []
        for c in completions:
            tokens, logprobs, versions, finish = list(c.token_ids), list(c.logprobs), list(c.versions), c.finish_reason
            # The engine ended the completion at the stop string; the same cut here is a safety net for a replica
            # that predates `stop` on the request (it ignores the field and runs on): it keeps what the engine would.
            keep = cut_at_stop(self.tokenizer, tokens, stops)
            if keep is not None:  # a stop string ends it, even one completed by the last token of a "length" cut
                tokens, logprobs, versions, finish = tokens[:keep], logprobs[:keep], versions[:keep], "stop"
            text = self.tokenizer.decode(tokens, skip_special_tokens=True) if self.tokenizer is not None else ""
            out.append(SampledCompletion(prompt + tokens, len(prompt), logprobs, finish, text, versions))
        return out

    def encode_messages(
        self, messages: Sequence[dict[str, Any]], chat_template_kwargs: dict[str, Any] | None = None
    ) -> list[int]:
        """The chat template applied to `messages` with the generation prompt, as token ids (extra template
        arguments, e.g. Qwen3's `enable_thinking=False`, in `chat_template_kwargs`)."""
        if self.tokenizer is None:
            raise RuntimeError("sample_with_tokens needs a tokenizer (RolloutSetup.tokenizer)")
        ids = self.tokenizer.apply_chat_template(
            list(messages), add_generation_prompt=True, tokenize=True, **(chat_template_kwargs or {})
        )
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # transformers 5 may return a BatchEncoding
            ids = ids["input_ids"]
        return [int(t) for t in ids]

    async def sample_with_tokens(
        self,
        messages: Sequence[dict[str, Any]],
        n: int = 1,
        chat_template_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> list[SampledCompletion]:
        prompt = self.encode_messages(messages, chat_template_kwargs)
        return await self.sample_with_prompt_tokens(prompt, n=n, **kwargs)

    async def close(self) -> None:
        for client in self._clients.values():
            await client.close()
        self._clients.clear()
