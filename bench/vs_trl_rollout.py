"""The tool-bound rollout of bench/vs_trl.py: the arithmetic example's rollout, then an awaited tool call.

`[up] rollout = "bench/vs_trl_rollout.py:make_tool_rollout_fn"` with `rollout_extras = {tool_latency_s = 0.2}`:
each completion is sampled and scored exactly as examples/arithmetic/rollout.py does, then awaits
`tool_latency_s` seconds (a simulated tool call, as TRL's async reward does in the TRL arm).
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from fleetrl import RolloutSample, RolloutSetup

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "arithmetic"))
from rollout import make_rollout_fn


def make_tool_rollout_fn(setup: RolloutSetup):
    """The example's rollout followed by a `tool_latency_s` (default 0.2 s) awaited call."""
    inner = make_rollout_fn(setup)
    latency = float(setup.extras.get("tool_latency_s", 0.2))

    async def rollout_fn(row: dict) -> RolloutSample | None:
        sample = await inner(row)
        await asyncio.sleep(latency)
        return sample

    return rollout_fn
