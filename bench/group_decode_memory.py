"""Memory a rollout-group message costs the trainer's receiver: refused by its token vs parsed.

Command (from the repository root):

    python bench/group_decode_memory.py [--mb 32 64 128]

For each size it builds one group of that many MiB (int64 tokens, float logprobs, int mask), encodes it as the
wire frames `[token, RolloutGroup]`, and in a fresh process decodes it with `fleetrl.group_stream.decode_group`
twice over: once with a wrong token (refused before the payload is read) and once with the right one (parsed and
validated). Each process reports its peak RSS (ru_maxrss) above the RSS it had holding the frames, and the time.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time


def child(mb: int, token: str) -> None:
    from fleetrl.group_stream import GroupDecodeError, decode_group, encode_group
    from fleetrl.rollout import RolloutSample
    from fleetrl.rollout_group import RolloutGroup

    tokens_per_sample = 4096
    per_sample_bytes = tokens_per_sample * 8  # ~ varint token, float logprob, mask, version on the wire
    n_samples = max(2, mb * 2**20 // per_sample_bytes)
    samples = [
        RolloutSample(
            tokens=list(range(1000, 1000 + tokens_per_sample)),
            logprobs=[0.0] + [-0.5] * (tokens_per_sample - 1),
            loss_mask=[0] + [1] * (tokens_per_sample - 1),
            reward=1.0,
            versions=[0] * tokens_per_sample,
        )
        for _ in range(n_samples)
    ]
    frames = encode_group(RolloutGroup(1, 0, samples, attempt=1), "the-right-token")
    del samples
    size = sum(len(f) for f in frames)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.perf_counter()
    try:
        decode_group(frames, token)
        outcome = "parsed"
    except GroupDecodeError as exc:
        outcome = exc.reason
    seconds = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(
        json.dumps(
            {"message_mb": size / 2**20, "outcome": outcome, "extra_peak_mb": (peak - base) / 1024, "s": seconds}
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=int, nargs="+", default=[32, 128])
    parser.add_argument("--child", nargs=2, metavar=("MB", "TOKEN"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(int(args.child[0]), args.child[1])
        return
    print("| message | token | outcome | extra peak RSS | seconds |")
    print("| --- | --- | --- | --- | --- |")
    for mb in args.mb:
        for token in ("a-wrong-token", "the-right-token"):
            out = subprocess.run(
                [sys.executable, __file__, "--child", str(mb), token], capture_output=True, text=True, check=True
            )
            r = json.loads(out.stdout.strip().splitlines()[-1])
            print(
                f"| {r['message_mb']:.0f} MiB | {'wrong' if token.startswith('a-') else 'right'} | {r['outcome']} "
                f"| {r['extra_peak_mb']:.0f} MB | {r['s']:.2f} |"
            )


if __name__ == "__main__":
    main()
