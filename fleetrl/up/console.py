"""What `fleetrl up` prints before training: services starting (a spinner on a terminal, a line each elsewhere),
then a table of the services it runs, where they listen and where their logs are; while it trains, the controller's
liveness warnings (a peer silent inside a call: fleetrl.controller.liveness) copied from controller.log."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from fleetrl.up.supervisor import Child


def service_rows(children: list[Child]) -> list[tuple[str, str, str, str, str]]:
    """(service, pid, gRPC address, metrics port, log) per child; '-' where a service reports none."""
    rows = []
    for c in children:
        info = c.info or {}
        address = info.get("address") or (
            f"{info.get('host', '127.0.0.1')}:{info['grpc_port']}" if info.get("grpc_port") else "-"
        )
        metrics = info.get("metrics_port")
        rows.append((c.name, str(c.pid), address, str(metrics) if metrics else "-", str(c.log_path)))
    return rows


def print_services(children: list[Child], stream: Any = None) -> None:
    """The services table (rich; plain text when `stream` is not a terminal)."""
    from rich.console import Console
    from rich.table import Table

    stream = stream or sys.stdout
    table = Table(title="fleetrl up: services", title_justify="left")
    for column in ("service", "pid", "gRPC", "metrics port", "log"):
        table.add_column(column, overflow="fold")
    for row in service_rows(children):
        table.add_row(*row)
    tty = bool(getattr(stream, "isatty", lambda: False)())
    Console(file=stream, width=None if tty else 200, no_color=not tty).print(table)


class Startup:
    """Says which service `fleetrl up` is waiting for: a rich spinner on a terminal, a line per service elsewhere.
    Use as a context manager; `waiting(name)` before each wait, `ready(child)` after it."""

    def __init__(self, total: int, stream: Any = None, prefix: str = "fleetrl up") -> None:
        self.stream = stream or sys.stdout
        self.prefix = prefix
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.total = total
        self._bar: Any = None
        self._task: Any = None

    def __enter__(self) -> Startup:
        if self.tty:
            from rich.console import Console
            from rich.progress import MofNCompleteColumn, SpinnerColumn, TextColumn, TimeElapsedColumn
            from rich.progress import Progress as RichProgress

            self._bar = RichProgress(
                SpinnerColumn(),
                TextColumn("{task.description}"),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                console=Console(file=self.stream),
                transient=True,
            )
            self._task = self._bar.add_task("starting services", total=self.total)
            self._bar.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._bar is not None:
            self._bar.stop()

    def waiting(self, name: str) -> None:
        if self._bar is not None:
            self._bar.update(self._task, description=f"starting services: waiting for {name}")
        else:
            self.stream.write(f"{self.prefix}: waiting for {name} to start\n")
            self.stream.flush()

    def ready(self, child: Child) -> None:
        if self._bar is not None:
            self._bar.advance(self._task)
        else:
            self.stream.write(f"{self.prefix}: {child.name} ready (log: {child.log_path})\n")
            self.stream.flush()


LIVENESS_MARKER = " WARNING fleetrl.controller.liveness: "
"""How a liveness warning's line reads in controller.log (fleetrl.telemetry's format: time, level, logger)."""


class LogFollower:
    """The lines appended to a service's log since the last call that contain `marker` (what follows the marker),
    read from where the log ended when the follower was made; a log replaced or cut back is read from its start."""

    def __init__(self, path: Path, marker: str = LIVENESS_MARKER) -> None:
        self.path = path
        self.marker = marker
        try:
            stat = path.stat()
            self.offset, self.inode = stat.st_size, stat.st_ino
        except FileNotFoundError:
            self.offset, self.inode = 0, None

    def new_lines(self) -> list[str]:
        try:
            stat = self.path.stat()
        except FileNotFoundError:
            return []
        if stat.st_ino != self.inode or stat.st_size < self.offset:
            self.offset, self.inode = 0, stat.st_ino
        with open(self.path, "rb") as fh:
            fh.seek(self.offset)
            chunk = fh.read()
        complete, _, _ = chunk.rpartition(b"\n")
        if not complete:
            return []
        self.offset += len(complete) + 1
        lines = complete.decode("utf-8", errors="replace").splitlines()
        return [line.split(self.marker, 1)[1] for line in lines if self.marker in line]
