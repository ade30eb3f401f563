"""fleetrl: asynchronous reinforcement learning for language models, built as services.

The user-facing contract:

    from fleetrl import Config, RolloutSample, RolloutSetup, main
    from fleetrl import RolloutRun, RolloutSegment, build_deployment_sampler   # the current cookbook's names
    from fleetrl import DeployConfig, TrainerConfig, WandBConfig               # the cookbook's config objects
    from fleetrl import MessageTrajectoryAssembler, TITOTokenizer             # message-in multi-turn rollouts
"""

from typing import Any

from fleetrl import moved_modules
from fleetrl.config import Config, ConfigError
from fleetrl.cookbook import DeployConfig, TrainerConfig, WandBConfig
from fleetrl.message_trajectory import MessageTrajectoryAssembler, TITOTokenizer
from fleetrl.rollout import InvalidSampleError, RolloutRun, RolloutSample, RolloutSegment, RolloutSetup

moved_modules.install()  # modules that moved into their role's package keep their old import paths

__all__ = [
    "Config",
    "ConfigError",
    "DeployConfig",
    "InvalidSampleError",
    "MessageTrajectoryAssembler",
    "RolloutRun",
    "RolloutSample",
    "RolloutSegment",
    "RolloutSetup",
    "TITOTokenizer",
    "TrainerConfig",
    "WandBConfig",
    "build_deployment_sampler",
    "main",
]


def build_deployment_sampler(setup: RolloutSetup) -> Any:
    """The sampler of the run's inference deployment: `setup.sampler` (the cookbook's rollout code calls
    `sampler = build_deployment_sampler(setup)`; fleetrl's gateway has already built it)."""
    if getattr(setup, "sampler", None) is None:
        raise RuntimeError(
            "build_deployment_sampler: this RolloutSetup has no sampler; it is filled by the rollout gateway "
            "(fleetrl up / fleetrl.main), so call it inside your rollout factory"
        )
    return setup.sampler


def main(cfg: Config, rollout_fn_factory: Any, rows: Any = None, **options: Any) -> dict[str, Any]:
    """Train with the rollout gateways in this process (any callable works as the factory, `dynamic_filter_fn`
    or `evaluation_fn`) and the other services as local processes; returns a summary dict (`exit_code`, `steps`,
    `final_version`, `last_metrics`, paths: see `fleetrl.up.embedded.main`)."""
    from fleetrl.up.embedded import main as embedded_main

    return embedded_main(cfg, rollout_fn_factory, rows, **options)


__version__ = "0.1.0"
