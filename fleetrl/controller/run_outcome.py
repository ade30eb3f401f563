"""Did a finished run train anything? If not, the message it fails with, built from the controller's counters.

A run that ends with no trained step (every row rejected or failed) or only empty steps must not end as a
success: the trainer would export the untrained base model as the run's final model. What counts as trained: a
step whose batch updated the weights. A step with no trainable group (the trainer reports `train/empty_step`: every
group it was handed had fewer than 2 valid samples, or was refused) advances the version without an update, so it
does not count.

Why rows were rejected comes from the gateways' reports: each rejected row is counted once under its cause,
`rows_rejected_<cause>` (`rejection_cause`), next to the scheduler's `rows_*` counters. Pure logic, no sockets.
"""

from __future__ import annotations

from collections.abc import Mapping

# The gateway's reasons for dropping a sample (fleetrl.gateway.assembly.DROP_REASONS), in the order that breaks a tie.
DROP_CAUSES = ("too_long", "none", "error", "invalid")
FILTERED = "filter"  # the dynamic filter refused the group (e.g. every reward equal)
FEW_SAMPLES = "few_samples"  # too few samples and none of them dropped for a known reason


def rejection_cause(samples_dropped: Mapping[str, int], reason: str = "") -> str:
    """Why a gateway rejected a row, as one word for the `rows_rejected_<cause>` counter: 'filter' when the
    dynamic filter refused its group, else the reason most of its samples were dropped for (too_long, none,
    error, invalid), else 'few_samples'."""
    if reason.startswith("dynamic filter"):
        return FILTERED
    if reason.startswith("group too large"):  # the gateway refused to send it (over the trainer's max_group_mb)
        return "too_large_group"
    counts = {why: n for why, n in samples_dropped.items() if n > 0}
    if not counts:
        return FEW_SAMPLES

    def rank(why: str) -> tuple[int, int]:
        order = DROP_CAUSES.index(why) if why in DROP_CAUSES else len(DROP_CAUSES)
        return counts[why], -order

    return max(counts, key=rank)


def _cause_phrase(cause: str, n: int, max_seq_len: int) -> str:
    phrases = {
        "too_long": f"{n} too long for max_seq_len {max_seq_len}",
        "none": f"{n} with rollouts returning None",
        "error": f"{n} with rollouts raising (see the gateway logs)",
        "invalid": f"{n} with invalid samples (see the gateway logs)",
        FILTERED: f"{n} refused by the dynamic filter",
        FEW_SAMPLES: f"{n} with fewer than 2 valid samples",
    }
    return phrases.get(cause, f"{n} for {cause.replace('_', ' ')}")


def rejected_rows_summary(counters: Mapping[str, int], max_seq_len: int) -> str:
    """'24 too long for max_seq_len 16, 2 refused by the dynamic filter': the rejected rows by cause, most first."""
    causes = {
        key.removeprefix("rows_rejected_"): int(n)
        for key, n in counters.items()
        if key.startswith("rows_rejected_") and n > 0
    }
    parts = [_cause_phrase(cause, n, max_seq_len) for cause, n in sorted(causes.items(), key=lambda kv: -kv[1])]
    unexplained = int(counters.get("rows_rejected", 0)) - sum(causes.values())
    if unexplained > 0:
        parts.append(f"{unexplained} for reasons not recorded")
    return ", ".join(parts)


def untrained_run_message(
    *, steps_trained: int, steps_empty: int, counters: Mapping[str, int], max_seq_len: int
) -> str | None:
    """None when at least one step updated the weights; else why the run trained nothing, e.g.
    'all 24 rows rejected: 24 too long for max_seq_len 16'.

    steps_trained: steps the trainer ran (the version); steps_empty: how many of them had no trainable group;
    counters: the scheduler's counters with the `rows_rejected_<cause>` ones."""
    if steps_trained > steps_empty:
        return None
    if steps_trained > 0:
        return (
            f"no step updated the model: all {steps_trained} steps were empty (no group with 2 trainable samples; "
            "see data/groups_skipped in metrics.jsonl)"
        )
    rejected = int(counters.get("rows_rejected", 0))
    failed = int(counters.get("rows_failed", 0))
    stale = int(counters.get("rows_failed_stale", 0))
    accepted = int(counters.get("rows_accepted", 0))
    closed = rejected + failed + stale
    if int(counters.get("rows_leased", 0)) == 0:
        return "no row was ever leased: the dataset is empty or max_steps leaves no room for a row"
    if accepted == 0 and closed > 0:
        parts = []
        if rejected:
            parts.append(rejected_rows_summary(counters, max_seq_len))
        if failed:
            parts.append(f"{failed} failed on every attempt (rollouts or the group stream failing)")
        if stale:
            parts.append(f"{stale} stale on every attempt (the rollout does not return the sampler's versions?)")
        head = f"all {closed} rows rejected" if closed == rejected else f"none of {closed} rows accepted"
        return f"{head}: {'; '.join(parts)}"
    return f"no step was trained ({accepted} rows accepted, {rejected} rejected, {failed + stale} failed)"
