from fleetrl.controller.run_outcome import rejection_cause, untrained_run_message


def counters(**kw):
    base = {"rows_leased": 0, "rows_accepted": 0, "rows_rejected": 0, "rows_failed": 0, "rows_failed_stale": 0}
    return {**base, **kw}


def test_the_cause_of_a_rejected_row_is_its_most_common_drop_reason():
    assert rejection_cause({"too_long": 4}, "only 0 valid samples (need 2)") == "too_long"
    assert rejection_cause({"none": 3, "error": 1}) == "none"
    assert rejection_cause({"error": 2, "none": 2}) == "none"  # a tie goes to the earlier reason in DROP_CAUSES
    assert rejection_cause({"too_long": 0}, "only 1 valid samples (need 2)") == "few_samples"
    assert rejection_cause({"none": 1}, "dynamic filter") == "filter"


def test_a_run_with_an_update_needs_no_message():
    assert untrained_run_message(steps_trained=3, steps_empty=2, counters=counters(), max_seq_len=16) is None


def test_every_row_rejected_as_too_long():
    c = counters(rows_leased=24, rows_rejected=24, rows_rejected_too_long=24)
    message = untrained_run_message(steps_trained=0, steps_empty=0, counters=c, max_seq_len=16)
    assert message == "all 24 rows rejected: 24 too long for max_seq_len 16"


def test_mixed_causes_most_first_and_failed_rows():
    c = counters(rows_leased=30, rows_rejected=10, rows_rejected_filter=7, rows_rejected_none=2, rows_failed=4)
    message = untrained_run_message(steps_trained=0, steps_empty=0, counters=c, max_seq_len=16)
    assert message == (
        "none of 14 rows accepted: 7 refused by the dynamic filter, 2 with rollouts returning None, "
        "1 for reasons not recorded; 4 failed on every attempt (rollouts or the group stream failing)"
    )


def test_only_empty_steps_trained_nothing():
    c = counters(rows_leased=4, rows_accepted=4)
    message = untrained_run_message(steps_trained=2, steps_empty=2, counters=c, max_seq_len=16)
    assert message is not None and message.startswith("no step updated the model: all 2 steps were empty")


def test_nothing_leased():
    message = untrained_run_message(steps_trained=0, steps_empty=0, counters=counters(), max_seq_len=16)
    assert message is not None and "no row was ever leased" in message
