"""Standalone mode: train from a JSONL file of recorded groups with no other service running.

    fleetrl serve trainer --config run.toml --standalone groups.jsonl [--resume]

Steps take P groups in file order (the last step may be partial); `max_steps` stops early. Invalid samples
are dropped and counted as on the stream. The data position is the number of groups consumed, so
`--resume` continues where the checkpoint left off. Per-step metrics go to <log_path>/metrics.jsonl (a few
decoded samples every log_samples_interval steps to samples.jsonl, the resolved config to config.json); at the
end, a checkpoint and the HF export (output_dir). No weights are published (nobody is listening).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from fleetrl.rollout_group import read_groups_jsonl, split_valid
from fleetrl.services.trainer.config import TrainerServiceConfig
from fleetrl.trackers.jsonl import JsonlTracker
from fleetrl.trainer import PolicyTrainer

logger = logging.getLogger(__name__)


def run_standalone(config: TrainerServiceConfig, trainer: PolicyTrainer) -> int:
    """Train every step the file and max_steps allow; returns the process exit code."""
    if not trainer.ctx.is_main:
        trainer.follow()
        return 0
    assert config.standalone is not None
    run = config.run
    trainer.weight_sink = None  # nobody to publish to; publish timing still covers the gather
    groups = []
    dropped = 0
    for group in read_groups_jsonl(config.standalone):
        valid = split_valid(group)
        for d in valid.dropped:
            logger.warning("standalone: %s", d.message)
        dropped += len(valid.dropped)
        groups.append(valid)
    logger.info("standalone: %d groups from %s (%d invalid samples dropped)", len(groups), config.standalone, dropped)

    consumed = 0
    if config.resume and trainer.resume():
        position: Any = trainer.state.data_position or {}
        consumed = int(position.get("groups_consumed", 0)) if isinstance(position, dict) else 0
        logger.info("standalone: resumed at version %d, %d groups consumed", trainer.version, consumed)

    # The run folder's own record, as under a controller: metrics.jsonl, samples.jsonl, config.json.
    record = JsonlTracker(Path(run.log_path), Path(run.log_path) / "metrics.jsonl")
    record.log_config(run.model_dump(mode="json"))
    per_step = run.prompt_groups_per_step
    started = time.perf_counter()
    try:
        while consumed < len(groups) and (run.max_steps is None or trainer.steps_done < run.max_steps):
            chunk = groups[consumed : consumed + per_step]
            consumed += len(chunk)
            position = {"groups_consumed": consumed, "groups_file": str(config.standalone)}
            result = trainer.train_step(chunk, data_position=position)
            record.log_metrics(result.step, {**result.metrics, "step": result.step})
            if result.samples:
                record.log_samples(result.step, [s.as_row() for s in result.samples])
        ckpt, export = trainer.finish({"groups_consumed": consumed, "groups_file": str(config.standalone)})
    finally:
        trainer.stop_followers()
        trainer.close()
    logger.info(
        "standalone: %d steps (version %d) in %.1fs; checkpoint %s; HF export %s",
        trainer.steps_done,
        trainer.version,
        time.perf_counter() - started,
        ckpt,
        export,
    )
    return 0
