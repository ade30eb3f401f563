"""The second GPU check (issue 41): real widths, the multi-rank paths and the new weight path, in one prepared script.

    python bench/scale_check.py --out DIR --keep-going          # on one H200 (<= 480 s with --budget-s)
    python bench/scale_check.py --out DIR --keep-going --dry-run  # on CPU, tiny sizes (the test suite runs this)

Eight items in the issue's order of value, each with a time limit (SIGALRM in process, a timeout per child process);
with --keep-going an item that fails records its error and the next one runs (each builds what it needs). After
every item DIR/scale_check.json and DIR/scale_check.md are written, so a run cut off keeps what it measured; the
markdown table is printed at the end. Weights are random, made on the device (meta device, then `to_empty` and an
init): no downloads. The dry run takes the same code path at tiny sizes, on gloo where the GPU run uses a one-rank
NCCL group, on CPU where it uses the GPU.

1. MFU at Qwen3-8B widths (as many layers as fit with fp32 AdamW state): tokens/s and MFU with the attention term
   (`train_flops_per_token`) through fleetrl's packed forward (`packed_logprobs`), model options
   (`apply_model_options`: Liger, compiled layers, whole or selective checkpointing) and fused AdamW.
2. The world-size > 1 trainer on a one-rank group: `PolicyTrainer` under a DistContext whose `enabled` is forced
   (FSDP2 `MixedPrecisionPolicy`, fused AdamW on DTensor shards, the colocated reference), a whole `train_step`,
   against the autocast path at world size 1.
3. The publish at world size > 1 (the one-rank group again): `PolicyTrainer.publish` into a `WeightPublisher` (the
   per-bucket gather, cast and pinned copy of `HostStaging.gather`) against `full_state_dict`; the trainer's stall
   and the device time (synchronised after, not only before) per GB.
4. The receiving side of the engine path with 90 % of device memory held as vLLM would: the per-bucket apply of
   `fleetrl.weights.vllm_gloo.receive_buckets` (bucket_wire's plan, unpack and on-device digest) into a device
   buffer; its peak memory above the reserve, its rate, the digest's cost.
5. NCCL failure handling: a `CollectiveSender` push whose one receiver joins the group and dies; does the trainer
   process survive, and how long until the push fails (the replica's ZeroMQ fallback).
6. Packed vs padded on equal rows through the same chunked head, and the varlen attention kernel against the
   per-sample loop at the 8B head shape for 2/4/8/16 samples (`KERNEL_MIN_SAMPLES` on data).
7. One 70B-shaped decoder layer and the chunked head at a 128k vocabulary: seconds and activation bytes per token.
8. `fleetrl up` end to end (bench/gpu_check.py's check 6: the arithmetic example, trainer and hf replica on the one
   device, the overlapped push on) and the trainer's idle time per step (`perf/train_wait_time`).

What the GPU machine lacks is said in the rows: no vLLM (item 4 runs receive_buckets' loop over bucket_wire, since
vllm_gloo imports vLLM), one GPU (item 4's wire is a device copy; item 5's receiver cannot be an NCCL peer on the same
device, so it dies after joining, before the rendezvous). `bench/gpu_check_prepare.py --scale` prints the command.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gpu_check as gc  # the first check's runner, table and helpers: one copy of them
from gpu_check import FAIL, OK, SKIPPED, CheckFailed

REPO = Path(__file__).resolve().parents[1]
GIB = 1 << 30
MAX_GPU_BUDGET_S = 480.0  # the 8 minutes on the H200, start-up margin included
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12}  # dense bf16 (SXM), as gpu_check.py
RESERVE_FRACTION = 0.9  # vLLM's gpu_memory_utilization default: what a replica holds
ENGINE_BUCKET_BYTES = 64 << 20  # fleetrl.weights.vllm_gloo.DEFAULT_BUCKET_BYTES (not importable without vLLM)


# -- sizes ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    """A decoder-only transformer's widths."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int

    def layer_params(self) -> int:
        """Matmul weights of one decoder layer (q, k, v, o and the SwiGLU MLP; norms left out)."""
        attn = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        return attn + 3 * self.hidden * self.intermediate


QWEN3_8B = Shape(hidden=4096, layers=36, heads=32, kv_heads=8, head_dim=128, intermediate=12288, vocab=151936)
LLAMA_70B = Shape(hidden=8192, layers=80, heads=64, kv_heads=8, head_dim=128, intermediate=28672, vocab=128256)


@dataclass(frozen=True)
class Sizes:
    """What one mode runs. `limits_s`: item -> its time limit."""

    name: str
    w8: Shape  # item 1 (and the head shape of item 6)
    w70: Shape  # item 7
    budgets: tuple[int, ...]  # item 1: micro-batch token budgets
    lengths: tuple[int, ...]  # item 1: sample lengths packed into a budget
    timed_steps: int
    trainer_layers: int  # items 2, 3: layers of the 8B-wide model PolicyTrainer loads
    trainer_rows: tuple[int, ...]  # items 2, 3: one group of two samples per entry
    receive_layers: int  # item 4
    packed_rows: tuple[int, int]  # item 6: (samples, length) of equal rows
    attention_tokens: int  # item 6: the packed row split into 2/4/8/16 samples
    layer_tokens: int  # item 7
    head_chunk: int  # item 7: the chunked head's tokens per chunk (fleetrl's default on GPU)
    bucket_bytes: int  # item 4
    reserve_bytes: int | None  # item 4: None = RESERVE_FRACTION of the device
    push_timeout_s: float  # item 5
    warm_start_steps: int  # item 8 (gpu_check.check_up reads these two)
    up_steps: int
    limits_s: dict[int, float] = field(default_factory=dict)


GPU = Sizes(
    name="h200",
    w8=QWEN3_8B,
    w70=LLAMA_70B,
    budgets=(16384, 32768),
    lengths=(2048, 8192),
    timed_steps=2,
    trainer_layers=2,
    trainer_rows=(4096, 4096),
    receive_layers=4,
    packed_rows=(8, 2048),
    attention_tokens=16384,
    layer_tokens=8192,
    head_chunk=1024,
    bucket_bytes=ENGINE_BUCKET_BYTES,
    reserve_bytes=None,
    push_timeout_s=10.0,
    warm_start_steps=200,
    up_steps=4,
    limits_s={1: 140, 2: 60, 3: 40, 4: 30, 5: 40, 6: 35, 7: 30, 8: 100},
)
TINY = Shape(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=512)
DRY = Sizes(
    name="tiny",
    w8=TINY,
    w70=dataclasses.replace(TINY, hidden=128, heads=8, intermediate=256, vocab=1024),
    budgets=(128, 256),
    lengths=(32, 128),
    timed_steps=1,
    trainer_layers=2,
    trainer_rows=(48, 48),
    receive_layers=2,
    packed_rows=(4, 32),
    attention_tokens=256,
    layer_tokens=128,
    head_chunk=32,  # under the row's 128 tokens: the recomputing path, as on GPU
    bucket_bytes=64 << 10,
    reserve_bytes=8 << 20,
    push_timeout_s=5.0,
    warm_start_steps=20,
    up_steps=2,
    limits_s={1: 120, 2: 90, 3: 60, 4: 30, 5: 60, 6: 30, 7: 30, 8: 240},
)


# -- pure parts (tests/unit/bench/test_scale_check.py) -------------------------------------------------------------


def attended_keys(lengths: Sequence[int]) -> float:
    """Mean keys a token attends to under causal attention within its own sample: (n + 1) / 2 for a sample of n,
    weighted by tokens."""
    total = sum(lengths)
    return sum(n * (n + 1) / 2 for n in lengths) / total if total else 0.0


def train_flops_per_token(shape: Shape, layers: int, lengths: Sequence[int]) -> float:
    """Model FLOPs of one trained token, forward and backward (recomputation not counted: MFU, not HFU).

    6 per matmul weight (the layers' and the LM head's; the input embedding is a lookup), plus attention's two
    matmuls, QK^T and AV: 2 x 2 x heads x head_dim FLOPs per attended key forward, x 3 with backward, so
    12 x layers x heads x head_dim x (mean attended keys). PaLM (Chowdhery et al. 2022, appendix B) counts
    12 L H Q T with the full row length T; causal attention within packed samples attends (n + 1) / 2 keys on
    average (`attended_keys`), which is what the kernels compute."""
    matmul = layers * shape.layer_params() + shape.vocab * shape.hidden
    attention = 12 * layers * shape.heads * shape.head_dim * attended_keys(lengths)
    return 6 * matmul + attention


def mfu(tokens_per_s: float, flops_per_token: float, peak_flops: float | None) -> float | None:
    """Model FLOPs utilisation: achieved model FLOP/s over the chip's dense peak (None when the peak is unknown)."""
    if not peak_flops:
        return None
    return tokens_per_s * flops_per_token / peak_flops


def layers_that_fit(shape: Shape, device_bytes: int, fraction: float = 0.6) -> int:
    """Decoder layers whose fp32 weights, gradients and two AdamW moments (16 bytes a parameter), with the untied
    embedding and head, fit in `fraction` of the device (the rest for activations); 1 to `shape.layers`."""
    fixed = 16 * 2 * shape.vocab * shape.hidden
    per_layer = 16 * shape.layer_params()
    return max(1, min(shape.layers, int((fraction * device_bytes - fixed) // per_layer)))


def check_budget(budget_s: float, dry: bool) -> float:
    """The run's budget: at most MAX_GPU_BUDGET_S on the GPU (the issue's 8 minutes with start-up); ValueError
    naming --budget-s otherwise."""
    if budget_s <= 0:
        raise ValueError(f"--budget-s must be positive, got {budget_s}")
    if not dry and budget_s > MAX_GPU_BUDGET_S:
        raise ValueError(f"--budget-s {budget_s:.0f} is over the GPU run's {MAX_GPU_BUDGET_S:.0f} s")
    return budget_s


def kernel_min_samples(timings: dict[int, tuple[float, float]]) -> int | None:
    """The fewest samples from which the varlen kernel is no slower than the per-sample loop at every larger count
    measured (`timings`: samples -> (kernel s, loop s)); None when the loop wins at the largest."""
    best = None
    for samples in sorted(timings, reverse=True):
        kernel, loop = timings[samples]
        if kernel > loop:
            break
        best = samples
    return best


def per_token(value: float, tokens: int) -> float:
    return value / max(tokens, 1)


# -- the report ----------------------------------------------------------------------------------------------------


class Report(gc.Report):
    """gpu_check's report (rows, per-item summaries, the markdown table) written as scale_check.json / .md."""

    def write(self, out: Path) -> None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "scale_check.json").write_text(json.dumps(self.to_json(), indent=2) + "\n")
        header = f"Second GPU check ({self.mode}) on {self.device}, {time.time() - self.started:.0f} s in all\n\n"
        (out / "scale_check.md").write_text(header + self.table() + "\n")


@dataclass
class Ctx(gc.Ctx):
    """gpu_check's context, plus the one-rank group (built once, by the first item that needs it)."""

    group: Any = None  # the OneRankContext
    folders: dict[str, Path] = field(default_factory=dict)

    @property
    def torch_device(self) -> Any:
        import torch

        return torch.device("cuda", 0) if self.cuda else torch.device("cpu")


def one_rank_context(ctx: Ctx) -> Any:
    """A one-rank process group (NCCL on the GPU, gloo in the dry run) and a DistContext that reports it enabled,
    so PolicyTrainer takes its world-size > 1 path (FSDP2 over a mesh of one)."""
    if ctx.group is not None:
        return ctx.group
    import datetime

    import torch
    import torch.distributed as dist

    from fleetrl.trainer.distributed import DistContext

    @dataclass
    class OneRankContext(DistContext):
        @property
        def enabled(self) -> bool:
            return True

    kwargs: dict[str, Any] = {}
    if ctx.cuda:
        torch.cuda.set_device(0)
        kwargs["device_id"] = torch.device("cuda", 0)
    if not dist.is_initialized():
        dist.init_process_group(
            "nccl" if ctx.cuda else "gloo",
            init_method=f"file://{ctx.workdir / 'one_rank_pg'}",
            rank=0,
            world_size=1,
            timeout=datetime.timedelta(seconds=120),
            **kwargs,
        )
    ctx.group = OneRankContext(0, 1, 0, "cuda:0" if ctx.cuda else "cpu", 1)
    return ctx.group


# -- models made on the device --------------------------------------------------------------------------------------


def build_model(shape: Shape, layers: int, device: Any, dtype: Any, seed: int = 0, vocab: int | None = None) -> Any:
    """A random Qwen3-shaped causal LM (untied head) of `layers` layers, built on the meta device, then `to_empty`
    on `device` and initialised there: normal(0, 0.02) matrices, unit norms, fresh rotary tables."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(
        vocab_size=vocab or shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=32768,
        tie_word_embeddings=False,
    )
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02, generator=gen)
            elif "norm" in name:
                p.fill_(1.0)
            else:
                p.zero_()
    rotary = model.model.rotary_emb  # its tables were meta: computed afresh
    model.model.rotary_emb = type(rotary)(model.config).to(device)
    model.config.use_cache = False
    return model


def model_folder(ctx: Ctx, layers: int) -> Path:
    """An HF folder of the 8B-wide model with `layers` layers (bf16 safetensors, made on the device) and the tiny
    byte-level tokenizer's files, for PolicyTrainer (items 2 and 3)."""
    key = f"w8-{layers}"
    if key in ctx.folders:
        return ctx.folders[key]
    import torch

    from fleetrl.tiny_model import build_tiny_model

    started = time.perf_counter()
    folder = ctx.workdir / key
    build_tiny_model(folder)
    for old in [*folder.glob("*.safetensors"), *folder.glob("*.safetensors.index.json")]:
        old.unlink()
    eos = json.loads((folder / "config.json").read_text())["eos_token_id"]
    model = build_model(ctx.sizes.w8, layers, ctx.torch_device, torch.bfloat16 if ctx.cuda else torch.float32)
    model.config.bos_token_id = model.config.eos_token_id = model.config.pad_token_id = eos
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(folder)
    del model
    gc.free_memory(ctx)
    ctx.folders[key] = folder
    files = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    ctx.row(
        f"model folder ({layers} layers, 8B widths)",
        f"{gc.count(params)} params, {gc.gb(files)} of safetensors written",
        seconds=time.perf_counter() - started,
        params=params,
    )
    return folder


def optimizer_for(model: Any) -> Any:
    from fleetrl.trainer.optim import build_optimizer

    hyper = SimpleNamespace(learning_rate=1e-6, adam_beta1=0.9, adam_beta2=0.999, adam_eps=1e-8, weight_decay=0.0)
    return build_optimizer(model.parameters(), hyper)


def random_packed(vocab: int, lengths: Sequence[int], seed: int = 1) -> Any:
    import torch

    from fleetrl.trainer.logprobs import pack

    gen = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, vocab, (n + 1,), generator=gen).tolist() for n in lengths]
    return pack([s[:-1] for s in seqs], [s[1:] for s in seqs])


@contextlib.contextmanager
def saved_bytes(model: Any) -> Iterator[list[int]]:
    """The bytes autograd saves for backward inside the block (each storage once, `model`'s parameters left out):
    activation memory on any device, without reading the allocator."""
    import torch

    seen: set[tuple[str, int]] = {(str(p.device), p.untyped_storage().data_ptr()) for p in model.parameters()}
    total = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        try:
            key = (str(t.device), t.untyped_storage().data_ptr())
            if key not in seen:
                seen.add(key)
                total[0] += t.untyped_storage().nbytes()
        except (RuntimeError, NotImplementedError):  # a tensor without storage (a wrapper subclass)
            pass
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield total


def timed(ctx: Ctx, fn: Callable[[], Any], steps: int) -> float:
    """One warm-up call (compile happens there), then the mean seconds of `steps` calls, synchronised."""
    fn()
    gc.sync(ctx)
    started = time.perf_counter()
    for _ in range(steps):
        fn()
    gc.sync(ctx)
    return (time.perf_counter() - started) / steps


def autocast(ctx: Ctx) -> Any:
    """bf16 autocast on the GPU (the one-process trainer's mixed precision); fp32 on CPU (the dry run)."""
    import torch

    return torch.autocast(ctx.device, dtype=torch.bfloat16, enabled=ctx.cuda)


def measure_cpu_peak_flops() -> float:
    """A CPU fp32 matmul's FLOP/s: the dry run's stand-in peak, so its MFU column is a number."""
    import torch

    a, b = torch.randn(256, 256), torch.randn(256, 256)
    a @ b
    started = time.perf_counter()
    for _ in range(20):
        a @ b
    return 20 * 2 * 256**3 / (time.perf_counter() - started)


# -- item 1: MFU at 8B widths ----------------------------------------------------------------------------------------


# name: (liger, compile, checkpointing scope or None)
ARMS: dict[str, tuple[bool, bool, str | None]] = {
    "eager, whole-layer checkpointing": (False, False, "layer"),
    "Liger, whole-layer checkpointing": (True, False, "layer"),
    "selective checkpointing (attention only)": (False, False, "attention"),
    "no checkpointing": (False, False, None),
    "compiled layers, whole-layer checkpointing": (False, True, "layer"),
    "Liger + compiled layers": (True, True, "layer"),
}


def item_mfu(ctx: Ctx) -> None:
    import torch

    from fleetrl.trainer.kernels import choose_kernels, liger_available
    from fleetrl.trainer.layers import CheckpointPlan
    from fleetrl.trainer.logprobs import packed_logprobs
    from fleetrl.trainer.model import ModelOptions, apply_model_options
    from fleetrl.trainer.varlen_attention import use_packed_attention

    s = ctx.sizes
    shape = s.w8
    device_bytes = torch.cuda.get_device_properties(0).total_memory if ctx.cuda else 0
    layers = layers_that_fit(shape, device_bytes) if ctx.cuda else shape.layers
    peak = ctx.peak_flops
    peak_note = "H200 dense bf16 peak" if ctx.cuda else "a measured CPU fp32 matmul rate (dry run)"
    widths = "Qwen3-8B widths" if ctx.cuda else "tiny stand-in"
    ctx.row(
        "shape",
        f"{widths} (hidden {shape.hidden}, {shape.heads}/{shape.kv_heads} heads, MLP {shape.intermediate}, "
        f"vocab {shape.vocab}), {layers} of {shape.layers} layers with fp32 AdamW state; MFU against {peak_note} "
        f"({(peak or 0) / 1e12:.3g} TFLOP/s); bf16 autocast" + ("" if ctx.cuda else " off on CPU"),
        layers=layers,
        peak_flops=peak,
    )

    def run_arm(label: str, liger: bool, compiled: bool, scope: str | None, budget: int, length: int) -> None:
        item = f"{label}: {budget // length} x {length} ({budget // 1024 if budget >= 1024 else budget}"
        item += "k tokens)" if budget >= 1024 else " tokens)"
        if liger and not (ctx.cuda and liger_available()):
            ctx.row(item, "Liger needs CUDA and the liger-kernel package", SKIPPED)
            return
        needed_s = (60.0 if compiled else 15.0) if ctx.cuda else 1.0  # an arm's build, warm-up (compile) and steps
        if ctx.remaining() < needed_s:
            ctx.row(item, f"{ctx.remaining():.0f} s left in the item's limit, {needed_s:.0f} s needed", SKIPPED)
            return
        started = time.perf_counter()
        torch._dynamo.reset()
        model = build_model(shape, layers, ctx.torch_device, torch.float32)
        model.train()
        attention = use_packed_attention(model, ctx.torch_device)
        options = ModelOptions(
            CheckpointPlan(1, scope) if scope else None,  # type: ignore[arg-type]
            choose_kernels(True, ctx.torch_device) if liger else None,
            compiled,
        )
        apply_model_options(model, options)
        optimizer = optimizer_for(model)
        lengths = [length] * (budget // length)
        batch = random_packed(shape.vocab, lengths).to(ctx.torch_device)

        def step() -> None:
            with autocast(ctx):
                logprobs, _ = packed_logprobs(model, batch)
            (-logprobs.mean()).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        try:
            gc.reset_peak(ctx)
            seconds = timed(ctx, step, s.timed_steps)
        except torch.OutOfMemoryError as exc:
            ctx.row(item, f"out of device memory: {str(exc)[:120]}", OK, seconds=time.perf_counter() - started)
            return
        finally:
            peak_mem = gc.peak_gib(ctx)
            model = optimizer = batch = None  # freed before the next arm's model
            gc.free_memory(ctx)
        tps = budget / seconds
        flops = train_flops_per_token(shape, layers, lengths)
        util = mfu(tps, flops, peak)
        attn_share = 1 - train_flops_per_token(shape, layers, [1]) / flops
        ctx.row(
            item,
            f"{tps:,.0f} tok/s, MFU {100 * (util or 0):.1f}% (attention {100 * attn_share:.1f}% of the FLOPs), "
            f"{seconds:.3f} s/step, peak {gc.fmt_gib(peak_mem)}; attention {attention}",
            seconds=time.perf_counter() - started,
            tokens_per_s=tps,
            mfu=util,
            flops_per_token=flops,
            peak_gib=peak_mem,
        )

    first = next(iter(ARMS))
    for budget in s.budgets:
        for length in s.lengths:
            run_arm(first, *ARMS[first], budget, length)
    for label, arm in list(ARMS.items())[1:]:
        run_arm(label, *arm, s.budgets[0], s.lengths[0])


# -- item 2: the world-size > 1 trainer ------------------------------------------------------------------------------


def trainer_config(ctx: Ctx, folder: Path, run: str, **overrides: Any) -> Any:
    have = gc.knobs()
    settings: dict[str, Any] = {"dtype": "float32", "gradient_checkpointing": True}
    if have["compute_dtype"]:
        settings["compute_dtype"] = "bfloat16" if ctx.cuda else "float32"
    if have["packing"]:
        settings["packing"] = True
    settings.update(overrides)
    return gc.run_config(folder, ctx.workdir / run, **settings)


def item_trainer(ctx: Ctx) -> None:

    from fleetrl.trainer import PolicyTrainer
    from fleetrl.trainer.optim import optimizer_implementation

    s = ctx.sizes
    folder = model_folder(ctx, s.trainer_layers)
    group = one_rank_context(ctx)
    losses: dict[str, float] = {}
    for label, dist_ctx in (("world size 1 (autocast)", None), ("one-rank group (FSDP2 path)", group)):
        started = time.perf_counter()
        cfg = trainer_config(ctx, folder, f"run2-{len(losses)}", kl_beta=0.05)
        trainer = PolicyTrainer(cfg, device=ctx.device, dist_ctx=dist_ctx, colocated_reference=True)
        try:
            params = list(trainer.model.parameters())
            dtensors = sum(1 for p in params if hasattr(p, "device_mesh"))
            mp = mixed_precision_of(trainer.model)
            rows = gc.Groups(trainer.vocab_size, 16)  # fresh row ids on every call: a row trains once
            trainer.train_step(rows.make(list(s.trainer_rows)))  # warm-up
            groups = rows.make(list(s.trainer_rows))
            tokens = gc.Groups.tokens(groups)
            gc.sync(ctx)
            gc.reset_peak(ctx)
            begun = time.perf_counter()
            metrics = trainer.train_step(groups).metrics
            gc.sync(ctx)
            step_s = time.perf_counter() - begun
            loss = float(metrics.get("train/loss", float("nan")))
            losses[label] = loss
            status = OK if math.isfinite(loss) else FAIL
            if dist_ctx is not None and dtensors == 0:
                status = FAIL
            ctx.row(
                label,
                f"{tokens / step_s:,.0f} tok/s ({step_s:.3f} s/step), peak {gc.fmt_gib(gc.peak_gib(ctx))}; "
                f"{dtensors}/{len(params)} DTensor params, mixed precision: {mp}; AdamW "
                f"{optimizer_implementation(trainer.optimizer)}; colocated reference "
                f"{'on' if trainer.reference_model is not None else 'off'}; loss {loss:.4f}, "
                f"ref KL {metrics.get('train/kl_ref', float('nan')):.3g}",
                status,
                seconds=time.perf_counter() - started,
                tokens_per_s=tokens / step_s,
                step_s=step_s,
                peak_gib=gc.peak_gib(ctx),
                dtensor_params=dtensors,
                loss=loss,
            )
        finally:
            trainer.close()
            del trainer
            gc.free_memory(ctx)
    a, b = losses.values()
    ctx.row("loss, one-rank group vs world size 1", f"{b:.5f} vs {a:.5f} (same data, same weights)", diff=b - a)
    if not math.isfinite(a - b):
        raise CheckFailed("a trainer's loss is not finite")


def mixed_precision_of(model: Any) -> str:
    """FSDP2's MixedPrecisionPolicy on the root module (param and reduce dtypes), or what runs instead."""
    state = getattr(model, "_get_fsdp_state", None)
    if state is None:
        return "none (not FSDP2-wrapped: autocast)"
    try:
        policy = state()._mp_policy
    except AttributeError:
        return "FSDP2 (policy not readable)"
    name = "{}".format
    return f"param {name(policy.param_dtype)}, reduce {name(policy.reduce_dtype)}".replace("torch.", "")


# -- item 3: the publish at world size > 1 ---------------------------------------------------------------------------


def item_publish(ctx: Ctx) -> None:
    from fleetrl.trainer import PolicyTrainer
    from fleetrl.trainer import distributed as fdist
    from fleetrl.weights.publisher import WeightPublisher

    s = ctx.sizes
    folder = model_folder(ctx, s.trainer_layers)
    group = one_rank_context(ctx)
    publisher = WeightPublisher(collective_device=ctx.device)
    cfg = trainer_config(ctx, folder, "run3", kl_beta=0.0, weight_sync_interval=1, inference_dtype="bfloat16")
    trainer = PolicyTrainer(cfg, device=ctx.device, dist_ctx=group, weight_sink=publisher.publish)
    try:
        groups = gc.Groups(trainer.vocab_size, 16)
        for version in (1, 2):
            trainer.train_step(groups.make(list(s.trainer_rows)))
            gc.sync(ctx)
            began = time.perf_counter()
            info = trainer.publish()
            stall = time.perf_counter() - began
            gc.sync(ctx)
            device_s = time.perf_counter() - began
            trainer.publish()  # the same version again: waits for the staged copy's checksums
            served_s = time.perf_counter() - began
            nbytes = publisher.version_bytes(info.version)
            ctx.row(
                f"sharded publish, version {version} ({'buffers allocated' if version == 1 else 'buffers reused'})",
                f"{gc.gb(nbytes)} bf16: stall {stall:.3f} s, device done {device_s:.3f} s "
                f"({gc.rate(nbytes, device_s)}; {device_s / max(nbytes / 1e9, 1e-9):.3f} s/GB), served "
                f"(checksums) {served_s:.3f} s",
                seconds=served_s,
                bytes=nbytes,
                stall_s=stall,
                device_s=device_s,
                served_s=served_s,
            )
        gc.sync(ctx)
        began = time.perf_counter()
        full = fdist.full_state_dict(trainer.model, group)
        gc.sync(ctx)
        took = time.perf_counter() - began
        nbytes = sum(t.numel() * t.element_size() for t in full.values())
        del full
        ctx.row(
            "today's full state dict (get_model_state_dict, fp32, cpu_offload)",
            f"{gc.gb(nbytes)} in {took:.3f} s ({gc.rate(nbytes, took)})",
            seconds=took,
            bytes=nbytes,
        )
    finally:
        trainer.close()
        publisher.close()
        del trainer
        gc.free_memory(ctx)


# -- item 4: the receiving side -------------------------------------------------------------------------------------


def item_receive(ctx: Ctx) -> None:
    import torch

    from fleetrl.weights.bucket_wire import bucket_digest, pack_bucket, plan_buckets, unpack_bucket
    from fleetrl.weights.collective import _broadcast, _process_group, _shutdown, _store
    from fleetrl.weights.gather import ShardedWeights

    s = ctx.sizes
    dev = ctx.torch_device
    if ctx.cuda:
        torch.cuda.set_device(dev)  # the group below binds NCCL to the current device (item 2 may not have run)
    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    sender = build_model(s.w8, s.receive_layers, dev, dtype, seed=1)
    receiver = build_model(s.w8, s.receive_layers, dev, dtype, seed=2)
    source = ShardedWeights(sender.state_dict())
    metas = source.metadata()
    store = _store("127.0.0.1", 0, master=True, timeout_s=60)
    group = _process_group(store, 0, 1, "nccl" if ctx.cuda else "gloo", 60)
    targets = dict(receiver.named_parameters())
    filler = None
    try:
        if ctx.cuda:
            free, total = torch.cuda.mem_get_info()
            # What vLLM would hold, less what the device cannot give (its context, NCCL's buffers): 2 GiB kept free.
            reserve = min(int(RESERVE_FRACTION * total) - torch.cuda.memory_allocated(), free - (2 << 30))
            held = (total - free + max(reserve, 0)) / total
            reserve_note = f"{held:.0%} of {total / GIB:.0f} GiB held (both models + a filler tensor)"
        else:
            reserve = s.reserve_bytes or 0
            reserve_note = f"dry run: a {gc.gb(reserve)} filler, not 90 % of host memory"
        filler = torch.empty(max(reserve, 0), dtype=torch.uint8, device=dev)
        gc.sync(ctx)
        base = torch.cuda.memory_allocated() if ctx.cuda else 0
        gc.reset_peak(ctx)
        received = 0
        digest_s = apply_s = 0.0
        largest = 0
        loaded = 0

        def load(pairs: list[tuple[str, torch.Tensor]]) -> None:
            nonlocal loaded
            with torch.no_grad():
                for name, view in pairs:
                    targets[name].copy_(view)
                    loaded += 1

        tensors = iter(source)
        began = time.perf_counter()
        for bucket in plan_buckets(metas, s.bucket_bytes):
            packed = pack_bucket(bucket, [next(tensors)[1] for _ in bucket.indices], dev)
            sent = bucket_digest(packed)
            _broadcast(group, packed, 60)  # a one-rank group: the call, not a peer
            t0 = time.perf_counter()
            # receive_buckets' loop (vllm_gloo), with the bucket on the device as NCCL would land it: a fresh
            # bucket-sized buffer, the digest compared as one scalar, the bucket's tensors loaded before the next.
            buffer = torch.empty(bucket.nbytes, dtype=torch.uint8, device=dev)
            buffer.copy_(packed)  # the wire: one GPU has no peer to receive from
            largest = max(largest, bucket.nbytes)
            d0 = time.perf_counter()
            ok = int(bucket_digest(buffer).item()) == int(sent.item())
            digest_s += time.perf_counter() - d0
            if not ok:
                raise CheckFailed(f"the bucket starting at {metas[bucket.indices[0]].name!r} arrived damaged")
            load(unpack_bucket(bucket, metas, buffer))
            gc.sync(ctx)
            apply_s += time.perf_counter() - t0
            received += bucket.nbytes
            del packed, buffer
        total_s = time.perf_counter() - began
        peak_extra = (torch.cuda.max_memory_allocated() - base) / GIB if ctx.cuda else None
        same = all(torch.equal(receiver.state_dict()[m.name], sender.state_dict()[m.name]) for m in metas)
        ctx.row(
            "per-bucket apply under the reserve",
            f"{gc.gb(received)} in {len(plan_buckets(metas, s.bucket_bytes))} buckets of <= "
            f"{gc.gb(s.bucket_bytes)}: apply {apply_s:.3f} s ({gc.rate(received, apply_s)}), whole loop "
            f"{total_s:.3f} s; peak above the reserve {gc.fmt_gib(peak_extra)} (largest bucket "
            f"{gc.gb(largest)}); {loaded} tensors, equal to the sender's: {same}",
            OK if same and loaded == len(metas) else FAIL,
            seconds=total_s,
            bytes=received,
            apply_s=apply_s,
            peak_extra_gib=peak_extra,
        )
        ctx.row(
            "what stands in",
            f"{reserve_note}; vLLM absent: vllm_gloo.receive_buckets' loop over bucket_wire with a device buffer; the "
            "wire is a device copy (one GPU: no peer)",
        )
        ctx.row(
            "on-device digest (receiver side)",
            f"{digest_s:.4f} s for {gc.gb(received)} ({gc.rate(received, digest_s)}; "
            f"{100 * digest_s / max(apply_s, 1e-9):.0f}% of the apply)",
            seconds=digest_s,
            digest_s=digest_s,
        )
    finally:
        _shutdown(group)
        targets.clear()
        del filler, sender, receiver, source
        gc.free_memory(ctx)


# -- item 5: a receiver that dies ----------------------------------------------------------------------------------


def item_failure(ctx: Ctx) -> None:
    """The trainer's side runs in a child process (`--worker dead-receiver-push`), so a push that hangs on a dead
    peer is ended by the child's timeout instead of holding this process (and its device) to the end of the run."""
    s = ctx.sizes
    result_file = ctx.workdir / "failure5.json"
    spec = {
        "device": ctx.device,
        "timeout_s": s.push_timeout_s,
        "workdir": str(ctx.workdir),
        "result": str(result_file),
        "wait_s": max(5.0, ctx.remaining() - 12),  # the child writes its result before this item's limit
    }
    argv = [ctx.python, str(Path(__file__).resolve()), "--worker", "dead-receiver-push", "--spec", json.dumps(spec)]
    started = time.perf_counter()
    code = gc.run_child(argv, ctx.workdir / "sender5.log", timeout_s=max(5.0, ctx.remaining() - 3))
    took = time.perf_counter() - started
    if not result_file.exists():
        tail = gc._tail(ctx.workdir / "sender5.log")
        ended = "killed at the item's limit" if code == 124 else f"exit {code}"
        ctx.row("the trainer's side", f"{ended}, no result: {tail}", FAIL, seconds=took)
        raise CheckFailed(f"the sending process ended without a result ({ended})")
    got = json.loads(result_file.read_text())
    if got["receiver_exit"] != 17:
        ctx.row("receiver joins, then dies", f"the receiver exited {got['receiver_exit']}: {got['receiver_log']}", FAIL)
        raise CheckFailed("the receiver did not join the group")
    ended, gave_up = got["ended"], got["gave_up_s"]
    ctx.row(
        f"{got['backend']} push, receiver joins then dies",
        (
            f"the push failed {gave_up:.1f} s after the receiver died (so the replica loads over ZeroMQ from then)"
            if ended
            else f"the push had not ended {gave_up:.0f} s after the receiver died (a dead peer hangs the sender)"
        )
        + f"; trainer process alive, device usable after: {got['device_usable']}; world at close {got['world_size']}"
        f"; push timeout {s.push_timeout_s:.0f} s + bytes at the floor rate",
        OK if ended and got["error"] and got["device_usable"] else FAIL,
        seconds=took,
        **got,
    )
    ctx.row("the push's error", got["error"] or "none", OK if got["error"] else FAIL)
    ctx.row(
        "what is left for two GPUs",
        "one device: the receiver dies after joining, before the rendezvous (a second process on the same GPU cannot "
        "be an NCCL peer); a peer dying inside a broadcast needs two GPUs",
    )


def dead_receiver_push_worker(spec: dict[str, Any]) -> int:
    """Item 5's trainer side: publish a small version, open its group through a `CollectiveSender` (NCCL on CUDA,
    gloo on CPU) for one replica, start a receiver that claims its rank and dies, then wait (bounded) for the push
    to fail; the result as JSON. Leaves with os._exit: a sender thread stuck on a dead NCCL peer must not hold the
    interpreter's exit."""
    import torch

    from fleetrl.weights.collective import CollectiveSender
    from fleetrl.weights.manifest import encode_manifest
    from fleetrl.weights.publisher import WeightPublisher

    deadline = time.monotonic() + float(spec["wait_s"])
    device, timeout_s, workdir = spec["device"], float(spec["timeout_s"]), Path(spec["workdir"])
    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        torch.cuda.set_device(0)
    state = {f"w{i}": torch.randn(256, 256) for i in range(4)}
    publisher = WeightPublisher()
    publisher.publish(1, state)
    snapshot = publisher._versions[1]  # the served version's manifest and bytes, as the weight stream hands them over
    sender = CollectiveSender(
        snapshot.manifest,
        snapshot.payloads,
        expected_replicas=1,
        host="127.0.0.1",
        backend=backend,
        join_timeout_s=timeout_s,
        timeout_s=timeout_s,
        device=device,
        replica_device=device,
    ).start()
    manifest_file = workdir / "manifest5.json"
    manifest_file.write_bytes(encode_manifest(snapshot.manifest))
    receiver = {"offer": sender.offer("127.0.0.1").to_json(), "manifest": str(manifest_file)}
    argv = [sys.executable, str(Path(__file__).resolve()), "--worker", "join-and-die", "--spec", json.dumps(receiver)]
    code = gc.run_child(
        argv, workdir / "receiver5.log", timeout_s=max(1.0, min(4 * timeout_s, deadline - time.monotonic()))
    )
    died = time.perf_counter()
    # The push's own bound is timeout_s plus its bytes at the floor rate; past the deadline it counts as hung.
    ended = sender.done.wait(max(0.5, deadline - time.monotonic()))
    gave_up = time.perf_counter() - died
    usable = bool(torch.ones(64, 64, device=device).sum().item() == 64 * 64)
    result = {
        "backend": backend,
        "receiver_exit": code,
        "receiver_log": gc._tail(workdir / "receiver5.log"),
        "ended": ended,
        "gave_up_s": gave_up,
        "error": sender.error,
        "world_size": sender.world_size,
        "device_usable": usable,
    }
    Path(spec["result"]).write_text(json.dumps(result))
    print(json.dumps(result), flush=True)
    with contextlib.suppress(Exception):  # teardown only
        publisher.close(timeout_s=5)
    os._exit(0)


def join_and_die_worker(spec: dict[str, Any]) -> int:
    """Item 5's receiver: claim a rank in the group, then die without a word (exit 17)."""
    from fleetrl.weights.collective import GroupOffer, join_group
    from fleetrl.weights.manifest import decode_manifest

    offer = GroupOffer.from_json(spec["offer"], decode_manifest(Path(spec["manifest"]).read_bytes()))
    membership = join_group(offer, 1)
    print(f"joined: {membership}", flush=True)
    os._exit(17 if membership is not None else 3)


# -- item 6: packed vs padded, kernel vs loop -----------------------------------------------------------------------


def item_packing(ctx: Ctx) -> None:
    import torch

    from fleetrl.trainer import varlen_attention as va
    from fleetrl.trainer.logprobs import packed_logprobs, padded_logprobs
    from fleetrl.trainer.varlen_attention import use_packed_attention

    s = ctx.sizes
    shape = s.w8
    samples, length = s.packed_rows
    model = build_model(shape, 2, ctx.torch_device, torch.float32)
    model.train()
    use_packed_attention(model, ctx.torch_device)
    batch = random_packed(shape.vocab, [length] * samples).to(ctx.torch_device)
    inputs_BT = batch.input_ids_1N.view(samples, length)
    targets_BT = batch.targets_N.view(samples, length)

    def packed() -> None:
        with autocast(ctx):
            lp, _ = packed_logprobs(model, batch)
        (-lp.mean()).backward()
        model.zero_grad(set_to_none=True)

    def padded() -> None:
        with autocast(ctx):
            lp, _ = padded_logprobs(model, inputs_BT, targets_BT)
        (-lp.mean()).backward()
        model.zero_grad(set_to_none=True)

    try:
        t_packed = timed(ctx, packed, s.timed_steps)
        t_padded = timed(ctx, padded, s.timed_steps)
    finally:
        model = None
        gc.free_memory(ctx)
    tokens = samples * length
    ctx.row(
        f"packed vs padded, {samples} x {length} equal rows, 2 layers at 8B widths, the same chunked head",
        f"packed {tokens / t_packed:,.0f} tok/s vs padded {tokens / t_padded:,.0f} tok/s "
        f"(packed/padded time {t_packed / t_padded:.2f})",
        seconds=t_packed + t_padded,
        packed_s=t_packed,
        padded_s=t_padded,
    )

    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    module = torch.nn.Module()
    module.is_causal = True
    timings: dict[int, tuple[float, float]] = {}
    n = s.attention_tokens
    gen = torch.Generator(device=ctx.torch_device).manual_seed(3)
    for count in (2, 4, 8, 16):
        bounds = [n * i // count for i in range(count + 1)]
        cu = torch.tensor(bounds, dtype=torch.int32)
        qkv = [
            torch.randn(1, h, n, shape.head_dim, device=ctx.torch_device, dtype=dtype, generator=gen).requires_grad_()
            for h in (shape.heads, shape.kv_heads, shape.kv_heads)
        ]
        with kernel_for_any_count(va):
            served = va.use_varlen_kernel(qkv[0], 0.0, count)
        kwargs = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": n // count, "max_length_k": n // count}

        def run(path: str, qkv: list[Any] = qkv, kwargs: dict[str, Any] = kwargs) -> Callable[[], None]:
            def once() -> None:
                with va.forced_path(path), kernel_for_any_count(va):
                    out, _ = va.varlen_sdpa(module, *qkv, None, **kwargs)
                out.float().sum().backward()
                for t in qkv:
                    t.grad = None

            return once

        kernel_s = timed(ctx, run(va.VARLEN_KERNEL), max(2, s.timed_steps))
        loop_s = timed(ctx, run(va.SAMPLE_LOOP), max(2, s.timed_steps))
        timings[count] = (kernel_s, loop_s)
        chosen = va.VARLEN_KERNEL if served else va.choose_packed_attention(ctx.device, count, kernel=False)
        ctx.row(
            f"attention, {count} samples of {n // count} ({shape.heads}/{shape.kv_heads} heads, dim {shape.head_dim})",
            f"'kernel' {1e3 * kernel_s:.2f} ms (ran {chosen}) vs loop {1e3 * loop_s:.2f} ms, forward + backward",
            seconds=kernel_s + loop_s,
            kernel_s=kernel_s,
            loop_s=loop_s,
            kernel_served=served,
        )
    best = kernel_min_samples(timings)
    ctx.row(
        "KERNEL_MIN_SAMPLES on data",
        f"{best} (today {va.KERNEL_MIN_SAMPLES})"
        + ("" if ctx.cuda else "; the dry run has no varlen kernel, so both arms time the rule's CPU paths"),
        minimum=best,
    )


@contextlib.contextmanager
def kernel_for_any_count(va: Any) -> Iterator[None]:
    """The varlen kernel serves rows of any sample count inside the block (KERNEL_MIN_SAMPLES is what is measured)."""
    previous, va.KERNEL_MIN_SAMPLES = va.KERNEL_MIN_SAMPLES, 1
    try:
        yield
    finally:
        va.KERNEL_MIN_SAMPLES = previous


# -- item 7: a 70B-shaped layer and the 128k head --------------------------------------------------------------------


def item_70b(ctx: Ctx) -> None:
    import torch

    from fleetrl.trainer.logprobs import packed_logprobs
    from fleetrl.trainer.varlen_attention import use_packed_attention

    s = ctx.sizes
    shape = s.w70
    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    tokens = s.layer_tokens
    model = build_model(shape, 1, ctx.torch_device, dtype, vocab=256)
    model.train()
    use_packed_attention(model, ctx.torch_device)
    gen = torch.Generator(device=ctx.torch_device).manual_seed(4)
    x = torch.randn(1, tokens, shape.hidden, device=ctx.torch_device, dtype=dtype, generator=gen).requires_grad_()
    positions = torch.arange(tokens, device=ctx.torch_device).unsqueeze(0)
    saved = [0]

    def layer() -> None:
        with saved_bytes(model) as counted:
            out = model.model(inputs_embeds=x, position_ids=positions).last_hidden_state
        saved[0] = counted[0]
        out.float().square().mean().backward()
        model.zero_grad(set_to_none=True)
        x.grad = None

    try:
        layer_s = timed(ctx, layer, s.timed_steps)
    finally:
        model = None
        gc.free_memory(ctx)
    ctx.row(
        f"one 70B-shaped decoder layer ({shape.hidden} wide, {shape.heads}/{shape.kv_heads} heads, MLP "
        f"{shape.intermediate}), {tokens} tokens, no checkpointing",
        f"{1e6 * per_token(layer_s, tokens):.2f} us/token forward + backward; activations saved "
        f"{per_token(saved[0], tokens) / 1024:.1f} KiB/token ({str(dtype).removeprefix('torch.')})",
        seconds=layer_s,
        s_per_token=per_token(layer_s, tokens),
        saved_bytes_per_token=per_token(saved[0], tokens),
    )

    head = build_model(shape, 0, ctx.torch_device, dtype)
    head.train()
    batch = random_packed(shape.vocab, [tokens]).to(ctx.torch_device)
    try:
        for chunk in (s.head_chunk, 0):
            kept = [0]

            def forward(chunk: int = chunk, kept: list[int] = kept) -> None:
                with saved_bytes(head) as counted:
                    lp, _ = packed_logprobs(head, batch, chunk_tokens=chunk)
                kept[0] = counted[0]
                (-lp.mean()).backward()
                head.zero_grad(set_to_none=True)

            try:
                took = timed(ctx, forward, s.timed_steps)
            except torch.OutOfMemoryError:
                ctx.row(f"head at vocab {shape.vocab}, chunk {chunk}", "out of device memory")
                continue
            ctx.row(
                f"LM head at vocab {shape.vocab} (hidden {shape.hidden}), {tokens} tokens, "
                + (f"chunked ({chunk} tokens)" if chunk else "full logits"),
                f"{1e6 * per_token(took, tokens):.2f} us/token forward + backward; saved "
                f"{per_token(kept[0], tokens) / 1024:.1f} KiB/token",
                seconds=took,
                s_per_token=per_token(took, tokens),
                saved_bytes_per_token=per_token(kept[0], tokens),
            )
    finally:
        head = None
        gc.free_memory(ctx)


# -- item 8: fleetrl up ----------------------------------------------------------------------------------------------


def item_up(ctx: Ctx) -> None:
    gc.check_up(ctx)  # the first check's check 6: warm start, then fleetrl up with the trainer (and replica) on GPU
    metrics = ctx.workdir / "arithmetic" / "run" / "metrics.jsonl"
    steps = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.exists() else []
    steps = [m for m in steps if "rollout/raw_reward" in m]
    waits = [m["perf/train_wait_time"] for m in steps if "perf/train_wait_time" in m]
    ratios = [m["perf/wait_time_ratio"] for m in steps if "perf/wait_time_ratio" in m]
    if not waits:
        ctx.row("trainer idle per step", "no perf/train_wait_time in metrics.jsonl", FAIL)
        raise CheckFailed("the run logged no trainer wait time")
    after_first = waits[1:] or waits
    ctx.row(
        "trainer idle per step (overlapped push on)",
        f"perf/train_wait_time by step {[round(w, 3) for w in waits]} s (mean after the first "
        f"{sum(after_first) / len(after_first):.3f} s); wait ratio {[round(r, 2) for r in ratios]}",
        waits=waits,
        ratios=ratios,
    )


ITEMS: tuple[tuple[int, str, Callable[[Any], None]], ...] = (
    (1, "MFU at 8B widths", item_mfu),
    (2, "world-size > 1 trainer on a one-rank group", item_trainer),
    (3, "publish at world size > 1", item_publish),
    (4, "receiving side: per-bucket apply under a 90 % reserve", item_receive),
    (5, "collective failure: a receiver joins and dies", item_failure),
    (6, "packed vs padded; varlen kernel vs loop", item_packing),
    (7, "70B-shaped layer and 128k head", item_70b),
    (8, "fleetrl up end to end", item_up),
)


# -- running -----------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="folder for scale_check.json and scale_check.md (created)")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes (what the test suite runs)")
    parser.add_argument("--budget-s", type=float, help=f"the whole run (at most {MAX_GPU_BUDGET_S:.0f} s on GPU)")
    parser.add_argument("--only", help="comma-separated item numbers (default all)")
    parser.add_argument("--keep-going", action="store_true", help="run the later items after a failure")
    parser.add_argument("--peak-tflops", type=float, help="the chip's dense bf16 peak, for MFU (default by name)")
    parser.add_argument("--workdir", type=Path, help="scratch folder, kept (default a fresh one, removed)")
    parser.add_argument("--worker", choices=["join-and-die", "dead-receiver-push"], help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is None and args.out is None:
        parser.error("--out DIR is required")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker == "join-and-die":
        return join_and_die_worker(json.loads(args.spec))
    if args.worker == "dead-receiver-push":
        return dead_receiver_push_worker(json.loads(args.spec))
    import torch

    dry = args.dry_run
    try:
        budget = check_budget(args.budget_s or (600.0 if dry else MAX_GPU_BUDGET_S), dry)
    except ValueError as exc:
        print(f"scale_check: {exc}", file=sys.stderr)
        return 2
    if not dry and not torch.cuda.is_available():
        print("scale_check: no CUDA device; use --dry-run for the CPU mode", file=sys.stderr)
        return 2
    sizes = DRY if dry else GPU
    only = {int(x) for x in args.only.split(",")} if args.only else None
    if args.peak_tflops:
        peak = args.peak_tflops * 1e12
    elif dry:
        peak = measure_cpu_peak_flops()
    else:
        name = torch.cuda.get_device_name(0)
        peak = next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="fleetrl-scale-check-"))
    workdir.mkdir(parents=True, exist_ok=True)
    report = Report("dry run (CPU, tiny sizes)" if dry else f"GPU ({sizes.name})", budget_s=budget)
    if dry:
        report.device = f"CPU ({platform.machine()}, {os.cpu_count()} cores)"
    else:
        props = torch.cuda.get_device_properties(0)
        name = torch.cuda.get_device_name(0)
        report.device = f"{name}, {props.total_memory / GIB:.0f} GiB, torch {torch.__version__}"
    ctx = Ctx(
        dry=dry,
        device="cpu" if dry else "cuda",
        sizes=sizes,  # type: ignore[arg-type]  (gpu_check's runner reads limits_s, check_up the run lengths)
        workdir=workdir,
        out=args.out,
        report=report,
        deadline=time.monotonic() + budget,
        peak_flops=peak,
    )
    print(f"scale_check: {report.mode} on {report.device}, budget {budget:.0f} s, scratch {workdir}", flush=True)
    try:
        ok = gc.run_checks(ctx, ITEMS, only, keep_going=args.keep_going)
    finally:
        if ctx.group is not None:
            import torch.distributed as dist

            with contextlib.suppress(Exception):  # teardown only
                dist.destroy_process_group()
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    print()
    print(f"Second GPU check ({report.mode}) on {report.device}, {time.time() - report.started:.0f} s in all")
    print(report.table(), flush=True)
    code = 0 if ok else 1
    if not dry:
        sys.stderr.flush()
        os._exit(code)  # no teardown of CUDA, NCCL and compile workers to wait for: everything is written
    return code


if __name__ == "__main__":
    sys.exit(main())
