"""fleetrl: asynchronous reinforcement learning for language models, built as services.

The user-facing contract:

    from fleetrl import Config, RolloutSample, RolloutSetup
"""

from fleetrl.config import Config, ConfigError
from fleetrl.rollout import InvalidSampleError, RolloutSample, RolloutSetup

__all__ = ["Config", "ConfigError", "InvalidSampleError", "RolloutSample", "RolloutSetup"]
__version__ = "0.1.0"
