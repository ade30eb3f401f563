"""`fleetrl serve controller --heartbeat-interval`: the period of member heartbeats and Status polls is a flag
(tests run fault detection at a shorter period, docs/testing.md); one that does not stay under the heartbeat
timeout is refused naming both fields before anything starts."""

from __future__ import annotations

from services.controller import launcher


def test_a_heartbeat_interval_reaching_the_timeout_is_refused_naming_both(tmp_path, capsys):
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "count 1 to 4:"}\n')
    argv = ["--set", "base_model=tiny", "--rows", str(rows), "--heartbeat-interval", "5", "--heartbeat-timeout", "5"]
    assert launcher.main(argv) == 2
    err = capsys.readouterr().err
    assert "heartbeat_timeout_s (5.0) must exceed heartbeat_interval_s (5.0)" in err


def test_the_flag_is_parsed_as_seconds():
    args = launcher.build_parser().parse_args(["--heartbeat-interval", "0.5"])
    assert args.heartbeat_interval == 0.5
    assert launcher.build_parser().parse_args([]).heartbeat_interval is None  # unset: the config's default (2 s)
