"""The rollout of examples/verifiers_reverse: fleetrl's verifiers adapter, with this folder (and so the
`reverse_text` environment) on the import path, as fleetrl puts a rollout file's folder there.

    fleetrl up examples/verifiers_reverse/run.toml

`rollout_extras.environment` names the environment; an environment installed as a package needs no file of its own:
`[up] rollout = "fleetrl.environments:make_rollout_fn"`.
"""

from fleetrl.environments import make_rollout_fn

__all__ = ["make_rollout_fn"]
