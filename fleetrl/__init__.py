"""fleetrl: asynchronous reinforcement learning for language models, built as services.

The user-facing contract:

    from fleetrl import Config, RolloutSample, RolloutSetup, main
"""

from typing import Any

from fleetrl.config import Config, ConfigError
from fleetrl.rollout import InvalidSampleError, RolloutSample, RolloutSetup

__all__ = ["Config", "ConfigError", "InvalidSampleError", "RolloutSample", "RolloutSetup", "main"]


def main(cfg: Config, rollout_fn_factory: Any, rows: Any = None, **options: Any) -> int:
    """Train with every service as a local process (see `fleetrl.up.embedded.main`)."""
    from fleetrl.up.embedded import main as embedded_main

    return embedded_main(cfg, rollout_fn_factory, rows, **options)


__version__ = "0.1.0"
