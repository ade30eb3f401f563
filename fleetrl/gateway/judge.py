"""The judge pool as the rollout reaches it: `attach_judge(setup, config, tokenizer)` puts on the `RolloutSetup` a
`Sampler` over the judge replicas (`setup.judge_sampler`, the cookbook interface the policy's sampler has), the first
replica's OpenAI base URL (`setup.judge_base_url`), the judge's model name and the key its HTTP API takes.

The judge replicas are inference replicas of another model that `fleetrl up` starts beside the policy's ([up]
judge_model): frozen, never told to the controller, so never sent weights and never fenced or re-listed; the
sampler's list is the fixed one from the gateway's `--judge` flags.

    async def rollout_fn(row):
        ...
        verdict = await setup.judge_sampler.sample_with_tokens(messages=[...], n=1, max_tokens=8, temperature=0.0)
"""

from __future__ import annotations

from typing import Any

from fleetrl.gateway.config import GatewayConfig
from fleetrl.rollout import RolloutSetup
from fleetrl.sampler import Sampler


def attach_judge(setup: RolloutSetup, config: GatewayConfig, tokenizer: Any) -> Sampler | None:
    """Fill `setup`'s judge fields from `config` (`tokenizer`: the judge's, for chat messages); returns the judge
    sampler (the caller closes it), or None when the gateway was given no judge."""
    if not config.judge:
        return None
    sampler = Sampler(
        tokenizer,
        auth_token=config.auth_token,
        request_timeout_s=config.generate_timeout_s,
        replica_wait_s=config.replica_wait_s,
    )
    sampler.set_replicas(list(config.judge))
    setup.judge_sampler = sampler
    setup.judge_base_url = config.judge_base_url
    setup.judge_model = config.judge_model
    setup.judge_api_key = config.auth_token
    return sampler


def load_judge_tokenizer(config: GatewayConfig, fallback: Any) -> Any:
    """The judge model's tokenizer (`judge_model`), or `fallback` (the run's) when no judge model is named."""
    if not config.judge or not config.judge_model:
        return fallback
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(config.judge_model)
