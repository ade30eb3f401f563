"""`HFEngine`: a lean transformers inference engine for CPU development and fast tests.

Not a substitute for vLLM, but the same API and semantics (one conformance suite checks both). Design:
- `generate()` queues a request group (n sequences) and awaits a future; one worker thread runs the batching
  loop: admit waiting groups (up to `max_num_seqs` sequences), prefill them (once per prompt, the KV cache then
  copied n times), then decode one token for every active sequence per step in a single batched forward.
- The batch shares one left-padded KV cache (transformers DynamicCache) with a 2-D attention mask and explicit
  position ids; finished sequences are dropped from it and all-padding leading columns trimmed.
- A request's stop strings end a sequence at the token that completes the first one in its decoded text
  (special tokens skipped): the completion ends there, finish_reason "stop", as a stop token would end it.
- Each sequence samples with its own torch.Generator (seed + index, or its own of `seeds`, when seeded), so a
  seeded request gives the same tokens whatever else is in the batch. Logprobs are those of the processed
  distribution (sampling.py).
- Weight loads fetch and verify while generation continues; the worker swaps the tensors in between two decode
  steps (the pause), then recomputes the KV cache of in-flight sequences with the new weights. Tokens sampled
  after the swap record the new version and come from exactly that version's forward.
- Versions are received into one reused host buffer (fleetrl.weights.fetch.ReceiveBuffer): fresh memory for each
  version cost a page fault per 4 KiB, 0.35 s per 0.42 GB here, on every load. The buffer (one version's bytes)
  is kept while versions keep coming and given back to the OS once no load came for `receive_idle_s`.
- A LoRA adapter version (`manifest.is_adapter`, engine started with `max_lora_rank` > 0) is checked against the
  model (services/inference/lora.py) and merged before the pause: each adapted weight becomes a kept copy of its
  base weight plus scaling * B @ A, so the swap is the same in-place copy as for full weights and version N's
  adapter always lands on the base, never on top of version N-1's (layers N-1 adapted and N does not get their
  base back).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import random
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from fleetrl.model_path import check_model_path
from fleetrl.services.inference.engine import (
    FINISH_LENGTH,
    FINISH_STOP,
    Completion,
    EngineError,
    EngineStats,
    InferenceEngine,
    LoadResult,
    SamplingRequest,
    WeightLoadError,
    check_state_dict_matches,
)
from fleetrl.services.inference.hf_batch import KVBatch
from fleetrl.services.inference.lora import plan_adapter
from fleetrl.services.inference.sampling import processed_logprobs, sample_tokens
from fleetrl.weights.fetch import ReceiveBuffer
from fleetrl.weights.host_memory import return_freed_memory

logger = logging.getLogger(__name__)
_RATE_WINDOW_S = 10.0
RECEIVE_IDLE_S = 30.0  # the receive buffer goes back to the OS after this long without a load


@dataclass(eq=False)
class _Group:
    request: SamplingRequest
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    seqs: list[_Seq] = field(default_factory=list)
    remaining: int = 0
    cancelled: bool = False


@dataclass(eq=False)
class _Seq:
    group: _Group
    generator: torch.Generator
    stop_ids: frozenset[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass(eq=False)
class _Swap:
    version: int
    checksum: str
    tensors: dict[str, torch.Tensor]
    adapted: frozenset[str] | None  # the weights an adapter version adapts; None for a full version
    done: Future = field(default_factory=Future)


class HFEngine(InferenceEngine):
    """Batched, KV-cached sampling with a transformers causal LM (float32 on CPU by default)."""

    engine_name = "hf"

    def __init__(
        self,
        model_path: str,
        *,
        max_num_seqs: int = 64,
        dtype: str = "float32",
        seed: int = 0,
        request_timeout_s: float = 600.0,
        max_lora_rank: int = 0,
        device: str = "cpu",
        receive_idle_s: float = RECEIVE_IDLE_S,
    ) -> None:
        """max_lora_rank: the largest LoRA adapter rank accepted (0 = full-weight versions only); device: where the
        model, its KV cache, the batch and sampling live (cpu, cuda, cuda:1; each row's seeded CPU generator
        draws one number per token); receive_idle_s: the reused receive buffer is released after this long
        without a load."""
        self.model_path = str(model_path)
        self._device = torch.device(device)
        self.loaded_version = 0
        self.loaded_checksum = ""
        self._max_num_seqs = max_num_seqs
        self._dtype = getattr(torch, dtype)
        self._rng = random.Random(seed)
        self._request_timeout_s = request_timeout_s
        self._max_lora_rank = max_lora_rank
        self._lora_base: dict[str, torch.Tensor] = {}  # base copies of every weight an adapter has touched
        self._lora_adapted: frozenset[str] = frozenset()  # weights that now hold base + the adapter's delta
        self._model = None
        self._cv = threading.Condition()
        self._pending: collections.deque[_Group] = collections.deque()
        self._swap: _Swap | None = None
        self._stopping = False
        self._failure: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._load_lock = asyncio.Lock()
        self.receive_buffer = ReceiveBuffer()  # versions arrive here; the swap copies them into the model
        self._receive_idle_s = receive_idle_s
        self._receive_release: asyncio.TimerHandle | None = None
        self._batch = KVBatch(None)  # the running batch, owned by the worker thread
        # Stats.
        self._stats_lock = threading.Lock()
        self._tokens_total = 0
        self._requests_total = 0
        self._recent: collections.deque[tuple[float, int]] = collections.deque()
        self._started_at = time.monotonic()

    # ----- lifecycle -----
    async def start(self) -> None:
        await asyncio.to_thread(self._load_model)
        self._thread = threading.Thread(target=self._run, name="hf-engine", daemon=True)
        self._thread.start()

    def _load_model(self) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

        check_model_path(self.model_path)
        model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=self._dtype)
        model.to(self._device)
        model.eval()
        eos: set[int] = set()
        tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        if tokenizer.eos_token_id is not None:
            eos.add(int(tokenizer.eos_token_id))
        try:
            gen_eos = GenerationConfig.from_pretrained(self.model_path).eos_token_id
        except OSError:  # no generation_config.json: the model config's eos is all there is
            gen_eos = model.config.eos_token_id
        eos.update([gen_eos] if isinstance(gen_eos, int) else list(gen_eos or []))
        self._eos_ids = frozenset(eos)
        self._tokenizer = tokenizer  # for stop strings (the worker thread decodes)
        self._state = model.state_dict()
        self._specs = {name: (tuple(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in self._state.items()}
        seen: dict[int, str] = {}
        self._aliases = frozenset(
            name for name, t in self._state.items() if seen.setdefault(t.untyped_storage().data_ptr(), name) != name
        )
        self._max_len = int(getattr(model.config, "max_position_embeddings", 0) or 0) or None
        self._model = model
        self._batch = KVBatch(model)

    async def shutdown(self) -> None:
        if self._receive_release is not None:
            self._receive_release.cancel()
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30.0)
            if self._thread.is_alive():
                logger.error("hf engine worker did not stop within 30 s")
        self._fail_all(EngineError("the engine was shut down"))

    @property
    def vocab_size(self) -> int | None:
        return None if self._model is None else int(self._model.config.vocab_size)

    @property
    def max_model_len(self) -> int | None:
        return None if self._model is None else self._max_len

    # ----- requests -----
    async def generate(self, request: SamplingRequest) -> list[Completion]:
        if self._model is None:
            raise EngineError("the engine is not started")
        if self._failure is not None:
            raise EngineError(f"the engine's worker failed: {self._failure!r}")
        request.validate(self.vocab_size, self._max_len)
        loop = asyncio.get_running_loop()
        group = _Group(request=request, loop=loop, future=loop.create_future())
        stop_ids = frozenset(request.stop_token_ids)
        if not request.ignore_eos:
            stop_ids |= self._eos_ids
        for i in range(request.n):
            seed = request.sequence_seed(i)
            if seed is None:
                seed = self._rng.getrandbits(63)
            gen = torch.Generator().manual_seed(seed)
            group.seqs.append(_Seq(group=group, generator=gen, stop_ids=stop_ids))
        group.remaining = request.n
        with self._cv:
            if self._stopping:
                raise EngineError("the engine is shutting down")
            self._pending.append(group)
            self._cv.notify_all()
        with self._stats_lock:
            self._requests_total += 1
        try:
            return await asyncio.wait_for(group.future, self._request_timeout_s)
        except TimeoutError:
            group.cancelled = True
            raise EngineError(f"generate timed out after {self._request_timeout_s} s") from None
        except asyncio.CancelledError:
            group.cancelled = True  # the worker drops its sequences at the next step
            raise

    def queue_depth(self) -> int:
        with self._cv:
            waiting = sum(g.request.n for g in self._pending)
        return waiting + len(self._batch)

    def stats(self) -> EngineStats:
        now = time.monotonic()
        with self._stats_lock:
            while self._recent and self._recent[0][0] < now - _RATE_WINDOW_S:
                self._recent.popleft()
            recent = sum(n for _, n in self._recent)
            window = min(_RATE_WINDOW_S, max(now - self._started_at, 1e-3))
            return EngineStats(self._tokens_total, self._requests_total, recent / window)

    # ----- weights -----
    async def load_weights(
        self,
        version: int,
        source: str,
        *,
        auth_token: str | None = None,
        timeout_s: float = 300.0,
        group_replicas: int = 0,
    ) -> LoadResult:
        if self._model is None:
            raise EngineError("the engine is not started")
        async with self._load_lock:
            if self._receive_release is not None:
                self._receive_release.cancel()
                self._receive_release = None
            try:
                return await self._load_locked(version, source, auth_token, timeout_s, group_replicas)
            finally:
                self._schedule_receive_release()

    async def _load_locked(
        self, version: int, source: str, auth_token: str | None, timeout_s: float, group_replicas: int
    ) -> LoadResult:
        from fleetrl.weights import WeightTransferError, fetch_weights, transfer_timeout_s

        if version <= self.loaded_version:
            raise WeightLoadError(f"version {version} is not newer than the loaded version {self.loaded_version}")
        start = time.perf_counter()
        try:
            # timeout_s bounds each wait for the stream; the whole fetch gets timeout_s plus its bytes at a
            # conservative rate (fleetrl.weights.timeouts), enforced by fetch_weights itself.
            received = None
            if group_replicas > 0:
                received = await asyncio.to_thread(
                    _fetch_collective, source, version, group_replicas, auth_token, timeout_s, str(self._device)
                )
            transport = "zmq" if received is None else "collective"
            if received is None:
                received = await asyncio.to_thread(
                    fetch_weights,
                    source,
                    version,
                    timeout_s=timeout_s,
                    auth_token=auth_token,
                    into=self.receive_buffer,
                )
            manifest, tensors = received
        except WeightTransferError as exc:
            raise WeightLoadError(f"fetching version {version} from {source}: {exc}") from exc
        except asyncio.CancelledError:  # the fetch's thread runs on into the buffer: the next load gets its own
            self.receive_buffer = ReceiveBuffer()
            raise
        if manifest.version != version:
            raise WeightLoadError(f"asked for version {version}, got {manifest.version}")
        adapted: frozenset[str] = frozenset()
        if manifest.is_adapter:
            tensors, adapted = await asyncio.to_thread(self._merge_adapter, manifest.adapter, tensors)
        else:
            await asyncio.to_thread(check_state_dict_matches, self._specs, tensors, optional=self._aliases)
        transfer_s = time.perf_counter() - start
        swap = _Swap(
            version=version,
            checksum=manifest.checksum,
            tensors=tensors,
            adapted=adapted if manifest.is_adapter else None,
        )
        with self._cv:
            self._swap = swap
            self._cv.notify_all()
        # The worker copies the tensors in between two steps: bounded like a transfer of those bytes. The wait is
        # shielded: a timeout must not cancel a swap the worker has already taken (it would then finish a
        # cancelled future and die: seen when a SIGSTOPped replica was resumed past its timeout).
        done = asyncio.wrap_future(swap.done)
        try:
            pause_s = await asyncio.wait_for(asyncio.shield(done), transfer_timeout_s(timeout_s, manifest.total_bytes))
        except TimeoutError:
            with self._cv:
                withdrawn = self._swap is swap
                if withdrawn:  # not started: withdraw it, the old weights stay
                    self._swap = None
            if withdrawn:
                raise WeightLoadError(f"the swap to version {version} timed out") from None
            logger.warning("the swap to version %d started before its timeout: waiting for it to finish", version)
            pause_s = await done  # a copy in memory, under way
        except asyncio.CancelledError:  # the caller went away: withdraw the swap unless the worker has it
            with self._cv:
                withdrawn = self._swap is swap
                if withdrawn:
                    self._swap = None
            swap.done.cancel()  # no effect once the worker runs it; it then finishes it whole
            if not withdrawn:  # the worker may still read the buffer: the next load gets its own
                self.receive_buffer = ReceiveBuffer()
            raise
        # The received tensors are views of the receive buffer, which the next version reuses (a collective
        # load's are its own: freed here, their pages given back to the OS when the buffer is).
        del received, tensors, swap
        return LoadResult(version, manifest.checksum, transfer_s, pause_s, transport)

    def _schedule_receive_release(self) -> None:
        """Release the receive buffer, and give freed pages back to the OS, once no load came for a while."""
        if self._receive_release is not None:
            self._receive_release.cancel()
        self._receive_release = asyncio.get_running_loop().call_later(self._receive_idle_s, self._release_receive)

    def _release_receive(self) -> None:
        self._receive_release = None
        if self._load_lock.locked():  # a load is under way: it schedules the next release
            return
        self.receive_buffer.release()
        return_freed_memory()

    def _merge_adapter(
        self, adapter: Any, tensors: dict[str, torch.Tensor]
    ) -> tuple[dict[str, torch.Tensor], frozenset[str]]:
        """The weights an adapter version sets: base + scaling * B @ A for each layer it adapts, and the base
        again for layers the previous adapter adapted and this one does not (WeightLoadError if it does not fit).
        Also returns the names of the weights it adapts."""
        specs = {name: (tuple(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in tensors.items()}
        plan = plan_adapter(adapter, specs, self._specs, self._max_lora_rank)
        merged: dict[str, torch.Tensor] = {}
        for layer in plan.layers:
            base = self._lora_base.get(layer.weight)
            if base is None:  # not adapted yet, so the live weight is the base
                base = self._lora_base[layer.weight] = self._state[layer.weight].detach().clone()
            delta = tensors[layer.lora_b].to(base.device).float() @ tensors[layer.lora_a].to(base.device).float()
            merged[layer.weight] = (base.float() + plan.scaling * delta).to(base.dtype)
        adapted = frozenset(merged)
        for name in self._lora_adapted - adapted:
            merged[name] = self._lora_base[name]
        return merged, adapted

    def _apply_swap(self, swap: _Swap) -> None:
        if not swap.done.set_running_or_notify_cancel():  # withdrawn meanwhile: the old weights stay
            swap.tensors = {}
            return
        start = time.perf_counter()
        try:
            with torch.no_grad():
                for name, tensor in swap.tensors.items():
                    self._state[name].copy_(tensor)
        except Exception as exc:  # validated beforehand, so this is a bug; surface it to the caller
            swap.done.set_exception(WeightLoadError(f"swap to version {swap.version}: {exc!r}"))
            raise
        finally:
            swap.tensors = {}  # the worker keeps `swap` while it idles: it must not keep the received copy alive
        self.loaded_version = swap.version
        self.loaded_checksum = swap.checksum
        if swap.adapted is not None:
            self._lora_adapted = swap.adapted
        else:  # a full model is the new base: nothing holds an adapter's delta any more
            self._lora_base, self._lora_adapted = {}, frozenset()
        swap.done.set_result(time.perf_counter() - start)

    # ----- the worker -----
    def _run(self) -> None:
        try:
            with torch.inference_mode():
                self._loop()
        except Exception as exc:
            logger.exception("hf engine worker failed")
            self._failure = exc
            self._fail_all(EngineError(f"the engine's worker failed: {exc!r}"))

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not (self._stopping or self._pending or len(self._batch) or self._swap):
                    self._cv.wait(timeout=1.0)
                if self._stopping:
                    return
                swap, self._swap = self._swap, None
                admitted = self._admit()
            if swap is not None:
                self._apply_swap(swap)
                if len(self._batch):  # in-flight rows continue on a cache of the new weights
                    self._batch.rebuild([s.group.request.prompt_token_ids + s.token_ids[:-1] for s in self._batch.rows])
            if admitted:
                prompts = [g.request.prompt_token_ids for g in admitted]
                logits_BV = self._batch.prefill(prompts, [g.seqs for g in admitted])
                self._sample_and_record(logits_BV, sum(len(g.seqs) for g in admitted))
            elif len(self._batch):
                self._sample_and_record(self._batch.decode(), len(self._batch))

    def _admit(self) -> list[_Group]:
        admitted: list[_Group] = []
        active = len(self._batch)
        while self._pending:
            group = self._pending[0]
            # A group too big for the limit still runs alone, so no request waits forever.
            if active and active + group.request.n > self._max_num_seqs:
                break
            self._pending.popleft()
            if not group.cancelled:
                admitted.append(group)
                active += group.request.n
        return admitted

    def _sample_and_record(self, logits_BV: torch.Tensor, new_rows: int) -> None:
        """Sample for the last `new_rows` rows of the batch (all rows after a decode step)."""
        offset = len(self._batch) - new_rows
        # Sampling runs where the logits are (the engine's device); each row's CPU generator draws its uniform.
        seqs: list[_Seq] = self._batch.rows[offset:]
        reqs = [s.group.request for s in seqs]
        device = logits_BV.device
        temperature_B = torch.tensor([r.temperature for r in reqs], dtype=torch.float32, device=device)
        logprobs_BV = processed_logprobs(
            logits_BV,
            temperature_B,
            torch.tensor([r.top_k for r in reqs], dtype=torch.long, device=device),
            torch.tensor([r.top_p for r in reqs], dtype=torch.float32, device=device),
        )
        token_B, logprob_B = sample_tokens(logprobs_BV, temperature_B <= 0, [s.generator for s in seqs])
        self._batch.next_B[offset:] = token_B
        version = self.loaded_version
        positions = self._batch.pos_B[offset:].tolist()
        for seq, token, logprob, pos in zip(seqs, token_B.tolist(), logprob_B.tolist(), positions, strict=True):
            seq.token_ids.append(token)
            seq.logprobs.append(logprob)
            seq.versions.append(version)
            if token in seq.stop_ids or self._completes_stop_string(seq):
                seq.finish_reason = FINISH_STOP
            elif len(seq.token_ids) >= seq.group.request.max_tokens or (
                self._max_len is not None and pos + 1 >= self._max_len
            ):
                seq.finish_reason = FINISH_LENGTH
        self._count(len(seqs))
        keep = []
        for row, seq in enumerate(self._batch.rows):
            if seq.finish_reason is not None:
                seq.group.remaining -= 1
                if seq.group.remaining == 0:
                    self._resolve(seq.group)
            elif not seq.group.cancelled:  # a cancelled request's rows just leave
                keep.append(row)
        self._batch.keep(keep)

    def _completes_stop_string(self, seq: _Seq) -> bool:
        """Whether the token just appended completes one of the request's stop strings. The whole completion is
        decoded (special tokens skipped) and searched, as the sampler's client-side cut does (fleetrl.gateway.sampler.
        cut_at_stop), so the engine stops at the very token that cut keeps: earlier tokens did not complete one."""
        stops = seq.group.request.stop
        if not stops:
            return False
        text = self._tokenizer.decode(seq.token_ids, skip_special_tokens=True)
        return any(stop in text for stop in stops)

    def _resolve(self, group: _Group) -> None:
        prompt_len = len(group.request.prompt_token_ids)
        completions = [
            Completion(s.token_ids, s.logprobs, s.finish_reason or FINISH_LENGTH, prompt_len, s.versions)
            for s in group.seqs
        ]
        group.loop.call_soon_threadsafe(_set_result, group.future, completions)

    def _count(self, tokens: int) -> None:
        with self._stats_lock:
            self._tokens_total += tokens
            self._recent.append((time.monotonic(), tokens))

    def _fail_all(self, exc: Exception) -> None:
        with self._cv:
            groups = list(self._pending) + list({id(s.group): s.group for s in self._batch.rows}.values())
            self._pending.clear()
            swap, self._swap = self._swap, None
        if swap is not None and not swap.done.done():
            swap.done.set_exception(WeightLoadError(f"the swap did not happen: {exc}"))
        for group in groups:
            if not group.loop.is_closed():
                group.loop.call_soon_threadsafe(_set_exception, group.future, exc)


def _set_result(future: asyncio.Future, value: object) -> None:
    if not future.done():
        future.set_result(value)


def _set_exception(future: asyncio.Future, exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)


def _fetch_collective(
    source: str, version: int, replicas: int, auth_token: str | None, timeout_s: float, device: str = "cpu"
) -> tuple[Any, dict[str, torch.Tensor]] | None:
    """The version by broadcast in the trainer's group (fleetrl.weights.collective), or None: load it over the
    weight stream (the group had closed, or joining or receiving failed; logged). The request names the model's
    `device`: under NCCL (trainer and replica on CUDA) the tensors arrive in a buffer on it, under gloo in host
    memory."""
    from fleetrl.weights import WeightTransferError
    from fleetrl.weights.collective import fetch_collective

    try:
        received = fetch_collective(
            source, version, replicas=replicas, auth_token=auth_token, timeout_s=timeout_s, device=device
        )
    except WeightTransferError as exc:
        logger.warning("collective push of version %d failed (%s): loading it from the weight stream", version, exc)
        return None
    if received is None:
        logger.info("the group of version %d had closed: loading it from the weight stream", version)
    return received
