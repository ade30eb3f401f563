"""The arithmetic job with a custom loss given to `fleetrl.main` as a Python function.

    python examples/arithmetic/warm_start.py          # the starting policy and the rows, in runs/arithmetic/init
    python examples/custom_loss/train.py [--steps 100] [--log-path runs/custom_loss] [--set KEY=VALUE ...]

`policy_loss=clipped_ratio` is a module-level function, so fleetrl records its import path, `my_losses:clipped_ratio`,
for the trainer process (which imports it from this folder, put on PYTHONPATH below). A lambda or a function defined
inside another function is refused at start, naming `policy_loss`: it cannot cross to the trainer. The same run as
`fleetrl up examples/custom_loss/run.toml`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
# The trainer runs in another process and imports the loss by its module name: let it find this folder too.
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))

from my_losses import clipped_ratio  # noqa: E402 - after the path set-up above

import fleetrl  # noqa: E402
from fleetrl import Config  # noqa: E402

ARITHMETIC = HERE.parent / "arithmetic"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--init", default="runs/arithmetic/init", help="warm_start.py's output folder")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--log-path", default="runs/custom_loss")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="any Config field (JSON value)")
    args = parser.parse_args()
    init = Path(args.init)
    overrides: dict[str, object] = {"max_steps": args.steps, "log_path": args.log_path}
    for item in args.set:
        key, _, value = item.partition("=")
        try:
            overrides[key] = json.loads(value)
        except json.JSONDecodeError:
            overrides[key] = value
    cfg = Config.from_toml(HERE / "run.toml", overrides=overrides)
    cfg = cfg.model_copy(
        update={
            "base_model": str(init / "model"),
            "dataset": str(init / "train.jsonl"),
            "eval_dataset": str(init / "eval.jsonl"),
        }
    )
    summary = fleetrl.main(
        cfg,
        f"{ARITHMETIC / 'rollout.py'}:make_rollout_fn",
        evaluation_fn=f"{ARITHMETIC / 'rollout.py'}:evaluate",
        policy_loss=clipped_ratio,  # a function: fleetrl turns it into "my_losses:clipped_ratio"
        overwrite=True,
    )
    print({k: summary[k] for k in ("exit_code", "steps", "final_version")})
    return int(summary["exit_code"])


if __name__ == "__main__":
    sys.exit(main())
