"""The hf engine's sampling step: a per-row `torch.multinomial` (what the engine did before) vs `sample_tokens`'s
one inverse-CDF pass, interleaved, on the CPU.

    python bench/hf_sampling.py [--rows 32 --vocab 151936 --rounds 7]

Both draw one token per row with that row's own seeded generator from the same log-probabilities. Medians of
`--rounds` rounds; numbers in docs/benchmarks.md ("GPU check", run 1).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from fleetrl.services.inference.sampling import processed_logprobs, sample_tokens


def per_row_multinomial(logprobs_BV: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """The engine's sampling before: one multinomial over the vocabulary per row."""
    pairs = zip(logprobs_BV, generators, strict=True)
    return torch.tensor([int(torch.multinomial(lp.exp(), 1, generator=g)) for lp, g in pairs])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    rows = args.rows
    logits = torch.randn(rows, args.vocab, generator=torch.Generator().manual_seed(0))
    lp = processed_logprobs(logits, torch.ones(rows), torch.zeros(rows, dtype=torch.long), torch.ones(rows))
    greedy = torch.zeros(rows, dtype=torch.bool)
    times: dict[str, list[float]] = {"per-row multinomial (before)": [], "one inverse-CDF pass (now)": []}
    for _ in range(args.rounds):
        for name in times:
            gens = [torch.Generator().manual_seed(i) for i in range(rows)]
            t0 = time.perf_counter()
            if name.startswith("per-row"):
                per_row_multinomial(lp, gens)
            else:
                sample_tokens(lp, greedy, gens)
            times[name].append(time.perf_counter() - t0)
    print(f"{rows} rows x {args.vocab} vocabulary, {torch.get_num_threads()} torch threads, median of {args.rounds}")
    print("| sampling | seconds per step |")
    print("| --- | --- |")
    for name, ts in times.items():
        print(f"| {name} | {statistics.median(ts):.4f} |")


if __name__ == "__main__":
    main()
