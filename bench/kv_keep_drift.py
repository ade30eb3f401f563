"""How far kept-KV logprobs are from the new weights' own, by the size of the weight update (no vLLM needed).

Command (from the repository root):

    python bench/kv_keep_drift.py [--model-mb 25] [--context 512] [--after 64]

With ``kv_on_swap = "keep"`` (services/inference/vllm_engine.py) a sequence in flight at a swap keeps the KV the old
weights computed for its context; the tokens after the swap are sampled by the new weights attending to it.
tests/integration/inference/test_vllm_kv_swap.py shows an HF forward with the old weights' cache reproduces vLLM's
logprobs then (within 1e-3). This script uses that forward: a Qwen2-shaped float32 model (fleetrl.tiny_model,
random weights: a trained model's sensitivity differs), a context of ``--context`` tokens, and ``--after`` tokens
after the swap, for new weights w * (1 + r * N(0, 1)) at several relative update sizes r; it reports the largest
and mean |kept-KV logprob - fresh new-weights logprob| over the tokens after the swap, and the same between the old
and the new weights' fresh forwards (how much the update itself moves them).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from swap_pause import model_shape


def logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return logits.float().log_softmax(-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-mb", type=float, default=25.0)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--after", type=int, default=64)
    parser.add_argument("--sizes", default="1e-4,1e-3,1e-2,5e-2")
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    from fleetrl.tiny_model import build_tiny_model

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "m", **model_shape(args.model_mb))
        old = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        new = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    base = {k: v.clone() for k, v in old.state_dict().items()}
    vocab = old.config.vocab_size
    ids = torch.randint(3, vocab, (1, args.context + args.after))
    target = ids[0, args.context :]
    print(f"model {args.model_mb:g} MB, context {args.context}, {args.after} tokens after the swap")
    print("| relative update | kept vs fresh: max | mean | old vs new fresh: max | mean |")
    print("|---|---|---|---|---|")
    with torch.no_grad():
        first = old(ids[:, : args.context], use_cache=True)
        old_fresh = logprobs(old(ids).logits[0, args.context - 1 : -1], target)
        for size in (float(s) for s in args.sizes.split(",")):
            gen = torch.Generator().manual_seed(1)
            new.load_state_dict({k: v * (1 + size * torch.randn(v.shape, generator=gen)) for k, v in base.items()})
            cache = type(first.past_key_values)()  # a fresh cache holding a copy of the old weights' context KV
            for layer in range(len(first.past_key_values.layers)):
                k, v = first.past_key_values.layers[layer].keys, first.past_key_values.layers[layer].values
                cache.update(k.clone(), v.clone(), layer)
            rest = new(ids[:, args.context :], past_key_values=cache)
            last_old = first.logits[0, -1:]
            kept = logprobs(torch.cat([last_old, rest.logits[0, :-1]]), target)[1:]
            fresh = logprobs(new(ids).logits[0, args.context - 1 : -1], target)[1:]
            d = (kept - fresh).abs()
            u = (old_fresh[1:] - fresh).abs()
            print(f"| {size:g} | {d.max():.2e} | {d.mean():.2e} | {u.max():.2e} | {u.mean():.2e} |")


if __name__ == "__main__":
    main()
