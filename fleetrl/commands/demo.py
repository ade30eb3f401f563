"""`fleetrl demo`: the foundation's pure logic learning a toy task, with no services and no model download.

    fleetrl demo [--steps 30] [--loss grpo] [--offpolicy 1] [--seed 0]

A "policy" of independent softmax logits over a 16-token vocabulary for 4 completion positions must learn a
hidden target sequence (reward = fraction of positions right). Everything else is the real library: rollouts
are `RolloutSample`s that are validated, the off-policy gate admits rows against a policy version (rows are
sampled with the weights of their `submit_version`, so O > 0 trains on stale samples), group advantages,
the one-position datum shift and padding, and `policy_loss` with TIS correcting for the stale sampler.
"""

from __future__ import annotations

import argparse
import random
from collections import deque

import torch

from fleetrl.config import Config
from fleetrl.controller.gate import OffPolicyGate
from fleetrl.losses import policy_loss
from fleetrl.rollout import RolloutSample
from fleetrl.trainer.advantages import group_advantages
from fleetrl.trainer.datum import samples_to_batch

VOCAB, LENGTH, PROMPT = 16, 4, [1, 2]


def _sample_row(logits_LV: torch.Tensor, target: list[int], group: int, version: int, gen):
    """G rollouts from a frozen copy of the policy (the sampler), scored against the target."""
    probs_LV = torch.softmax(logits_LV, dim=-1)
    samples = []
    for _ in range(group):
        completion = torch.multinomial(probs_LV, 1, generator=gen).squeeze(-1)
        logprobs = torch.log(probs_LV.gather(-1, completion[:, None]).squeeze(-1))
        reward = float((completion == torch.tensor(target)).float().mean())
        samples.append(
            RolloutSample(
                tokens=PROMPT + completion.tolist(),
                logprobs=[0.0] * len(PROMPT) + logprobs.tolist(),
                loss_mask=[0] * len(PROMPT) + [1] * LENGTH,
                reward=reward,
                versions=[version] * (len(PROMPT) + LENGTH),
            ).validate()
        )
    return samples


def _train_logprobs(logits_LV: torch.Tensor, batch) -> torch.Tensor:
    """Target-aligned logprobs [B, T]: position t predicts token t+1; completion slots map to rows."""
    logprobs_LV = torch.log_softmax(logits_LV, dim=-1)
    b, t = batch.target_tokens_BT.shape
    out = torch.zeros(b, t)
    offset = len(PROMPT) - 1  # first target that is a completion token
    for j in range(LENGTH):
        out[:, offset + j] = logprobs_LV[j].gather(0, batch.target_tokens_BT[:, offset + j])
    return out


def run(steps: int, loss: str, offpolicy: int, seed: int) -> list[float]:
    fields = {"policy_loss": loss, "max_head_offpolicy_versions": offpolicy, "seed": seed, "kl_beta": 0.0}
    # ConfigError (one line per bad field) for e.g. --loss bogus: `fleetrl` prints it without a traceback.
    cfg = Config.load({**fields, "completions_per_prompt": 8, "prompt_groups_per_step": 4}, "fleetrl demo")
    torch.manual_seed(seed)
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    target = [rng.randrange(VOCAB) for _ in range(LENGTH)]
    logits = torch.zeros(LENGTH, VOCAB, requires_grad=True)
    optim = torch.optim.Adam([logits], lr=0.1)
    gate = OffPolicyGate(cfg.prompt_groups_per_step, cfg.completions_per_prompt, cfg.max_head_offpolicy_versions)
    snapshots = {0: logits.detach().clone()}
    queue: deque = deque()
    rewards_per_step = []
    for step in range(1, steps + 1):
        # Producers fill every slot the gate allows, sampling with the weights of the submit version.
        while (row := gate.try_admit()) is not None:
            queue.append(
                (
                    row,
                    _sample_row(
                        snapshots[row.submit_version],
                        target,
                        cfg.completions_per_prompt,
                        row.submit_version,
                        gen,
                    ),
                )
            )
        groups = [queue.popleft() for _ in range(cfg.prompt_groups_per_step)]
        samples, advantages, offsets = [], [], []
        for row, group in groups:
            gate.resolve(row.row_id, accepted=True)
            advantages += group_advantages([s.reward for s in group], cfg.advantage_mode)
            samples += group
            offsets.append(gate.version - row.submit_version)
        batch = samples_to_batch(samples)
        logprobs = _train_logprobs(logits, batch)
        loss_value, metrics = policy_loss(
            cfg.policy_loss,
            logprobs,
            logprobs.detach(),
            batch.rollout_logprobs_BT,
            torch.tensor(advantages),
            batch.mask_BT,
            cfg=cfg,
        )
        optim.zero_grad()
        loss_value.backward()
        optim.step()
        snapshots[gate.publish()] = logits.detach().clone()
        mean_reward = sum(s.reward for s in samples) / len(samples)
        rewards_per_step.append(mean_reward)
        print(
            f"step {step:3d}  reward {mean_reward:.3f}  version_offset_max {max(offsets)}  "
            f"tis_weight_mean {metrics['tis_weight_mean']:.3f}  clip_frac {metrics['clip_frac']:.3f}"
        )
    return rewards_per_step


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fleetrl demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps")
    parser.add_argument("--loss", default="grpo", help="policy_loss name")
    parser.add_argument("--offpolicy", type=int, default=1, help="max_head_offpolicy_versions (O)")
    parser.add_argument("--seed", type=int, default=0, help="seed")
    args = parser.parse_args(argv)
    rewards = run(args.steps, args.loss, args.offpolicy, args.seed)
    k = min(5, len(rewards))
    first, last = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
    print(f"mean reward: first {k} steps {first:.3f} -> last {k} steps {last:.3f}")
    return 0
