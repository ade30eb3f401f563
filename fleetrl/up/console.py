"""What `fleetrl up` prints before training: services starting (a spinner on a terminal, a line each elsewhere),
then a table of the services it runs, where they listen and where their logs are."""

from __future__ import annotations

import sys
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
