"""Device memory per trainer rank for 8B, 32B and 70B models on 8, 16 and 32 GPUs, computed from the shapes.

    python bench/memory_table.py            # prints the markdown tables for docs/trainer.md ("Memory per rank")

A rank's peak is the larger of two moments of a step (FSDP2 over W ranks, mixed precision):
- **start of backward** (every activation alive, gradients not yet made): its shard of the float32 master weights
  and of the AdamW moments, (4 + 2 x moment bytes) x params / W; the bfloat16 all-gather of the layer in use and the
  next (FSDP's prefetch) and of the root (embeddings, lm_head); the colocated KL reference's bfloat16 shard
  (2 x params / W, kl_beta > 0); the checkpointed layer inputs, tokens x layers x hidden x C bytes (C = 2 under
  FSDP2's bfloat16 MixedPrecisionPolicy, 4 under autocast at world size 1, whose residual stream stays float32); the
  recomputed layer's intermediates, tokens x (hidden + MLP width) x M bytes; the chunked head, 1,024 positions x
  vocabulary x 4 bytes x 3 buffers;
- **the optimizer step**: weights, gradients and moments, (8 + 2 x moment bytes) x params / W.
`optimizer_state_dtype = "bfloat16"` makes the moments 2 bytes each (12 bytes a parameter in all, not 16);
`fsdp_cpu_offload` moves weights, gradients and moments to the host (the device keeps the gathered layers, the
reference and the activations). M is calibrated on the H100 check's largest micro-batch (a 1.54B model at world
size 1, 16 rows of 4096 tokens: 55.8 GiB peak) and checked against its other measured peak (2 rows of 4096 tokens,
24.3 GiB): `main()` prints both. M comes from the autocast path, which keeps more in float32 than FSDP2's policy, so
the FSDP2 figures lean high. Left out: the CUDA context, allocator fragmentation, NCCL buffers (keep ~10 % spare).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

GIB = 1 << 30
HEAD_CHUNK = 1024


@dataclass(frozen=True)
class Shape:
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    mlp: int
    vocab: int
    tied: bool = False

    def layer_params(self) -> int:
        head_dim = self.hidden // self.heads
        attention = 2 * self.hidden * self.hidden + 2 * self.hidden * self.kv_heads * head_dim
        return attention + 3 * self.hidden * self.mlp + 2 * self.hidden

    def root_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    def params(self) -> int:
        return self.layers * self.layer_params() + self.root_params()


SHAPES = {
    "1.5B (H100 check)": Shape("Qwen2.5-1.5B", 1536, 28, 12, 2, 8960, 151_936, tied=True),
    "8B": Shape("Qwen3-8B", 4096, 36, 32, 8, 12_288, 151_936),
    "32B": Shape("Qwen2.5-32B", 5120, 64, 40, 8, 27_648, 152_064),
    "70B": Shape("Llama-3.1-70B", 8192, 80, 64, 8, 28_672, 128_256),
}
# Measured on one H100 (docs/benchmarks.md, "GPU check"): mixed precision, packed, checkpointing on, world size 1.
MEASURED = {65_536: 55.8, 8_190: 24.3}  # tokens per micro-batch -> peak GiB
CALIBRATION_TOKENS = 65_536


def components(
    shape: Shape,
    world: int,
    tokens: int,
    *,
    transient_bytes: float,
    moment_bytes: int = 4,
    cpu_offload: bool = False,
    reference: bool = True,
    checkpoint_bytes: int = 2,
) -> dict[str, float]:
    """Device bytes per rank at the start of backward, by component, and the optimizer step's (see the docstring)."""
    p = shape.params()
    on_device = 0.0 if cpu_offload else 1.0
    return {
        "weights and moments": on_device * (4 + 2 * moment_bytes) * p / world,
        "gathered": 2 * (2 * shape.layer_params() + shape.root_params()),
        "reference": 2 * p / world if reference else 0.0,
        "checkpointed": tokens * shape.layers * shape.hidden * checkpoint_bytes,
        "recomputed layer": tokens * (shape.hidden + shape.mlp) * transient_bytes,
        "head": HEAD_CHUNK * shape.vocab * 4 * 3,
        "optimizer step": on_device * (8 + 2 * moment_bytes) * p / world,
    }


def peak(parts: dict[str, float]) -> float:
    backward = sum(v for k, v in parts.items() if k != "optimizer step")
    return max(backward, parts["optimizer step"])


H100 = {"world": 1, "reference": False, "checkpoint_bytes": 4}  # the check ran autocast at world size 1, no KL


def calibrate() -> float:
    """M, the recomputed layer's bytes per token and unit of (hidden + MLP width), from the largest micro-batch."""
    shape = SHAPES["1.5B (H100 check)"]
    world = H100["world"]
    base = components(
        shape, world, CALIBRATION_TOKENS, transient_bytes=0.0, **{k: v for k, v in H100.items() if k != "world"}
    )
    backward = sum(v for k, v in base.items() if k != "optimizer step")
    return (MEASURED[CALIBRATION_TOKENS] * GIB - backward) / (CALIBRATION_TOKENS * (shape.hidden + shape.mlp))


def check(transient_bytes: float) -> list[tuple[int, float, float]]:
    """(tokens, predicted GiB, measured GiB) for every measured H100 peak."""
    shape = SHAPES["1.5B (H100 check)"]
    kwargs = {k: v for k, v in H100.items() if k != "world"}
    return [
        (tokens, peak(components(shape, 1, tokens, transient_bytes=transient_bytes, **kwargs)) / GIB, measured)
        for tokens, measured in MEASURED.items()
    ]


OPTIONS = {
    "default (fp32 moments)": {},
    "bf16 moments": {"moment_bytes": 2},
    "bf16 moments + CPU offload": {"moment_bytes": 2, "cpu_offload": True},
}


def table(transient_bytes: float, tokens: int = 16_384) -> str:
    lines = [
        "| model (params) | option | 8 GPUs | 16 GPUs | 32 GPUs | host per rank, offload (8 / 16 / 32) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for key in ("8B", "32B", "70B"):
        shape = SHAPES[key]
        for option, kwargs in OPTIONS.items():
            cells = []
            for world in (8, 16, 32):
                parts = components(shape, world, tokens, transient_bytes=transient_bytes, **kwargs)
                cells.append(f"{peak(parts) / GIB:.1f} GiB")
            host = ""
            if kwargs.get("cpu_offload"):
                per = [(8 + 2 * kwargs["moment_bytes"]) * shape.params() / w / GIB for w in (8, 16, 32)]
                host = " / ".join(f"{h:.0f}" for h in per) + " GiB"
            lines.append(f"| {key} ({shape.params() / 1e9:.1f} B) | {option} | " + " | ".join(cells) + f" | {host} |")
    return "\n".join(lines)


def main() -> int:
    a = calibrate()
    print(f"M = {a:.1f} bytes per token and unit of (hidden + MLP width) in the recomputed layer (calibrated)\n")
    print("| H100 check, 1.54B, world size 1 | predicted | measured |\n| --- | --- | --- |")
    for tokens, predicted, measured in check(a):
        print(f"| {tokens} tokens per micro-batch | {predicted:.1f} GiB | {measured:.1f} GiB |")
    print(f"\nPer rank, micro-batches of 16,384 tokens, kl_beta > 0 (the colocated reference):\n\n{table(a)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
