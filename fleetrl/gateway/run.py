"""One rollout gateway made and run from its `GatewayConfig`: the tokenizer, the user's code (rollout factory,
dynamic filter, evaluation hook: given as Python objects or loaded from the config's specs) and the model's
vocabulary bound.

    gateway = build_gateway(config)                      # raises UserCodeError when the user's code cannot load
    code = await run_gateway(config, make_rollout_fn)    # build and run: 0 finished, 3 breaker open, 4 user code

`fleetrl serve gateway` (services/gateway) builds one and serves it under the service shell (/metrics, ready file,
signals); `fleetrl.main()`'s in-process gateways (fleetrl.up.inprocess_gateway) call `run_gateway` with the user's
objects.
"""

from __future__ import annotations

import logging
from typing import Any

from fleetrl.config import Config
from fleetrl.exit_codes import EXIT_USER_CODE
from fleetrl.gateway.config import GatewayConfig
from fleetrl.gateway.dynamic_filter import DynamicFilter, load_dynamic_filter
from fleetrl.gateway.worker import Gateway
from fleetrl.rollout import RolloutFnFactory

log = logging.getLogger(__name__)


class UserCodeError(RuntimeError):
    """The user's rollout factory, dynamic filter or evaluation hook cannot be loaded: deterministic, so restarting
    the gateway cannot fix it (exit code EXIT_USER_CODE)."""


def model_vocab_size(run_cfg: Config, tokenizer: Any) -> int | None:
    """The policy's embedding rows (config.json's vocab_size; the tokenizer's length if there is no config): the
    bound every sample's token ids must stay under."""
    from fleetrl.tokenizer_load import config_vocab_size

    try:
        return config_vocab_size(run_cfg.base_model)
    except (OSError, ValueError, AttributeError, TypeError) as exc:
        log.warning("no model config at %s (%s); token ids are checked against the tokenizer", run_cfg.base_model, exc)
        return len(tokenizer) if tokenizer is not None else None


def build_gateway(
    config: GatewayConfig,
    factory: RolloutFnFactory | None = None,
    tokenizer: Any = None,
    *,
    dynamic_filter: DynamicFilter | None = None,
    evaluation_fn: Any = None,
) -> Gateway:
    """A `Gateway` ready to run; what is not given is loaded from the config (the tokenizer from the run's model).
    Raises `UserCodeError` when the user's code cannot be loaded."""
    from fleetrl.user_code import load_object

    run_cfg = config.run
    if tokenizer is None:
        from fleetrl.model_path import check_model_path
        from fleetrl.tokenizer_load import load_tokenizer

        check_model_path(run_cfg.tokenizer_model or run_cfg.base_model)
        tokenizer = load_tokenizer(run_cfg.tokenizer_model or run_cfg.base_model)
    try:
        factory = factory or load_object(config.rollout)
        if evaluation_fn is None and config.evaluation:
            evaluation_fn = load_object(config.evaluation)
        if dynamic_filter is None:
            dynamic_filter = load_dynamic_filter(config.dynamic_filter)
    except Exception as exc:
        raise UserCodeError(f"cannot load the user's code: {type(exc).__name__}: {exc}") from exc
    return Gateway(config, factory, tokenizer, dynamic_filter, evaluation_fn, model_vocab_size(run_cfg, tokenizer))


async def run_gateway(
    config: GatewayConfig,
    factory: RolloutFnFactory | None = None,
    tokenizer: Any = None,
    *,
    dynamic_filter: DynamicFilter | None = None,
    evaluation_fn: Any = None,
) -> int:
    """Build one gateway (`build_gateway`) and run it until the run is finished; its exit code (EXIT_USER_CODE when
    the user's code cannot be loaded). Serves no /metrics and writes no ready file: the service does that."""
    try:
        gateway = build_gateway(config, factory, tokenizer, dynamic_filter=dynamic_filter, evaluation_fn=evaluation_fn)
    except UserCodeError as exc:
        log.error("%s", exc)
        return EXIT_USER_CODE
    return await gateway.run()
