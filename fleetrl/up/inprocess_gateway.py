"""`fleetrl.main()`'s rollout gateways, run in the calling process so any Python callable works as the rollout
factory, dynamic filter or evaluation hook (lambdas, closures, notebook and `__main__` functions).

Each gateway is the same `Gateway` as `fleetrl serve gateway` (fleetrl.gateway.run.run_gateway), with the same gRPC
calls to the controller and ZeroMQ group stream to the trainer, run as an asyncio task on its own event loop in a
daemon thread beside the user's code. To `fleetrl up`'s watch loop it looks like a gateway process: `poll()` gives its
exit code once it ended (0 run finished, 3 circuit breaker open, 4 the user's code cannot run or a rollout returned an
unknown type, 1 a crash, its traceback in the log), and a crashed one is replaced by a fresh task
(`max_gateway_restarts`). Its log lines go to `<log_path>/gateway.log`. No /metrics endpoint is served.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fleetrl.gateway.config import GatewayConfig

log = logging.getLogger(__name__)
LOG_FORMAT = "%(asctime)s %(levelname)s [%(threadName)s] %(name)s: %(message)s"


class UserObjects:
    """The Python objects `main()` was given; None where the config names them (module:attr, 'uniform')."""

    def __init__(self, rollout_factory: Any, dynamic_filter: Any = None, evaluation_fn: Any = None) -> None:
        self.rollout_factory = rollout_factory
        self.dynamic_filter = dynamic_filter
        self.evaluation_fn = evaluation_fn


class InProcessGateway:
    """One gateway run on an event loop in a daemon thread; `poll()`/`stop()` as a gateway process would have."""

    kind = "gateway"

    def __init__(self, name: str, config: GatewayConfig, objects: UserObjects, log_path: Path) -> None:
        self.name = name
        self.config = config
        self.objects = objects
        self.log_path = log_path
        self.argv: list[str] = []  # no process to start again: `restarted()` makes a new task
        self._code: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[int] | None = None
        self._stopping = False
        self._thread = threading.Thread(target=self._thread_main, name=name, daemon=True)

    @property
    def pid(self) -> int:
        return os.getpid()

    def start(self) -> InProcessGateway:
        self._thread.start()
        return self

    def poll(self) -> int | None:
        return None if self._thread.is_alive() or self._code is None else self._code

    def restarted(self, name: str) -> InProcessGateway:
        """A fresh gateway in this one's role (same config and objects, its own gateway id), started."""
        gateway_id = f"{self.config.gateway_id}-{name}"
        config = self.config.model_copy(update={"gateway_id": gateway_id})
        return InProcessGateway(name, config, self.objects, self.log_path).start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Cancel the gateway's task (its rows in flight are dropped; the controller leases them again) and wait."""
        self._stopping = True
        loop, task = self._loop, self._task
        if loop is not None and task is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: the gateway has ended
                loop.call_soon_threadsafe(task.cancel)
        self._thread.join(timeout_s)

    def _thread_main(self) -> None:
        try:
            self._code = asyncio.run(self._serve())
        except asyncio.CancelledError:
            self._code = 0  # stopped by `stop()`
        except BaseException:  # a crash: as a gateway process's, logged with its traceback and exit code 1
            logging.getLogger("fleetrl.gateway").exception("gateway %s crashed", self.name)
            self._code = 1

    async def _serve(self) -> int:
        from fleetrl.gateway.run import run_gateway

        self._loop = asyncio.get_running_loop()
        self._task = asyncio.current_task()  # type: ignore[assignment]
        if self._stopping:
            return 0
        return await run_gateway(
            self.config,
            self.objects.rollout_factory,
            dynamic_filter=self.objects.dynamic_filter,
            evaluation_fn=self.objects.evaluation_fn,
        )


def gateway_log_handler(log_path: Path) -> logging.Handler:
    """Send the library's log lines (the gateways' among them) to `log_path`; remove it with `remove_log_handler`."""
    handler = logging.FileHandler(log_path, encoding="utf-8")
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    handler.setLevel(logging.INFO)
    logger = logging.getLogger("fleetrl")
    logger.addHandler(handler)
    handler.previous_level = logger.level  # type: ignore[attr-defined]
    if logger.level == logging.NOTSET or logger.level > logging.INFO:
        logger.setLevel(logging.INFO)
    return handler


def remove_log_handler(handler: logging.Handler) -> None:
    """Detach `handler` and give the library's logger back the level it had before `gateway_log_handler`."""
    logger = logging.getLogger("fleetrl")
    logger.removeHandler(handler)
    logger.setLevel(getattr(handler, "previous_level", logger.level))
    handler.close()


def start_gateways(
    gateway_argv: list[str],
    count: int,
    evaluation: str | None,
    objects: UserObjects,
    log_dir: Path,
    auth_token: str | None,
) -> list[InProcessGateway]:
    """Start `count` gateways configured by `fleetrl serve gateway` flags; gateway-0 evaluates when `evaluation` (a
    module:fn spec, or a label when `objects.evaluation_fn` is the hook) is set."""
    from fleetrl.gateway.flags import build_parser, config_from_args

    parser = build_parser()
    config = config_from_args(parser.parse_args(gateway_argv))
    base_id = config.gateway_id or f"gateway-{os.uname().nodename}-{os.getpid()}"
    log_path = log_dir / "gateway.log"
    gateways = []
    for i in range(count):
        update: dict[str, Any] = {"gateway_id": f"{base_id}-{i}", "metrics_port": None, "ready_file": None}
        if auth_token is not None:
            update["auth_token"] = auth_token
        update["evaluation"] = evaluation if i == 0 else None
        member_objects = objects if i == 0 else UserObjects(objects.rollout_factory, objects.dynamic_filter)
        gateway = InProcessGateway(f"gateway-{i}", config.model_copy(update=update), member_objects, log_path)
        gateways.append(gateway.start())
    return gateways
