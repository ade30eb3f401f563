"""Turn-level credit against one final reward on the two-turn task (issue 44; examples/two_turn/two_turn_task.py).

    python bench/turn_credit.py [--seeds 5] [--steps 100] [--json out.json] [--csv curve.csv]

Arms, run one after the other for each seed (same seeds, same prompts per step, same initial policy):
  final       one final reward (1 if both turns are right), advantage_estimator = "grpo"
  summed      the reward is turn 1 right + turn 2 right (the per-turn information, but summed), "grpo"
  per_turn    per-turn rewards [turn 1 right, turn 2 right], "turn_discounted" (gamma 1)

Each step: P = 16 prompts x G = 8 episodes sampled at temperature 1 from the policy, returned as RolloutRuns and put
through the real path's pure parts: the gateway's group assembly (fleetrl.gateway.assembly), the trainer's step batch
(fleetrl.trainer.step_batch: the estimator, and the per-turn split), the datum shift and collate
(fleetrl.trainer.datum) and the loss (fleetrl.losses.policy_loss "grpo", token-mean), then one Adam step (lr 0.02).
The policy is a bigram table (next-token logits from the last token: a causal LM small enough for 2 CPU cores, and
enough for the task, whose answers depend on the last token only). It starts uniform over the K + 2 tokens.

Reported per arm: greedy success over all K prompts at steps 10/25/50/75/100 (mean over seeds), and the first step
whose greedy success is 1.0 (median [min, max] over seeds; "never" past --steps).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "examples" / "two_turn"))
from two_turn_task import VOCAB, K, episode_run, observe, turn1_target, turn2_target  # noqa: E402

from fleetrl.gateway.assembly import assemble_group  # noqa: E402
from fleetrl.losses import policy_loss  # noqa: E402
from fleetrl.trainer.datum import samples_to_batch  # noqa: E402
from fleetrl.trainer.step_batch import build_step_batch  # noqa: E402

ARMS = {"final": ("grpo", "final"), "summed": ("grpo", "summed"), "per_turn": ("turn_discounted", "per_turn")}
P, G = 16, 8


def sample_token(table: torch.Tensor, last: int, gen: torch.Generator) -> tuple[int, float]:
    logprobs = torch.log_softmax(table[last], -1)
    token = int(torch.multinomial(logprobs.exp(), 1, generator=gen))
    return token, float(logprobs[token])


def greedy_success(table: torch.Tensor) -> float:
    right = 0
    for p in range(K):
        a1 = int(table[p].argmax())
        a2 = int(table[observe(p, a1)].argmax())
        right += a1 == turn1_target(p) and a2 == turn2_target(observe(p, a1))
    return right / K


def run_arm(arm: str, seed: int, steps: int) -> list[float]:
    estimator, reward_kind = ARMS[arm]
    table = torch.zeros(VOCAB, VOCAB, requires_grad=True)
    optim = torch.optim.Adam([table], lr=0.02)
    gen = torch.Generator().manual_seed(seed)
    curve = []
    for _step in range(steps):
        groups = []
        with torch.no_grad():
            for row in range(P):
                prompt = int(torch.randint(K, (1,), generator=gen))
                runs = []
                for _ in range(G):
                    a1, lp1 = sample_token(table, prompt, gen)
                    a2, lp2 = sample_token(table, observe(prompt, a1), gen)
                    run = episode_run(prompt, a1, lp1, a2, lp2, per_turn=reward_kind == "per_turn")
                    if reward_kind == "summed":
                        run.reward = run.metrics["turn1_right"] + run.metrics["turn2_right"]
                    runs.append(run)
                groups.append(assemble_group(row, 0, runs, min_samples=2).group)
        batch = build_step_batch(groups, advantage_estimator=estimator, turn_discount=1.0)
        if batch.samples:
            data = samples_to_batch(batch.samples)
            logprobs = torch.log_softmax(table[data.input_tokens_BT], -1)
            logprobs = logprobs.gather(-1, data.target_tokens_BT[..., None])[..., 0]
            loss, _ = policy_loss(
                "grpo",
                logprobs,
                logprobs.detach(),
                data.rollout_logprobs_BT,
                torch.tensor(batch.advantages),
                data.mask_BT,
            )
            optim.zero_grad()
            loss.backward()
            optim.step()
        curve.append(greedy_success(table.detach()))
    return curve


def first_solved(curve: list[float]) -> int | None:
    return next((i + 1 for i, s in enumerate(curve) if s == 1.0), None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--json", type=Path, default=None, help="write every curve here")
    parser.add_argument("--csv", type=Path, default=None, help="write the mean curve per arm here (step, arm...)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    curves: dict[str, list[list[float]]] = {arm: [] for arm in ARMS}
    for seed in range(args.seeds):
        for arm in ARMS:
            torch.manual_seed(seed)
            curves[arm].append(run_arm(arm, seed, args.steps))
            print(f"seed {seed} {arm}: greedy success at the end {curves[arm][-1][-1]:.2f}", flush=True)
    marks = [m for m in (10, 25, 50, 75, 100, 150, 200, 300) if m <= args.steps]
    print(f"\n| arm | {' | '.join(f'step {m}' for m in marks)} | first step at 1.0: median [min, max] |")
    print(f"|---|{'---|' * len(marks)}---|")
    for arm, runs in curves.items():
        means = [statistics.fmean(c[m - 1] for c in runs) for m in marks]
        solved = [first_solved(c) for c in runs]
        done = sorted(s for s in solved if s is not None)
        never = len(solved) - len(done)
        spread = (
            f"{statistics.median(done):.0f} [{done[0]}, {done[-1]}]" if len(done) == len(solved) else f"{never} never"
        )
        print(f"| {arm} | {' | '.join(f'{m:.2f}' for m in means)} | {spread} |")
    if args.json:
        args.json.write_text(json.dumps(curves))
    if args.csv:
        with args.csv.open("w") as fh:
            fh.write("step," + ",".join(ARMS) + "\n")
            for i in range(args.steps):
                row = [statistics.fmean(c[i] for c in curves[arm]) for arm in ARMS]
                fh.write(f"{i + 1}," + ",".join(f"{v:.4f}" for v in row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
