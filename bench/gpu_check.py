"""The GPU check (issue 31): one script that proves fleetrl on one GPU in at most 8 minutes, or on CPU in a dry run.

    python bench/gpu_check.py --out DIR              # on one H100/H200: ~1.5B-parameter model, rows of 4096 tokens
    python bench/gpu_check.py --out DIR --dry-run    # on CPU, tiny sizes (the test suite runs this)

The checks run in order and the script stops at the first failure; each has a time limit (signal.alarm for the
in-process parts, a timeout for each child process) and the whole fits --budget-s (480 s by default). It prints one
table and writes it to DIR/gpu_check.json (and DIR/gpu_check.md) after every check, so a run cut off still leaves
what it measured.

1. versions, the device, a bf16 matmul's TFLOP/s, imports of every fleetrl module the checks use, the services'
   entry points, which run-config knobs of issue 26 exist.
2. placement: a one-rank torchrun trainer (DistContext.from_env + PolicyTrainer) binds the device it was given;
   where its parameters are and whether they are FSDP2 DTensors.
3. trainer throughput and memory through PolicyTrainer.train_step on a random Qwen2-shaped model built in place
   (about 1.5B parameters: Qwen2.5-1.5B's shape; no download): tokens/s, model FLOPs utilisation
   (6 * params * tokens/s / the chip's dense bf16 peak), peak memory; fp32 vs mixed precision, activation
   checkpointing on/off, packed vs padded on a long-tailed length mix, the largest micro-batch of 4k-token rows that
   fits (doubling until torch.cuda.OutOfMemoryError).
4. the weight push of that model: the trainer's snapshot (pageable vs pinned host memory), PolicyTrainer.publish
   into fleetrl's WeightPublisher (the trainer's stall), fetch_weights in a second process, the load onto the GPU.
5. the hf engine (services/inference/hf_engine.py) on the device: generation tokens/s for a batch, a weight swap
   mid-generation (tokens before and after carry their versions).
6. `fleetrl up` of the arithmetic example (a shortened warm start, a few steps) with the trainer on the GPU.
7. one AdamW step at lr 1e-6: the fraction of weights that change under mixed precision (fp32 master weights) vs
   pure bf16.

A knob that has not landed in `Config` (compute_dtype, packing, micro_batch_tokens, ...) or an engine without a
device option makes its row "not built", not a failure, so the script runs on whatever has landed.
`bench/gpu_check_prepare.py` collects the wheels the GPU machine lacks and prints the one command to run there.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import gc
import importlib
import importlib.metadata
import importlib.util
import inspect
import itertools
import json
import math
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

OK, FAIL, NOT_BUILT, NOT_RUN, SKIPPED = "ok", "FAIL", "not built", "not run", "skipped"
STATUSES = (OK, FAIL, NOT_BUILT, NOT_RUN, SKIPPED)

# Issue 26's run-config knobs: each sub-check that needs one reports "not built" until it exists.
KNOBS = ("compute_dtype", "packing", "micro_batch_tokens", "gradient_checkpointing", "logprob_chunk_tokens")
# Dense bf16 peak of the chips this project is lent (SXM); the MFU of every row is against it, fp32 rows included.
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12}
GIB = 1 << 30

# The fleetrl modules the checks drive (check 1 imports each; a missing one fails there, not halfway through).
MODULES = (
    "fleetrl.config",
    "fleetrl.tiny_model",
    "fleetrl.trainer",
    "fleetrl.trainer.distributed",
    "fleetrl.trainer.inner_loop",
    "fleetrl.trainer.policy_trainer",
    "fleetrl.trainer.synthetic",
    "fleetrl.weights.publisher",
    "fleetrl.weights.fetch",
    "fleetrl.services.inference.hf_engine",
    "fleetrl.services.inference.launcher",
    "fleetrl.services.trainer.server",
    "fleetrl.commands.registry",
    "fleetrl.up.run",
)
SERVICES = ("controller", "gateway", "inference", "trainer")


@dataclass(frozen=True)
class Sizes:
    """What one mode runs: the model's shape, the rows, the search cap, the generation batch, the run lengths."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    max_positions: int
    tie_embeddings: bool
    row_tokens: int  # one row of checks 3 and 4
    prompt_tokens: int  # of which prompt (mask 0)
    rows_per_step: int  # rows of the fp32 / mixed / checkpointing comparison
    timed_steps: int  # after one warm-up step
    max_micro_rows: int  # the doubling search stops here if nothing runs out of memory first
    mix_lengths: tuple[int, ...]  # one group of 2 samples per length: the long-tailed packed vs padded batch
    gen_batch: int
    gen_prompt: int
    gen_tokens: int
    swap_tokens: int  # long enough that the swap lands mid-generation
    warm_start_steps: int
    up_steps: int
    adam_row_tokens: int
    limits_s: dict[int, float] = field(default_factory=dict)  # check number -> time limit


GPU = Sizes(
    name="qwen2-1.5b",  # Qwen2.5-1.5B's shape: 1.54B parameters with tied embeddings
    hidden=1536,
    layers=28,
    heads=12,
    kv_heads=2,
    intermediate=8960,
    vocab=151936,
    max_positions=32768,
    tie_embeddings=True,
    row_tokens=4096,
    prompt_tokens=256,
    rows_per_step=2,
    timed_steps=2,
    max_micro_rows=64,
    mix_lengths=(4096, 256),
    gen_batch=32,
    gen_prompt=128,
    gen_tokens=128,
    swap_tokens=256,
    warm_start_steps=200,
    up_steps=4,
    adam_row_tokens=512,
    limits_s={1: 25, 2: 45, 3: 160, 4: 60, 5: 45, 6: 100, 7: 45},
)
DRY = Sizes(
    name="tiny",
    hidden=64,
    layers=2,
    heads=2,
    kv_heads=1,
    intermediate=128,
    vocab=512,
    max_positions=1024,
    tie_embeddings=True,  # as on GPU (Qwen2.5-1.5B ties them): the publish, swap and step paths of a tied model
    row_tokens=64,
    prompt_tokens=8,
    rows_per_step=2,
    timed_steps=1,
    max_micro_rows=8,
    mix_lengths=(64, 8),
    gen_batch=4,
    gen_prompt=8,
    gen_tokens=16,
    swap_tokens=400,
    warm_start_steps=20,
    up_steps=2,
    adam_row_tokens=32,
    limits_s={1: 60, 2: 120, 3: 180, 4: 60, 5: 60, 6: 240, 7: 60},
)


# -- the table ---------------------------------------------------------------------------------------------------


@dataclass
class Row:
    check: int
    item: str
    result: str
    status: str = OK
    seconds: float | None = None
    data: dict[str, Any] = field(default_factory=dict)


@dataclass
class CheckSummary:
    check: int
    title: str
    status: str
    seconds: float | None
    error: str = ""


@dataclass
class Report:
    mode: str
    device: str = ""
    budget_s: float = 0.0
    started: float = field(default_factory=time.time)
    rows: list[Row] = field(default_factory=list)
    checks: list[CheckSummary] = field(default_factory=list)

    def add(self, row: Row) -> Row:
        if row.status not in STATUSES:
            raise ValueError(f"row status {row.status!r} is not one of {STATUSES}")
        self.rows.append(row)
        print(f"  [{row.check}] {row.item}: {row.result} ({row.status})", flush=True)
        return row

    @property
    def failed(self) -> bool:
        return any(c.status == FAIL for c in self.checks)

    def to_json(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "device": self.device,
            "budget_s": self.budget_s,
            "started_unix": self.started,
            "total_s": round(time.time() - self.started, 1),
            "failed": self.failed,
            "checks": [dataclasses.asdict(c) for c in self.checks],
            "rows": [dataclasses.asdict(r) for r in self.rows],
        }

    def table(self) -> str:
        """One markdown table: a line per check (its status and seconds), then its rows."""
        lines = ["| check | item | result | status | s |", "| --- | --- | --- | --- | --- |"]
        for summary in self.checks:
            secs = "" if summary.seconds is None else f"{summary.seconds:.1f}"
            title = f"**{summary.check}** | **{summary.title}**"
            lines.append(f"| {title} | {_cell(summary.error)} | {summary.status} | {secs} |")
            for row in (r for r in self.rows if r.check == summary.check):
                secs = "" if row.seconds is None else f"{row.seconds:.1f}"
                lines.append(f"| {row.check} | {_cell(row.item)} | {_cell(row.result)} | {row.status} | {secs} |")
        return "\n".join(lines)

    def write(self, out: Path) -> None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "gpu_check.json").write_text(json.dumps(self.to_json(), indent=2) + "\n")
        header = f"GPU check ({self.mode}) on {self.device}, {time.time() - self.started:.0f} s in all\n\n"
        (out / "gpu_check.md").write_text(header + self.table() + "\n")


def _cell(text: str) -> str:
    return text.replace("|", "/").replace("\n", " ")[:300]


class CheckFailed(Exception):
    """A check found something wrong (the message says what); the script stops after it."""


class CheckTimeout(BaseException):
    """The check ran past its time limit (raised by SIGALRM; a BaseException so no `except Exception` eats it)."""


# -- the context every check gets -------------------------------------------------------------------------------


@dataclass
class Ctx:
    dry: bool
    device: str  # "cuda" or "cpu"
    sizes: Sizes
    workdir: Path
    out: Path
    report: Report
    deadline: float
    peak_flops: float | None = None
    python: str = sys.executable
    model_dir: Path | None = None
    tiny_dir: Path | None = None
    n_params: int = 0
    current_check: int = 0

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"

    def row(self, item: str, result: str, status: str = OK, seconds: float | None = None, **data: Any) -> Row:
        return self.report.add(Row(self.current_check, item, result, status, _round(seconds), data))

    def remaining(self) -> float:
        return self.deadline - time.monotonic()


def _round(x: float | None, digits: int = 3) -> float | None:
    return None if x is None else round(float(x), digits)


def knobs() -> dict[str, bool]:
    """Which of issue 26's knobs `Config` has now."""
    from fleetrl.config import Config

    return {name: name in Config.model_fields for name in KNOBS}


def has_knob(name: str) -> bool:
    return knobs()[name]


def sync(ctx: Ctx) -> None:
    import torch

    if ctx.cuda:
        torch.cuda.synchronize()


def free_memory(ctx: Ctx) -> None:
    import torch

    gc.collect()
    if ctx.cuda:
        torch.cuda.empty_cache()


def peak_gib(ctx: Ctx) -> float | None:
    import torch

    return torch.cuda.max_memory_allocated() / GIB if ctx.cuda else None


def reset_peak(ctx: Ctx) -> None:
    import torch

    if ctx.cuda:
        torch.cuda.reset_peak_memory_stats()


def count(n: float) -> str:
    """1.54B, 304.6K: a parameter count at a glance."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(int(n))


def gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.2f} MB"


def rate(nbytes: float, seconds: float) -> str:
    """Bytes per second as GB/s (MB/s below 0.1 GB/s)."""
    per_s = nbytes / max(seconds, 1e-9)
    return f"{per_s / 1e9:.1f} GB/s" if per_s >= 1e8 else f"{per_s / 1e6:.1f} MB/s"


def fmt_gib(x: float | None) -> str:
    return "n/a on CPU" if x is None else f"{x:.1f} GiB"


# -- the model built in place -----------------------------------------------------------------------------------


def ensure_model(ctx: Ctx) -> Path:
    """A random Qwen2-shaped causal LM of `ctx.sizes` in an HF folder (bf16 on GPU, fp32 in a dry run), with the
    tiny byte-level tokenizer of fleetrl.tiny_model (the trainer only decodes logged samples with it)."""
    if ctx.model_dir is not None:
        return ctx.model_dir
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from fleetrl.tiny_model import build_tiny_model

    started = time.perf_counter()
    s = ctx.sizes
    folder = ctx.workdir / "model"
    build_tiny_model(folder)  # its tokenizer files; its weights are replaced below
    for old in [*folder.glob("*.safetensors"), *folder.glob("*.safetensors.index.json")]:
        old.unlink()
    eos = json.loads((folder / "config.json").read_text())["eos_token_id"]
    config = Qwen2Config(
        vocab_size=s.vocab,
        hidden_size=s.hidden,
        num_hidden_layers=s.layers,
        num_attention_heads=s.heads,
        num_key_value_heads=s.kv_heads,
        intermediate_size=s.intermediate,
        max_position_embeddings=s.max_positions,
        tie_word_embeddings=s.tie_embeddings,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        bos_token_id=eos,
        eos_token_id=eos,
        pad_token_id=eos,
    )
    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    torch.manual_seed(0)
    with torch.device(ctx.device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    ctx.n_params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(folder)
    del model
    free_memory(ctx)
    ctx.model_dir = folder
    files = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    ctx.row(
        "model built in place",
        f"Qwen2-shaped {s.name}: {count(ctx.n_params)} params, {s.layers} layers, hidden {s.hidden}, vocab "
        f"{s.vocab}, tied embeddings {s.tie_embeddings}; {gb(files)} of {str(dtype).removeprefix('torch.')} "
        "safetensors",
        seconds=time.perf_counter() - started,
        params=ctx.n_params,
        file_bytes=files,
    )
    return folder


def ensure_tiny(ctx: Ctx) -> Path:
    if ctx.tiny_dir is None:
        from fleetrl.tiny_model import build_tiny_model

        ctx.tiny_dir = build_tiny_model(ctx.workdir / "tiny")
    return ctx.tiny_dir


def run_config(base_model: Path | str, log_path: Path, **overrides: Any) -> Any:
    """A run config for driving PolicyTrainer directly: no reference, no per-step publish, stale rows trained.
    An override naming a field `Config` lacks raises KeyError (callers check knobs first)."""
    from fleetrl.config import Config

    values: dict[str, Any] = {
        "base_model": str(base_model),
        "log_path": str(log_path),
        "completions_per_prompt": 2,
        "prompt_groups_per_step": 1,
        "max_completion_tokens": 16,
        "max_seq_len": None,  # no cap: rows of any length train
        "learning_rate": 1e-6,
        "kl_beta": 0.0,
        "seed": 0,
        "stale_policy": "train",
        "weight_sync_interval": 0,
        "log_samples_interval": 0,
    }
    for name, value in overrides.items():
        if name not in Config.model_fields:
            raise KeyError(name)
        values[name] = value
    return Config(**values)


class Groups:
    """Synthetic rollout groups of fixed lengths, with fresh row ids on every call (the trainer trains a row once).
    The rollout logprobs are -ln(vocab), what a random model gives, so the importance ratios start near 1."""

    def __init__(self, vocab: int, prompt_tokens: int) -> None:
        self.vocab = vocab
        self.prompt = prompt_tokens
        self.next_row = 0

    def make(self, lengths: list[int]) -> list[Any]:
        """One group of two samples per entry of `lengths` (each sample that many tokens)."""
        from fleetrl.trainer.synthetic import synthetic_groups

        groups = []
        flat = -math.log(self.vocab)
        for length in lengths:
            prompt = min(self.prompt, max(1, length // 4))
            (group,) = synthetic_groups(
                num_groups=1,
                group_size=2,
                vocab_size=self.vocab,
                prompt_len=(prompt, prompt),
                completion_len=(length - prompt, length - prompt),
                seed=self.next_row,
                first_row_id=self.next_row,
            )
            for sample in group.samples:
                sample.logprobs = [flat if m else 0.0 for m in sample.loss_mask]
            groups.append(group)
            self.next_row += 1
        return groups

    @staticmethod
    def tokens(groups: list[Any]) -> int:
        """Trained positions (N - 1 per sample of N tokens), as the trainer counts them."""
        return sum(len(s.tokens) - 1 for g in groups for s in g.samples)


# -- the checks ---------------------------------------------------------------------------------------------------


def check_versions(ctx: Ctx) -> None:
    import torch

    versions = {"python": platform.python_version(), "torch": torch.__version__, "cuda": str(torch.version.cuda)}
    for name, module in (
        ("transformers", "transformers"),
        ("pydantic", "pydantic"),
        ("pyzmq", "zmq"),
        ("grpcio", "grpc"),
        ("protobuf", "google.protobuf"),
        ("safetensors", "safetensors"),
        ("xxhash", "xxhash"),
        ("peft", "peft"),
        ("datasets", "datasets"),
    ):
        try:
            importlib.import_module(module)
            versions[name] = importlib.metadata.version(name)
        except ImportError as exc:
            versions[name] = f"missing ({exc})"
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "?"
    missing = [n for n, v in versions.items() if v.startswith("missing") and n not in ("peft", "datasets")]
    ctx.row("versions", ", ".join(f"{k} {v}" for k, v in versions.items()), FAIL if missing else OK, **versions)
    if missing:
        raise CheckFailed(f"missing packages: {', '.join(missing)}")

    if ctx.cuda:
        if not torch.cuda.is_available():
            raise CheckFailed("torch sees no CUDA device (run with --dry-run on a CPU machine)")
        props = torch.cuda.get_device_properties(0)
        name = torch.cuda.get_device_name(0)
        ctx.report.device = name
        a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        for _ in range(3):
            a @ b
        torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(10):
            a @ b
        torch.cuda.synchronize()
        tflops = 10 * 2 * 8192**3 / (time.perf_counter() - started) / 1e12
        del a, b
        free_memory(ctx)
        ctx.row(
            "device",
            f"{name}, {props.total_memory / GIB:.1f} GiB, {props.multi_processor_count} SMs, capability "
            f"{props.major}.{props.minor}; bf16 8192^3 matmul {tflops:.0f} TFLOP/s; MFU peak "
            + (f"{ctx.peak_flops / 1e12:.0f} TFLOP/s" if ctx.peak_flops else "unknown for this chip (--peak-tflops)"),
            name=name,
            memory_gib=props.total_memory / GIB,
            matmul_bf16_tflops=tflops,
            peak_flops=ctx.peak_flops,
        )
    else:
        ctx.report.device = f"CPU ({platform.machine()}, {os.cpu_count()} cores)"
        ctx.row("device", f"{ctx.report.device}, {torch.get_num_threads()} torch threads (dry run)")

    failed = []
    for module in MODULES:
        try:
            importlib.import_module(module)
        except Exception as exc:
            failed.append(f"{module}: {type(exc).__name__}: {exc}")
    ctx.row(
        "fleetrl imports",
        f"{len(MODULES) - len(failed)}/{len(MODULES)} modules" + (f"; {'; '.join(failed)}" if failed else ""),
        FAIL if failed else OK,
        modules=list(MODULES),
    )
    if failed:
        raise CheckFailed("fleetrl modules do not import: " + "; ".join(failed))

    from fleetrl.commands.registry import service_names

    names = service_names()
    lacking = [s for s in SERVICES if s not in names]
    ctx.row(
        "service entry points",
        ", ".join(names) or "none",
        FAIL if lacking else OK,
    )
    if lacking:
        raise CheckFailed(f"no entry points for {lacking}: install fleetrl (pip install --no-deps -e .)")
    if importlib.util.find_spec("torch.distributed.run") is None:
        raise CheckFailed("torchrun (torch.distributed.run) is missing")

    from fleetrl.config import Config

    present = knobs()
    shown = []
    for name, there in present.items():
        default = Config.model_fields[name].default if there else None
        shown.append(f"{name} = {default!r}" if there else f"{name}: not built")
    engine_device = _hf_engine_has_device()
    shown.append("HFEngine device option: " + ("yes" if engine_device else "not built"))
    ctx.row("issue-26 knobs (defaults)", "; ".join(shown), knobs=present, hf_engine_device=engine_device)


def _hf_engine_has_device() -> bool:
    from fleetrl.services.inference.hf_engine import HFEngine

    return "device" in inspect.signature(HFEngine.__init__).parameters


def _inference_launcher_has_device() -> bool:
    from fleetrl.services.inference.launcher import build_parser

    return any("--device" in action.option_strings for action in build_parser()._actions)


def check_placement(ctx: Ctx) -> None:
    tiny = ensure_tiny(ctx)
    result_file = ctx.workdir / "placement.json"
    spec = {"model": str(tiny), "device": ctx.device, "result": str(result_file), "log": str(ctx.workdir / "p")}
    argv = [ctx.python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1"]
    argv += [str(Path(__file__).resolve()), "--worker", "placement", "--spec", json.dumps(spec)]
    started = time.perf_counter()
    proc = run_child(argv, ctx.workdir / "placement.log", timeout_s=max(5.0, ctx.remaining() - 2))
    took = time.perf_counter() - started
    if proc != 0 or not result_file.exists():
        tail = _tail(ctx.workdir / "placement.log")
        ctx.row("torchrun trainer", f"exit {proc}: {tail}", FAIL, seconds=took)
        raise CheckFailed(f"the one-rank torchrun trainer failed (exit {proc})")
    got = json.loads(result_file.read_text())
    expected = got["expected_device"]
    wrong = {d: n for d, n in got["param_devices"].items() if d != expected}
    ctx.row(
        "torchrun trainer binds its device",
        f"LOCAL_RANK {got['local_rank']}, world {got['world_size']}, backend {got['backend']}; current device "
        f"{got['current_device']}; params on {got['param_devices']} (expected {expected}); one step trained, "
        f"loss {got['loss']:.4f}",
        FAIL if wrong or got["current_device"] not in (expected, "cpu") else OK,
        seconds=took,
        **got,
    )
    if wrong:
        raise CheckFailed(f"parameters off the rank's device {expected}: {wrong}")
    if got["dtensor_params"]:
        ctx.row("FSDP2 parameters", f"{got['dtensor_params']}/{got['params']} DTensors on {expected}")
    else:
        ctx.row(
            "FSDP2 parameters",
            f"none of {got['params']} parameters is a DTensor: the trainer does not shard at world size "
            f"{got['world_size']}",
            NOT_BUILT,
        )


def placement_worker(spec: dict[str, Any]) -> int:
    """Run under torchrun: the trainer's own start (DistContext.from_env, PolicyTrainer), then where things are."""
    import torch

    from fleetrl.trainer import DistContext, PolicyTrainer
    from fleetrl.trainer import distributed as fdist

    ctx = DistContext.from_env(device=spec["device"], timeout_s=120)
    cfg = run_config(spec["model"], Path(spec["log"]), learning_rate=1e-3)
    trainer = PolicyTrainer(cfg, device=spec["device"], dist_ctx=ctx)
    expected = f"cuda:{ctx.local_rank}" if spec["device"] == "cuda" else "cpu"
    devices: dict[str, int] = {}
    dtensors = 0
    params = list(trainer.model.parameters())
    for p in params:
        devices[str(p.device)] = devices.get(str(p.device), 0) + 1
        dtensors += int(hasattr(p, "device_mesh"))
    vocab = trainer.vocab_size
    loss = float("nan")
    if ctx.is_main:
        groups = Groups(vocab, 4).make([16, 12])
        loss = trainer.train_step(groups).metrics.get("train/loss", float("nan"))
        trainer.stop_followers()
    else:
        trainer.follow()
    current = f"cuda:{torch.cuda.current_device()}" if spec["device"] == "cuda" else "cpu"
    result = {
        "local_rank": ctx.local_rank,
        "world_size": ctx.world_size,
        "backend": torch.distributed.get_backend() if ctx.enabled else "none (world size 1: no process group)",
        "current_device": current,
        "expected_device": expected,
        "param_devices": devices,
        "params": len(params),
        "dtensor_params": dtensors,
        "loss": loss,
    }
    if ctx.is_main:
        Path(spec["result"]).write_text(json.dumps(result))
    fdist.destroy(ctx)
    return 0


# -- check 3 -----------------------------------------------------------------------------------------------------


class TrainerBench:
    """One PolicyTrainer at a time (the 1.5B model in fp32 with AdamW state is ~25 GB), rebuilt when the settings
    change; steps timed with the device synchronised and micro-batches counted by a forward hook."""

    def __init__(self, ctx: Ctx) -> None:
        self.ctx = ctx
        self.groups = Groups(ctx.sizes.vocab, ctx.sizes.prompt_tokens)
        self.settings: dict[str, Any] | None = None
        self.trainer: Any = None
        self.forwards = 0
        self.build_s = 0.0
        self.unreported_build_s = 0.0  # the build's seconds go to the first row measured on it
        self.built = 0

    def use(self, **settings: Any) -> Any:
        if self.trainer is not None and settings == self.settings:
            return self.trainer
        self.close()
        from fleetrl.trainer import PolicyTrainer

        started = time.perf_counter()
        self.built += 1
        cfg = run_config(ensure_model(self.ctx), self.ctx.workdir / f"run3-{self.built}", **settings)
        self.trainer = PolicyTrainer(cfg, device=self.ctx.device)
        self.trainer.model.register_forward_hook(self._count)
        self.settings = settings
        self.build_s = time.perf_counter() - started
        self.unreported_build_s = self.build_s
        return self.trainer

    def _count(self, *_: Any) -> None:
        self.forwards += 1

    def close(self) -> None:
        if self.trainer is not None:
            self.trainer.close()
        self.trainer = None
        self.settings = None
        free_memory(self.ctx)

    def step(self, lengths: list[int]) -> tuple[float, int, int]:
        """One train_step of one group of 2 samples per length: (seconds, tokens, forwards)."""
        groups = self.groups.make(lengths)
        sync(self.ctx)
        self.forwards = 0
        started = time.perf_counter()
        self.trainer.train_step(groups)
        sync(self.ctx)
        return time.perf_counter() - started, Groups.tokens(groups), self.forwards

    def measure(self, lengths: list[int], steps: int) -> dict[str, Any]:
        """A warm-up step, then `steps` timed ones: tokens/s, MFU, peak memory, micro-batches per step. `seconds`:
        the whole measurement, with the trainer's build when this is the first row measured on it."""
        begun = time.perf_counter()
        self.step(lengths)
        reset_peak(self.ctx)
        times, tokens, forwards = [], 0, 0
        for _ in range(steps):
            seconds, tokens, forwards = self.step(lengths)
            times.append(seconds)
        mean = sum(times) / len(times)
        tps = tokens / mean
        mfu = 6 * self.ctx.n_params * tps / self.ctx.peak_flops if self.ctx.peak_flops else None
        return {
            "tokens": tokens,
            "step_s": mean,
            "tokens_per_s": tps,
            "mfu": mfu,
            "peak_gib": peak_gib(self.ctx),
            "micro_batches": forwards,
            "build_s": self.build_s,
            "seconds": time.perf_counter() - begun + self._take_build_s(),
        }

    def _take_build_s(self) -> float:
        build, self.unreported_build_s = self.unreported_build_s, 0.0
        return build


def describe(m: dict[str, Any]) -> str:
    mfu = "n/a" if m["mfu"] is None else f"{100 * m['mfu']:.1f}%"
    return (
        f"{m['tokens_per_s']:,.0f} tok/s, MFU {mfu}, peak {fmt_gib(m['peak_gib'])} ({m['tokens']} tokens/step, "
        f"{m['step_s']:.3f} s/step, {m['micro_batches']} micro-batch(es))"
    )


def check_trainer(ctx: Ctx) -> None:
    import torch

    s = ctx.sizes
    ensure_model(ctx)
    have = knobs()
    bench = TrainerBench(ctx)
    uniform = [s.row_tokens] * (s.rows_per_step // 2)
    mix = list(s.mix_lengths)
    rows_label = f"{s.rows_per_step} rows x {s.row_tokens}"
    # The GPU defaults: mixed precision, packing, checkpointing on (long rows), and a step's rows in one micro-batch
    # (micro_batch_tokens = None), so the search below sizes the micro-batch by the rows it sends.
    base: dict[str, Any] = {"dtype": "float32", "gradient_checkpointing": True}
    if have["compute_dtype"]:
        base["compute_dtype"] = "bfloat16"
    if have["packing"]:
        base["packing"] = True
    if have["micro_batch_tokens"]:
        base["micro_batch_tokens"] = None
    precision = "mixed precision (bf16 compute, fp32 master)" if have["compute_dtype"] else "fp32"
    packing = "packed" if have["packing"] else "padded"
    try:
        trainer = bench.use(**base)
        attn = getattr(trainer.model.config, "_attn_implementation", "?")
        ctx.row("attention implementation", f"{attn} (packed rows: see the next row)")
        packed_attention_row(ctx)
        m = bench.measure(uniform, s.timed_steps)
        ctx.row(f"{precision}, {packing}, checkpointing on: {rows_label}", describe(m), **m)
        if not have["compute_dtype"]:
            ctx.row("mixed precision (bf16 compute, fp32 master)", "Config has no compute_dtype", NOT_BUILT)
        m = bench.measure(mix, s.timed_steps)
        ctx.row(f"{precision}, {packing}: long-tailed mix {mix} x 2", describe(m), **m)
        if not have["packing"]:
            ctx.row("packed (no compute on padding)", "Config has no packing", NOT_BUILT)

        bench.use(**{**base, "gradient_checkpointing": False})
        m = bench.measure(uniform, s.timed_steps)
        ctx.row(f"{precision}, {packing}, checkpointing off: {rows_label}", describe(m), **m)

        if have["compute_dtype"]:
            bench.use(**{**base, "compute_dtype": "float32"})
            m = bench.measure(uniform, s.timed_steps)
            ctx.row(f"fp32, {packing}, checkpointing on: {rows_label}", describe(m), **m)
        if have["packing"]:
            bench.use(**{**base, "packing": False})
            m = bench.measure(mix, s.timed_steps)
            ctx.row(f"{precision}, padded: long-tailed mix {mix} x 2", describe(m), **m)
            m = bench.measure(uniform, s.timed_steps)
            ctx.row(f"{precision}, padded, checkpointing on: {rows_label}", describe(m), **m)
    except torch.cuda.OutOfMemoryError as exc:
        raise CheckFailed(f"out of memory outside the micro-batch search: {str(exc)[:200]}") from exc
    finally:
        bench.close()
    # Last, as it runs until the time left or an out-of-memory error: on the default settings again.
    try:
        bench.use(**base)
        search_micro_batch(ctx, bench)
    finally:
        bench.close()


def packed_attention_row(ctx: Ctx) -> None:
    """Packed rows through `varlen_sdpa`'s two paths: torch's varlen flash kernel (CUDA, bf16) and the per-sample
    sdpa loop over host-side bounds; outputs and gradients compared, and the time of a forward and backward of each,
    on a few long samples and on many short ones."""
    import inspect as _inspect

    import torch

    from fleetrl.trainer import varlen_attention as va

    s = ctx.sizes
    dim = s.hidden // s.heads
    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    kernel_ok = va.use_varlen_kernel(torch.empty(1, device=ctx.device, dtype=dtype))
    gqa_native = kernel_ok and "enable_gqa" in _inspect.signature(va._torch_varlen()).parameters
    long_mix = [*s.mix_lengths, *s.mix_lengths]
    short_mix = [min(s.mix_lengths)] * 32

    def run(fn: Callable[..., Any], inputs: tuple[Any, Any, Any]) -> tuple[Any, list[Any], float]:
        q, k, v = (t.clone().requires_grad_(True) for t in inputs)
        out = fn(q, k, v)
        out.float().square().sum().backward()
        grads = [t.grad.clone() for t in (q, k, v)]
        sync(ctx)
        t0 = time.perf_counter()
        for _ in range(3):
            fn(q, k, v).float().square().sum().backward()
        sync(ctx)
        return out.detach(), grads, (time.perf_counter() - t0) / 3

    for lengths in (long_mix, short_mix):
        g = torch.Generator(device=ctx.device).manual_seed(0)
        n = sum(lengths)
        inputs = (
            torch.randn(1, s.heads, n, dim, device=ctx.device, dtype=dtype, generator=g),
            torch.randn(1, s.kv_heads, n, dim, device=ctx.device, dtype=dtype, generator=g),
            torch.randn(1, s.kv_heads, n, dim, device=ctx.device, dtype=dtype, generator=g),
        )
        host_cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
        bounds = {"cu_seq_lens_q": host_cu, "max_length_q": max(lengths)}

        def loop(q: Any, k: Any, v: Any, bounds: dict[str, Any] = bounds) -> Any:
            return va._per_sample_sdpa(q, k, v, [int(b) for b in bounds["cu_seq_lens_q"].tolist()], 0.0, None)

        out_l, grads_l, loop_s = run(loop, inputs)
        result = f"per-sample sdpa {loop_s * 1e3:.2f} ms"
        extra: dict[str, Any] = {"loop_s": loop_s}
        status = OK
        if kernel_ok:
            dev_cu = host_cu.to(ctx.device)

            def kernel(q: Any, k: Any, v: Any, dev_cu: Any = dev_cu, longest: int = max(lengths)) -> Any:
                return va._varlen_kernel(q, k, v, dev_cu, longest, None)

            out_k, grads_k, kernel_s = run(kernel, inputs)
            diff = max(
                float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-6))
                for a, b in zip([out_k, *grads_k], [out_l.squeeze(0), *grads_l], strict=True)
            )
            status = OK if diff <= 0.02 else FAIL  # two kernels' bf16 roundings differ
            result += (
                f", torch varlen_attn {kernel_s * 1e3:.2f} ms (kv heads {'native' if gqa_native else 'repeated'}); "
                f"largest difference of output and gradients {diff:.3g} of their largest value (tolerance 0.02)"
            )
            extra.update(kernel_s=kernel_s, max_diff=diff)
        else:
            result += "; torch varlen_attn: not used here (needs CUDA, bf16/fp16, torch >= 2.10)"
        label = f"{len(lengths)} x {lengths[0]}" if len(set(lengths)) == 1 else str(lengths)
        ctx.row(
            f"packed attention, samples {label} ({s.heads} heads, {s.kv_heads} kv heads, dim {dim}, {dtype})",
            f"fwd+bwd: {result}; varlen_sdpa uses {va.describe_choice(dtype, ctx.device)}",
            status,
            **extra,
        )


def search_micro_batch(ctx: Ctx, bench: TrainerBench) -> None:
    """Double the rows of one step (all in one micro-batch: micro_batch_tokens = None; the forwards are counted)
    until the device runs out of memory, the cap, or the check's time; the largest that ran is the answer."""
    import torch

    s = ctx.sizes
    trainer = bench.trainer
    rows, best, last_s = 2, None, 0.0
    tried: list[str] = []  # "rows: tokens/s" of every size that ran (the first of each size includes warm-up)
    started = time.perf_counter()
    stopped = f"the cap of {s.max_micro_rows} rows"
    while rows <= s.max_micro_rows:
        # A packed row's attention may grow with its length squared (a block-diagonal mask without flash-attention):
        # leave room for a step five times the last.
        if last_s and ctx.remaining() < 5 * last_s + 15:
            stopped = "the check's time"
            break
        oom = False
        try:
            reset_peak(ctx)
            seconds, tokens, forwards = bench.step([s.row_tokens] * (rows // 2))
        except (torch.cuda.OutOfMemoryError, RuntimeError) as exc:  # cuBLAS/cuDNN report theirs as RuntimeError
            if not isinstance(exc, torch.cuda.OutOfMemoryError) and "out of memory" not in str(exc):
                raise
            oom = True  # freed below, once the traceback no longer holds the step's tensors
        if oom:
            trainer.optimizer.zero_grad(set_to_none=True)
            free_memory(ctx)
            stopped = f"out of memory at {rows} rows"
            break
        best = {"rows": rows, "tokens": tokens, "step_s": seconds, "peak_gib": peak_gib(ctx), "forwards": forwards}
        tried.append(f"{rows}: {tokens / seconds:,.0f}")
        last_s = seconds
        rows *= 2
    took = time.perf_counter() - started
    if best is None:
        ctx.row("largest micro-batch", f"not even 2 rows of {s.row_tokens} fit ({stopped})", FAIL, seconds=took)
        raise CheckFailed("two 4k-token rows do not fit in one micro-batch")
    per_micro = best["rows"] // max(1, best["forwards"])
    ctx.row(
        f"largest micro-batch (rows of {s.row_tokens})",
        f"{best['rows']} rows in one step ran in {best['forwards']} micro-batch(es), {per_micro} rows each "
        f"({per_micro * s.row_tokens} tokens); {best['tokens'] / best['step_s']:,.0f} tok/s, peak "
        f"{fmt_gib(best['peak_gib'])}; stopped by {stopped}; tok/s by rows {'; '.join(tried)}",
        seconds=took,
        **best,
        stopped=stopped,
        tokens_per_s_by_rows=tried,
    )


# -- check 4 -----------------------------------------------------------------------------------------------------


def check_weight_push(ctx: Ctx) -> None:
    import torch

    from fleetrl.trainer import PolicyTrainer
    from fleetrl.trainer import distributed as fdist
    from fleetrl.weights import WeightPublisher

    model_dir = ensure_model(ctx)
    settings: dict[str, Any] = {"dtype": "float32"}
    if has_knob("compute_dtype"):
        settings["compute_dtype"] = "bfloat16"
    if ctx.cuda:
        settings["inference_dtype"] = "bfloat16"  # what GPU replicas serve: the publisher casts in its snapshot
    started = time.perf_counter()
    trainer = PolicyTrainer(run_config(model_dir, ctx.workdir / "run4", **settings), device=ctx.device)
    ctx.row("trainer for the push", f"{settings}", seconds=time.perf_counter() - started)
    publisher = WeightPublisher()
    manifests: list[Any] = []

    def sink(version: int, state_dict: Any, **kwargs: Any) -> Any:
        # As the trainer service wires it (services/trainer/server.py): staged into reused pinned buckets, the
        # step waits only for that copy, and checksums and serving follow in the background.
        manifests.append(publisher.publish(version, state_dict, background=True, **kwargs))
        return manifests[-1]

    trainer.weight_sink = sink
    try:
        state = fdist.full_state_dict(trainer.model, trainer.ctx)
        tensors = [t.detach() for t in state.values()]
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        # The snapshot into fresh pageable memory (what WeightPublisher does today) vs pinned buffers.
        sync(ctx)
        t0 = time.perf_counter()
        pageable = [torch.empty(tuple(t.shape), dtype=t.dtype).copy_(t) for t in tensors]
        sync(ctx)
        page_s = time.perf_counter() - t0
        del pageable
        ctx.row(
            "snapshot to pageable host memory (fresh)",
            f"{gb(nbytes)} in {page_s:.3f} s = {rate(nbytes, page_s)}",
            seconds=page_s,
            bytes=nbytes,
        )
        if ctx.cuda:
            t0 = time.perf_counter()
            pinned = [torch.empty(tuple(t.shape), dtype=t.dtype, pin_memory=True) for t in tensors]
            alloc_s = time.perf_counter() - t0
            copies = []
            for _ in range(2):
                t0 = time.perf_counter()
                for buf, t in zip(pinned, tensors, strict=True):
                    buf.copy_(t, non_blocking=True)
                torch.cuda.synchronize()
                copies.append(time.perf_counter() - t0)
            del pinned
            ctx.row(
                "snapshot to pinned host memory (reused)",
                f"{rate(nbytes, copies[1])} ({copies[1]:.3f} s; first copy {copies[0]:.3f} s; pinning the "
                f"buffers once {alloc_s:.2f} s)",
                seconds=copies[1],
                alloc_s=alloc_s,
                copies_s=copies,
            )
        else:
            ctx.row("snapshot to pinned host memory", "needs CUDA", SKIPPED)
        del state, tensors
        free_memory(ctx)

        info = trainer.publish()
        t0 = time.perf_counter()
        manifest = manifests[-1].result(timeout=max(5.0, ctx.remaining() - 5))
        ready_s = time.perf_counter() - t0
        sent = manifest.total_bytes
        ctx.row(
            "publish, first version (pinned buckets allocated): the trainer's stall",
            f"{info.seconds:.3f} s for {gb(sent)} ({rate(sent, info.seconds)}), {len(manifest.tensors)} tensors; "
            f"checksummed and served {ready_s:.3f} s later, beside the next step",
            seconds=info.seconds,
            bytes=sent,
            ready_s=ready_s,
        )
        # The next version reuses the buckets: what every later version costs the step (the same call the
        # trainer's publish makes, at the next version number, without training a step in between).
        sync(ctx)
        t0 = time.perf_counter()
        staged = sink(info.version + 1, fdist.full_state_dict(trainer.model, trainer.ctx), **_publish_kwargs(trainer))
        stall_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        manifest = staged.result(timeout=max(5.0, ctx.remaining() - 5))
        ready_s = time.perf_counter() - t0
        ctx.row(
            "publish, next version (buckets reused): the trainer's stall",
            f"{stall_s:.3f} s ({rate(sent, stall_s)}); checksummed and served {ready_s:.3f} s later, beside the "
            f"next step",
            seconds=stall_s,
            ready_s=ready_s,
        )
        info = dataclasses.replace(info, version=info.version + 1, seconds=stall_s)
        result_file = ctx.workdir / "fetch.json"
        spec = {"address": publisher.address, "version": info.version, "device": ctx.device, "result": str(result_file)}
        argv = [ctx.python, str(Path(__file__).resolve()), "--worker", "fetch", "--spec", json.dumps(spec)]
        code = run_child(argv, ctx.workdir / "fetch.log", timeout_s=max(5.0, ctx.remaining() - 2))
        if code != 0 or not result_file.exists():
            ctx.row("fetch in a second process", f"exit {code}: {_tail(ctx.workdir / 'fetch.log')}", FAIL)
            raise CheckFailed(f"the fetching process failed (exit {code})")
        got = json.loads(result_file.read_text())
        ctx.row(
            "fetch_weights in a second process",
            f"{got['fetch_s']:.3f} s = {rate(got['bytes'], got['fetch_s'])} (checksums verified)",
            seconds=got["fetch_s"],
            **got,
        )
        ctx.row(
            f"load onto {ctx.device} in that process",
            f"{got['load_s']:.3f} s = {rate(got['bytes'], got['load_s'])}",
            seconds=got["load_s"],
        )
        total = info.seconds + got["fetch_s"] + got["load_s"]
        ctx.row("publish + fetch + load", f"{total:.3f} s per version", seconds=total)
    finally:
        trainer.close()
        publisher.close()
        del trainer
        free_memory(ctx)


def _publish_kwargs(trainer: Any) -> dict[str, Any]:
    """The cast `PolicyTrainer._do_publish` asks of the sink (the served dtype when it differs from the trainer's)."""
    from fleetrl.trainer.model import torch_dtype

    cfg = trainer.cfg
    if cfg.inference_dtype not in (None, cfg.dtype):
        return {"float_dtype": torch_dtype(cfg.inference_dtype)}
    return {}


def fetch_worker(spec: dict[str, Any]) -> int:
    import torch

    from fleetrl.weights import fetch_weights

    started = time.perf_counter()
    manifest, tensors = fetch_weights(spec["address"], spec["version"], timeout_s=120)
    fetch_s = time.perf_counter() - started
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    cuda = spec["device"] == "cuda"
    if cuda:
        torch.zeros(1, device="cuda")  # the CUDA context, not counted in the load
        torch.cuda.synchronize()
    started = time.perf_counter()
    loaded = {n: t.to(spec["device"]) for n, t in tensors.items()}
    if cuda:
        torch.cuda.synchronize()
    load_s = time.perf_counter() - started
    del loaded
    result = {"fetch_s": fetch_s, "load_s": load_s, "bytes": nbytes, "tensors": len(tensors)}
    result["checksum"] = manifest.checksum
    Path(spec["result"]).write_text(json.dumps(result))
    return 0


# -- check 5 -----------------------------------------------------------------------------------------------------


def check_hf_engine(ctx: Ctx) -> None:
    from fleetrl.services.inference.hf_engine import HFEngine

    kwargs: dict[str, Any] = {}
    if _hf_engine_has_device():
        kwargs["device"] = ctx.device
    elif ctx.cuda:
        ctx.row(
            "hf engine on cuda",
            "HFEngine has no device option: it loads and samples on the CPU (services/inference/hf_engine.py)",
            NOT_BUILT,
        )
        return
    model_dir = ensure_model(ctx)
    dtype = "bfloat16" if ctx.cuda else "float32"
    engine = HFEngine(str(model_dir), max_num_seqs=max(ctx.sizes.gen_batch, 8), dtype=dtype, seed=0, **kwargs)
    asyncio.run(_engine_session(ctx, engine, model_dir, dtype))


async def _engine_session(ctx: Ctx, engine: Any, model_dir: Path, dtype: str) -> None:
    import random

    import torch
    from safetensors.torch import load_file

    from fleetrl.clients.inference_types import SamplingRequest
    from fleetrl.weights import WeightPublisher

    s = ctx.sizes
    started = time.perf_counter()
    await engine.start()
    ctx.row(f"engine start ({dtype}, {ctx.device})", "loaded", seconds=time.perf_counter() - started)
    rng = random.Random(0)
    vocab = min(s.vocab, engine.vocab_size)
    publisher = None
    try:

        def request(max_tokens: int) -> SamplingRequest:
            prompt = [rng.randrange(vocab) for _ in range(s.gen_prompt)]
            return SamplingRequest(prompt, n=1, max_tokens=max_tokens, temperature=1.0, ignore_eos=True)

        await engine.generate(request(4))  # warm-up
        reqs = [request(s.gen_tokens) for _ in range(s.gen_batch)]
        started = time.perf_counter()
        results = await asyncio.gather(*(engine.generate(r) for r in reqs))
        took = time.perf_counter() - started
        tokens = sum(len(c.token_ids) for group in results for c in group)
        ctx.row(
            f"generation: {s.gen_batch} sequences x {s.gen_tokens} tokens (prompt {s.gen_prompt})",
            f"{tokens / took:,.0f} tok/s ({took:.2f} s)",
            seconds=took,
            tokens=tokens,
        )

        state: dict[str, torch.Tensor] = {}
        for file in sorted(model_dir.glob("*.safetensors")):
            state.update(load_file(str(file)))
        target = getattr(torch, dtype)
        state = {n: (t.to(target) if t.is_floating_point() else t) for n, t in state.items()}
        publisher = WeightPublisher()
        publisher.publish(1, state)
        del state
        swap_reqs = [request(s.swap_tokens) for _ in range(min(4, s.gen_batch))]
        before = engine.stats().generated_tokens
        tasks = [asyncio.ensure_future(engine.generate(r)) for r in swap_reqs]
        deadline = time.monotonic() + max(5.0, ctx.remaining() - 10)
        while engine.stats().generated_tokens < before + 2 * len(swap_reqs):  # generation under way
            if time.monotonic() > deadline or all(t.done() for t in tasks):
                break
            await asyncio.sleep(0.005)
        loaded = await engine.load_weights(1, publisher.address, timeout_s=max(5.0, ctx.remaining() - 5))
        completions = [c for group in await asyncio.gather(*tasks) for c in group]
        spanning = sum(1 for c in completions if c.versions and c.versions[0] == 0 and c.versions[-1] == 1)
        ordered = all(c.versions == sorted(c.versions) for c in completions)
        status = OK if spanning and ordered else FAIL
        ctx.row(
            "swap mid-generation",
            f"{spanning}/{len(completions)} sequences span versions 0 -> 1 (versions in order: {ordered}); fetch "
            f"{loaded.transfer_s:.3f} s while generating, pause {loaded.pause_s:.3f} s",
            status,
            seconds=loaded.transfer_s + loaded.pause_s,
            transfer_s=loaded.transfer_s,
            pause_s=loaded.pause_s,
        )
        if status == FAIL:
            raise CheckFailed("no sequence spans the swap (or versions out of order)")
    finally:
        await engine.shutdown()
        if publisher is not None:
            publisher.close()
        free_memory(ctx)


# -- check 6 -----------------------------------------------------------------------------------------------------


def check_up(ctx: Ctx) -> None:
    s = ctx.sizes
    init = ctx.workdir / "arithmetic" / "init"
    started = time.perf_counter()
    argv = [ctx.python, str(REPO / "examples/arithmetic/warm_start.py"), "--out", str(init)]
    argv += ["--steps", str(s.warm_start_steps)]
    code = run_child(argv, ctx.workdir / "warm_start.log", timeout_s=max(5.0, min(120.0, ctx.remaining() / 3)))
    took = time.perf_counter() - started
    if code != 0:
        ctx.row("warm start", f"exit {code}: {_tail(ctx.workdir / 'warm_start.log')}", FAIL, seconds=took)
        raise CheckFailed("the arithmetic warm start failed")
    summary = [line for line in _lines(ctx.workdir / "warm_start.log") if "held-out greedy accuracy" in line]
    said = summary[-1].split(" -> ")[0] if summary else "done"
    ctx.row(f"warm start ({s.warm_start_steps} SFT steps)", said, seconds=took)

    run_dir = ctx.workdir / "arithmetic" / "run"
    sets = {
        "base_model": f'"{init / "model"}"',
        "dataset": f'"{init / "train.jsonl"}"',
        "eval_dataset": f'"{init / "eval.jsonl"}"',
        "log_path": f'"{run_dir}"',
        "max_steps": str(s.up_steps),
        "lr_warmup_steps": "1",  # run.toml warms up over 5 steps, more than this short run has
    }
    where = "trainer on cpu, hf engine on cpu"
    if ctx.cuda:
        sets["up.trainer_gpus"] = "[0]"
        where = "trainer on cuda:0 (up.trainer_gpus = [0])"
        if _inference_launcher_has_device():
            sets["up.inference_args"] = '["--device", "cuda"]'
            where += ", hf engine on cuda:0 too"
        else:
            where += ", hf engine on cpu (the inference launcher has no --device)"
    argv = [ctx.python, "-m", "fleetrl", "up", str(REPO / "examples/arithmetic/run.toml")]
    argv += [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
    gpu_peak: list[int] = []
    stop = threading.Event()
    watcher = threading.Thread(target=_watch_gpu_memory, args=(ctx, stop, gpu_peak), daemon=True)
    if ctx.cuda:
        free_memory(ctx)
        watcher.start()
    started = time.perf_counter()
    try:
        code = run_child(argv, ctx.workdir / "up.log", timeout_s=max(5.0, ctx.remaining() - 5), cwd=REPO)
    finally:
        stop.set()
    took = time.perf_counter() - started
    metrics_file = run_dir / "metrics.jsonl"
    lines = [json.loads(x) for x in metrics_file.read_text().splitlines()] if metrics_file.exists() else []
    steps = [m for m in lines if "rollout/raw_reward" in m]
    if code != 0 or len(steps) < s.up_steps:
        tail = _tail(ctx.workdir / "up.log")
        ctx.row(f"fleetrl up ({where})", f"exit {code}, {len(steps)} steps logged: {tail}", FAIL, seconds=took)
        raise CheckFailed(f"fleetrl up failed (exit {code}, {len(steps)}/{s.up_steps} steps)")
    rewards = [round(m["rollout/raw_reward"], 3) for m in steps]
    tps = [m.get("perf/tokens_per_s") for m in steps if m.get("perf/tokens_per_s")]
    fwd_bwd = [m["perf/fwd_bwd_time"] for m in steps if "perf/fwd_bwd_time" in m]
    gpu = ""
    if ctx.cuda:
        gpu = f"; device memory in use during the run: up to {gpu_peak[0] / GIB:.2f} GiB" if gpu_peak else ""
    ctx.row(
        f"fleetrl up, arithmetic, {s.up_steps} steps ({where})",
        f"exit 0 in {took:.1f} s; rewards by step {rewards}; versions {[int(m['version']) for m in steps]}; trainer "
        f"fwd+bwd {sum(fwd_bwd) / max(len(fwd_bwd), 1):.3f} s/step{gpu}",
        seconds=took,
        steps=len(steps),
        rewards=rewards,
        trainer_tokens_per_s=tps,
        gpu_peak_bytes=gpu_peak[0] if gpu_peak else None,
    )


def _watch_gpu_memory(ctx: Ctx, stop: threading.Event, peak: list[int]) -> None:
    """The device's used memory (all processes) while `fleetrl up` runs, minus this process's own."""
    import torch

    free, total = torch.cuda.mem_get_info()
    base = total - free
    best = 0
    while not stop.wait(0.5):
        free, total = torch.cuda.mem_get_info()
        best = max(best, total - free - base)
        peak[:] = [best]


# -- check 7 -----------------------------------------------------------------------------------------------------


def check_adamw_precision(ctx: Ctx) -> None:
    import torch

    from fleetrl.trainer import PolicyTrainer

    model_dir = ensure_model(ctx)
    have_mixed = has_knob("compute_dtype")
    arms = []
    if have_mixed:
        arms.append(("mixed precision (bf16 compute, fp32 master)", {"dtype": "float32", "compute_dtype": "bfloat16"}))
    else:
        arms.append(("fp32 (compute_dtype not built)", {"dtype": "float32"}))
    bf16 = {"dtype": "bfloat16", **({"compute_dtype": "bfloat16"} if have_mixed else {})}
    arms.append(("pure bf16 (bf16 weights and AdamW state)", bf16))
    groups = Groups(ctx.sizes.vocab, ctx.sizes.prompt_tokens)
    fractions = {}
    for label, settings in arms:
        started = time.perf_counter()
        cfg = run_config(model_dir, ctx.workdir / f"run7-{len(fractions)}", grad_clip_norm=None, **settings)
        trainer = PolicyTrainer(cfg, device=ctx.device)
        try:
            before = [p.detach().clone() for p in trainer.model.parameters()]
            metrics = trainer.train_step(groups.make([ctx.sizes.adam_row_tokens])).metrics
            changed = total = 0
            with torch.no_grad():
                for p, old in zip(trainer.model.parameters(), before, strict=True):
                    now = p.detach()
                    now = now.to_local() if hasattr(now, "to_local") else now
                    old = old.to_local() if hasattr(old, "to_local") else old
                    changed += int((now != old).sum())
                    total += now.numel()
            dtype = str(next(trainer.model.parameters()).dtype).removeprefix("torch.")
        finally:
            trainer.close()
            del trainer
            before = []
            free_memory(ctx)
        fractions[label] = changed / total
        ctx.row(
            f"AdamW lr 1e-6, {label}",
            f"{100 * changed / total:.2f}% of {total:,} weights changed (weights {dtype}, grad norm "
            f"{metrics.get('optim/grad_norm', float('nan')):.3g})",
            seconds=time.perf_counter() - started,
            changed=changed,
            total=total,
        )
    first = arms[0][0]
    if fractions[first] < 0.5:
        raise CheckFailed(f"an lr-1e-6 step changed only {100 * fractions[first]:.2f}% of the weights under {first}")


CHECKS: tuple[tuple[int, str, Callable[[Ctx], None]], ...] = (
    (1, "versions, device, imports", check_versions),
    (2, "placement (one-rank torchrun trainer)", check_placement),
    (3, "trainer throughput and memory", check_trainer),
    (4, "weight push", check_weight_push),
    (5, "hf engine", check_hf_engine),
    (6, "fleetrl up end to end (arithmetic)", check_up),
    (7, "AdamW lr 1e-6: mixed precision vs pure bf16", check_adamw_precision),
)


# -- running ------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise CheckTimeout in the main thread after `seconds` (SIGALRM)."""

    def _expired(signum: int, frame: Any) -> None:
        raise CheckTimeout(f"past its {seconds:.0f} s limit")

    previous = signal.signal(signal.SIGALRM, _expired)
    signal.setitimer(signal.ITIMER_REAL, max(0.01, seconds))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def run_checks(
    ctx: Ctx,
    checks: tuple[tuple[int, str, Callable[[Ctx], None]], ...],
    only: set[int] | None,
    *,
    keep_going: bool = False,
) -> bool:
    """Run `checks` in order; stop at the first failure (unless `keep_going`: each check builds what it needs) or when
    the budget is spent. True when none failed."""
    stop_reason = ""
    for number, title, fn in checks:
        if only is not None and number not in only:
            continue
        if stop_reason:
            ctx.report.checks.append(CheckSummary(number, title, NOT_RUN, None, stop_reason))
            continue
        if ctx.remaining() < 3:
            stop_reason = "the time budget is spent"
            ctx.report.checks.append(CheckSummary(number, title, NOT_RUN, None, stop_reason))
            continue
        limit = min(ctx.sizes.limits_s.get(number, 60.0), ctx.remaining())
        print(f"check {number}: {title} (limit {limit:.0f} s)", flush=True)
        ctx.current_check = number
        check_deadline, ctx.deadline = ctx.deadline, time.monotonic() + limit
        started = time.perf_counter()
        status, error = OK, ""
        try:
            with time_limit(limit):
                fn(ctx)
        except CheckTimeout as exc:
            status, error = FAIL, f"timed out: {exc}"
        except CheckFailed as exc:
            status, error = FAIL, str(exc)
        except Exception as exc:
            traceback.print_exc()
            status, error = FAIL, f"{type(exc).__name__}: {exc}"
        finally:
            ctx.deadline = check_deadline
        rows = [r for r in ctx.report.rows if r.check == number]
        if status == OK and any(r.status == FAIL for r in rows):
            status, error = FAIL, "a row failed"
        if status == OK and rows and all(r.status == NOT_BUILT for r in rows):
            status = NOT_BUILT
        ctx.report.checks.append(CheckSummary(number, title, status, round(time.perf_counter() - started, 1), error))
        print(f"check {number}: {status} in {time.perf_counter() - started:.1f} s {error}", flush=True)
        ctx.report.write(ctx.out)
        if status == FAIL and not keep_going:
            stop_reason = f"stopped at the first failure (check {number})"
    ctx.report.write(ctx.out)
    return not ctx.report.failed and not any(c.status == NOT_RUN for c in ctx.report.checks)


def run_child(argv: list[str], log: Path, *, timeout_s: float, cwd: Path | None = None) -> int:
    """Run a child process (its own process group, output to `log`); on timeout or any interruption, SIGTERM the
    group, then SIGKILL what is left after 15 s. Returns its exit code (124 on timeout)."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=cwd, start_new_session=True)
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _stop_group(proc)
            return 124
        except BaseException:
            _stop_group(proc)
            raise


def _stop_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def _lines(path: Path) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return []


def _tail(path: Path, n: int = 12) -> str:
    """The log's last error line first (a table cell is cut at 300 characters), then its last `n` lines."""
    lines = _lines(path)
    errors = [line for line in lines if re.search(r"\w+(Error|Exception)\b|error:|Traceback", line)]
    last = [line for line in errors if not line.startswith("Traceback")][-1:]
    return " / ".join([*(f"last error: {e.strip()}" for e in last), *lines[-n:]])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="folder for gpu_check.json and gpu_check.md (created)")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes (what the test suite runs)")
    parser.add_argument("--budget-s", type=float, help="the whole run's time (default 480 on GPU, 900 dry)")
    parser.add_argument("--only", help="comma-separated check numbers (default all)")
    parser.add_argument(
        "--keep-going",
        action="store_true",
        help="run the later checks after a failure (for a one-shot device session; the default stops at the first)",
    )
    parser.add_argument("--peak-tflops", type=float, help="the chip's dense bf16 peak, for MFU (default by name)")
    parser.add_argument("--workdir", type=Path, help="scratch folder, kept (default a fresh one, removed at the end)")
    parser.add_argument("--worker", choices=["placement", "fetch"], help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is None and args.out is None:
        parser.error("--out DIR is required")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker == "placement":
        return placement_worker(json.loads(args.spec))
    if args.worker == "fetch":
        return fetch_worker(json.loads(args.spec))
    import torch

    dry = args.dry_run
    if not dry and not torch.cuda.is_available():
        print("gpu_check: no CUDA device; use --dry-run for the CPU mode", file=sys.stderr)
        return 2
    sizes = DRY if dry else GPU
    budget = args.budget_s or (900.0 if dry else 480.0)
    only = {int(x) for x in args.only.split(",")} if args.only else None
    peak = args.peak_tflops * 1e12 if args.peak_tflops else None
    if peak is None and not dry:
        name = torch.cuda.get_device_name(0)
        peak = next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="fleetrl-gpu-check-"))
    workdir.mkdir(parents=True, exist_ok=True)
    report = Report("dry-run (CPU, tiny sizes)" if dry else f"GPU ({sizes.name})", budget_s=budget)
    ctx = Ctx(
        dry=dry,
        device="cpu" if dry else "cuda",
        sizes=sizes,
        workdir=workdir,
        out=args.out,
        report=report,
        deadline=time.monotonic() + budget,
        peak_flops=peak,
    )
    print(f"gpu_check: {report.mode}, budget {budget:.0f} s, scratch {workdir}", flush=True)
    try:
        ok = run_checks(ctx, CHECKS, only, keep_going=args.keep_going)
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    print()
    print(f"GPU check ({report.mode}) on {report.device}, {time.time() - report.started:.0f} s in all")
    print(report.table(), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
