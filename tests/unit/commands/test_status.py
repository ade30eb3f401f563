"""`fleetrl status`: finding the run from its ready files, numbers kept as numbers, the trainer's version shown."""

from __future__ import annotations

import json
import os
import time

from fleetrl.commands.status import find_runs, main, proto_to_plain, render, trainer_address
from fleetrl.v1 import controller_pb2, trainer_pb2


def ready(folder, name="controller", **info):
    (folder / "ready").mkdir(parents=True, exist_ok=True)
    (folder / "ready" / f"{name}.json").write_text(json.dumps(info))


def test_replies_become_plain_values_with_int64_as_numbers():
    status = controller_pb2.RunStatus(
        run_id="r", version=7, trained_steps=6, max_steps=10, counters={"rows_trained": 12}
    )
    status.members.add(kind=controller_pb2.TRAINER, member_id="trainer", address="127.0.0.1:1", alive=True)
    plain = proto_to_plain(status)
    assert plain["version"] == 7 and plain["counters"] == {"rows_trained": 12} and plain["finished"] is False
    assert plain["members"][0]["kind"] == "TRAINER" and plain["members"][0]["version"] == 0
    trainer = proto_to_plain(trainer_pb2.TrainerStatusResponse(version=8, published_version=-1, last_metrics={"x": 1}))
    assert json.loads(json.dumps(trainer))["version"] == 8  # an int, not "8"


def test_find_runs_in_the_folder_its_children_and_runs_newest_first(tmp_path):
    assert find_runs(tmp_path) == []
    ready(tmp_path / "runs" / "old", grpc_port=1)
    old = tmp_path / "runs" / "old" / "ready" / "controller.json"
    os.utime(old, (time.time() - 100, time.time() - 100))
    ready(tmp_path / "runs" / "new", grpc_port=2)
    assert [p.name for p in find_runs(tmp_path)] == ["new", "old"]
    ready(tmp_path, grpc_port=3)
    assert find_runs(tmp_path)[0] == tmp_path
    assert [p.name for p in find_runs(tmp_path / "runs" / "old")] == ["old"]


def test_trainer_address_from_its_ready_file_else_the_member_list(tmp_path):
    members = {"members": [{"kind": "TRAINER", "address": "10.0.0.2:5"}]}
    assert trainer_address(tmp_path, members) == "10.0.0.2:5"
    ready(tmp_path, "trainer", host="127.0.0.1", grpc_port=4321)
    assert trainer_address(tmp_path, members) == "127.0.0.1:4321"
    assert trainer_address(None, {"members": []}) is None


def test_render_shows_the_trainers_version():
    status = {"run_id": "r1", "version": 4, "trained_steps": 5, "max_steps": 10, "counters": {"rows_trained": 20}}
    status["members"] = [{"kind": "GATEWAY", "member_id": "gateway-0", "alive": True}]
    text = render(status, {"version": 5, "steps_done": 5, "published_version": 4})
    assert text.splitlines()[0] == "run r1: trained steps 5/10, finished False"
    assert "trainer version 5 (steps done 5, published 4); controller's live version 4" in text
    assert "rows: trained 20" in text and "gateway    gateway-0" in text
    assert "trainer: at x:1: UNAVAILABLE" in render(status, None, "at x:1: UNAVAILABLE")


def test_no_run_here_says_where_it_looked(tmp_path, monkeypatch, capsys, free_port):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("fleetrl.commands.status.DEFAULT_ADDRESS", f"127.0.0.1:{free_port}")  # nothing listens there
    assert main([]) == 1
    err = capsys.readouterr().err
    assert f"no run in {tmp_path}" in err and f"controller at 127.0.0.1:{free_port}: UNAVAILABLE" in err
    assert "--log-path" in err
    assert main(["--log-path", str(tmp_path / "nothing")]) == 1
    assert f"no run in {tmp_path / 'nothing'}" in capsys.readouterr().err


def test_a_run_whose_controller_is_gone_is_described_from_its_folder(tmp_path, capsys):
    # Before: "UNAVAILABLE: failed to connect" and exit 1 for a finished run.
    import socket

    with socket.socket() as sock:  # a port nothing listens on: the run's controller has exited
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ready(tmp_path, grpc_port=port, host="127.0.0.1")
    record = {
        "outcome": "finished",
        "error": "",
        "trained_steps": 6,
        "version": 6,
        "final_model": str(tmp_path / "final"),
        "final_eval": {"accuracy": 0.75},
    }
    (tmp_path / "run_end.json").write_text(json.dumps(record))
    assert main(["--log-path", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "finished at step 6, version 6" in out and "accuracy 0.75" in out and str(tmp_path / "final") in out
    record.update(outcome="failed", error="RunFailed: trainer failed step 7", final_model=None)
    (tmp_path / "run_end.json").write_text(json.dumps(record))
    assert main(["--log-path", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "failed at step 6" in out and "trainer failed step 7" in out and "--resume" in out


def test_rows_dropped_as_too_slow_are_reported_at_the_end(tmp_path):
    from fleetrl.up.run import dropped_rows_note

    assert dropped_rows_note(tmp_path) is None
    record = {"outcome": "finished", "trained_steps": 4, "version": 4, "rows_dropped_slow": 3}
    (tmp_path / "run_end.json").write_text(json.dumps(record))
    note = dropped_rows_note(tmp_path)
    assert note.startswith("3 rows dropped as too slow") and "max_head_offpolicy_versions" in note
    assert "3 too slow" in render_ended_text(tmp_path)


def render_ended_text(log_path):
    from fleetrl.commands.status import read_end_record, render_ended

    return render_ended(read_end_record(log_path), log_path)
