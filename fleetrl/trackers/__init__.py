"""Experiment trackers: the run's per-step metrics, evaluations, config and samples, sent to metrics.jsonl (always)
and to W&B, TensorBoard and MLflow (`[run] loggers`, the `trackers` extra). See docs/trackers.md.

    trackers = make_trackers(cfg, resume=False)    # TrackerError naming the tracker that cannot start
    trackers.log_config(cfg.model_dump(mode="json"))
    trackers.log_metrics(step, line)
    trackers.close()
"""

from fleetrl.trackers.base import Tracker, TrackerError
from fleetrl.trackers.factory import check_trackers_available, make_trackers
from fleetrl.trackers.fanout import TrackerSet
from fleetrl.trackers.names import LOGGER_NAMES

__all__ = ["LOGGER_NAMES", "Tracker", "TrackerError", "TrackerSet", "check_trackers_available", "make_trackers"]
