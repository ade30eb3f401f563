"""The services table and the startup lines `fleetrl up` prints (plain text when stdout is not a terminal)."""

from __future__ import annotations

import io
from pathlib import Path
from types import SimpleNamespace

from fleetrl.up.console import Startup, print_services, service_rows
from fleetrl.up.supervisor import Child


def child(name: str, kind: str, pid: int, info: dict) -> Child:
    log = Path("/runs/x") / f"{name}.log"
    return Child(name, kind, [], log, SimpleNamespace(pid=pid), info=info)  # type: ignore[arg-type]


CHILDREN = [
    child("inference-0", "inference", 11, {"host": "127.0.0.1", "grpc_port": 40001, "metrics_port": 40002}),
    child("trainer", "trainer", 12, {"host": "127.0.0.1", "grpc_port": 40003}),
    child("controller", "controller", 13, {"address": "127.0.0.1:40005", "grpc_port": 40005, "metrics_port": 40006}),
    child("gateway-0", "gateway", 14, {}),
]


def test_rows_name_each_service_its_addresses_and_log():
    rows = service_rows(CHILDREN)
    assert rows[0] == ("inference-0", "11", "127.0.0.1:40001", "40002", "/runs/x/inference-0.log")
    assert rows[1][2:4] == ("127.0.0.1:40003", "-")
    assert rows[2][2:4] == ("127.0.0.1:40005", "40006")
    assert rows[3] == ("gateway-0", "14", "-", "-", "/runs/x/gateway-0.log")  # no ready file: nothing to show


def test_the_table_prints_every_service_on_its_own_row_without_colour_codes():
    out = io.StringIO()
    print_services(CHILDREN, out)
    text = out.getvalue()
    assert "fleetrl up: services" in text and "\x1b[" not in text
    for name, pid, address, _metrics, log in service_rows(CHILDREN):
        (line,) = [row for row in text.splitlines() if f" {name} " in row]
        assert pid in line and address in line and log in line


def test_startup_says_what_it_waits_for_one_line_each_off_a_terminal():
    out = io.StringIO()
    with Startup(2, out) as startup:
        startup.waiting("trainer")
        startup.ready(CHILDREN[1])
    assert out.getvalue().splitlines() == [
        "fleetrl up: waiting for trainer to start",
        "fleetrl up: trainer ready (log: /runs/x/trainer.log)",
    ]


def test_the_controllers_liveness_warnings_are_followed_in_its_log(tmp_path):
    """`fleetrl up` copies the controller's liveness warnings (a trainer silent inside a TrainStep) to its console:
    the lines as the controller's logging writes them, only those, only new ones, only whole ones."""
    import logging

    from fleetrl.controller import liveness
    from fleetrl.telemetry import LOG_FORMAT
    from fleetrl.up.console import LogFollower

    path = tmp_path / "controller.log"
    path.write_text("2026-11-29 06:00:00,000 WARNING fleetrl.controller.liveness: an old run's warning\n")
    follower = LogFollower(path)  # made as the run starts: what the log held before is not shown
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter(LOG_FORMAT))  # the controller's format (fleetrl.telemetry.setup_logging)
    for name in ("fleetrl.controller.liveness", "fleetrl.services.controller.orchestrator"):
        logging.getLogger(name).addHandler(handler)
    try:
        liveness.log.warning("TrainStep(step 3) to the trainer at t:1: no reply after 12 s")
        logging.getLogger("fleetrl.services.controller.orchestrator").warning("something else")
        liveness.log.info("not a warning")
    finally:
        for name in ("fleetrl.controller.liveness", "fleetrl.services.controller.orchestrator"):
            logging.getLogger(name).removeHandler(handler)
        handler.close()
    assert follower.new_lines() == ["TrainStep(step 3) to the trainer at t:1: no reply after 12 s"]
    assert follower.new_lines() == []
    with open(path, "a") as fh:
        fh.write("2026-11-29 06:00:09,000 WARNING fleetrl.controller.liveness: half a li")
    assert follower.new_lines() == []  # written in part: shown once whole
    with open(path, "a") as fh:
        fh.write("ne\n")
    assert follower.new_lines() == ["half a line"]
