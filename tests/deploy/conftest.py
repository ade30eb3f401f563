"""Fixtures for the deployment checks: the tools CI installs, and one run of the compose stack shared by the
smoke, metrics-docs and Prometheus tests (a stack costs ~25 s on 2 cores; one run serves them all)."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.deploy.from_compose import compose_services, prometheus_config
from tests.deploy.localstack import REPO, LocalService, LocalStack, StackError

COMPOSE_FILE = REPO / "docker-compose.yml"
METRICS_PORTS = {"controller": 9401, "inference": 9400, "reference": 9402, "trainer": 9403, "gateway": 9404}
TOKEN = "compose-smoke-token"
COMPOSE_STEPS = 3


def need_tool(name: str) -> str:
    """The tool's path; skips (CI installs it: docs/deploy.md, 'CI checks') when it is not installed."""
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} is not installed (Debian package: see docs/deploy.md, 'Checks')")
    return path


def tiny_run_toml(max_steps: int = 2, kl_beta: float = 0.01) -> str:
    return (
        "[run]\ncompletions_per_prompt = 4\nprompt_groups_per_step = 2\nmax_completion_tokens = 8\n"
        f"max_seq_len = 64\nlearning_rate = 1e-3\nkl_beta = {kl_beta}\nmax_steps = {max_steps}\n"
        "max_head_offpolicy_versions = 1\nseed = 0\n"
    )


def scrape(address: str, port: int) -> str | None:
    try:
        with urllib.request.urlopen(f"http://{address}:{port}/metrics", timeout=2) as response:
            return response.read().decode()
    except OSError:
        return None


def prometheus_query(port: int, query: str) -> list[dict[str, Any]]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": query})
    with urllib.request.urlopen(url, timeout=5) as response:
        body = json.loads(response.read())
    assert body["status"] == "success", body
    return body["data"]["result"]


@dataclass
class ComposeRun:
    """What one run of docker-compose.yml's services showed."""

    services: list[LocalService]
    workdir: Path
    controller_exit: int
    scrapes: dict[str, str] = field(default_factory=dict)  # service name -> last /metrics text
    exit_codes: dict[str, int | None] = field(default_factory=dict)  # every service once the run ended
    prometheus: dict[str, Any] = field(default_factory=dict)  # query -> result, or {"skipped": why}
    seconds: float = 0.0

    @property
    def run_dir(self) -> Path:
        return self.workdir / "volumes" / "fleetrl-run"

    def metrics_lines(self) -> list[dict[str, Any]]:
        path = self.run_dir / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _start_prometheus(workdir: Path, stack: LocalStack, port: int) -> subprocess.Popen[bytes]:
    addresses: dict[str, list[str]] = {}
    for service in stack.services.values():
        addresses.setdefault(service.role, []).append(service.address)
    config = workdir / "prometheus.yml"
    config.write_text(
        prometheus_config(REPO / "monitoring" / "prometheus.yml", addresses, REPO / "monitoring" / "alerts")
    )
    log = open(workdir / "prometheus.log", "wb")  # noqa: SIM115 (closed with the process below)
    process = subprocess.Popen(
        [
            shutil.which("prometheus") or "prometheus",
            f"--config.file={config}",
            f"--storage.tsdb.path={workdir / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    log.close()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/-/ready", timeout=1):
                return process
        except OSError:
            if process.poll() is not None:
                raise StackError("prometheus exited:\n" + (workdir / "prometheus.log").read_text()[-3000:]) from None
            time.sleep(0.2)
    process.kill()
    raise StackError("prometheus not ready within 30 s")


def _query_after_run(port: int) -> dict[str, Any]:
    """Read fleetrl metrics back through Prometheus's HTTP API once the run is over."""
    out: dict[str, Any] = {}
    deadline = time.monotonic() + 20
    query = "fleetrl_trainer_steps_total"
    while time.monotonic() < deadline:
        out[query] = prometheus_query(port, query)
        if out[query] and float(out[query][0]["value"][1]) >= COMPOSE_STEPS:
            break
        time.sleep(0.5)
    for q in (
        "max_over_time(fleetrl_controller_trained_steps[10m])",
        "max_over_time(fleetrl_controller_version[10m])",
        "count(count_over_time(fleetrl_gateway_rollouts_total[10m])) by (instance)",
        "up",
    ):
        out[q] = prometheus_query(port, q)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/rules", timeout=5) as response:
        out["rules"] = json.loads(response.read())["data"]["groups"]
    return out


@pytest.fixture(scope="session")
def compose_run(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: str) -> ComposeRun:
    """docker-compose.yml's fleetrl services (profiles cpu + reference with FLEETRL_REFERENCE=reference:50061: the
    reference as its own service, the opt-in placement; two gateways as `--scale gateway=2`)
    run as local processes on the tiny model for three steps, with the shipped example config folder's rollout,
    scraped directly and, when the prometheus binary is installed, by a real Prometheus using
    monitoring/prometheus.yml and the alert rules."""
    workdir = tmp_path_factory.mktemp("compose")
    config_dir = workdir / "config"
    config_dir.mkdir()
    (config_dir / "run.toml").write_text(tiny_run_toml(max_steps=COMPOSE_STEPS))
    for name in ("rows.jsonl", "rollout.py"):
        shutil.copy(REPO / "docker" / "example" / name, config_dir / name)
    env = {
        "FLEETRL_AUTH_TOKEN": TOKEN,
        "FLEETRL_CONFIG_DIR": str(config_dir),
        "FLEETRL_MODEL_DIR": tiny_model_dir,
        "FLEETRL_ENGINE": "hf",
        "FLEETRL_REFERENCE": "reference:50061",
        # Prometheus scrapes every second here: 3 s of /metrics after the run is enough for the final values.
        "FLEETRL_METRICS_LINGER_S": "3",
    }
    services = compose_services(COMPOSE_FILE, env, {"cpu", "reference"}, workdir, scale={"gateway": 2})
    started = time.monotonic()
    scrapes: dict[str, str] = {}
    last_scrape = [0.0]
    prometheus: subprocess.Popen[bytes] | None = None
    with LocalStack(services, workdir) as stack:

        def watch() -> None:
            if time.monotonic() - last_scrape[0] < 0.2:
                return
            last_scrape[0] = time.monotonic()
            for service in stack.services.values():
                text = scrape(service.address, METRICS_PORTS[service.role])
                if text:
                    scrapes[service.name] = text

        try:
            prom_port = None
            if shutil.which("prometheus"):
                import socket

                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", 0))
                    prom_port = sock.getsockname()[1]
                prometheus = _start_prometheus(workdir, stack, prom_port)
            stack.start(health_timeout_s=240)
            code = stack.wait_exit("controller", timeout_s=300, watch=watch)
            last_scrape[0] = 0.0
            watch()
            # Gateways leave once they hear the run is over; give them a moment, then record every exit.
            deadline = time.monotonic() + 30
            gateways = [s for s in stack.services.values() if s.role == "gateway"]
            while time.monotonic() < deadline and any(g.process and g.process.poll() is None for g in gateways):
                time.sleep(0.2)
            result = ComposeRun(services, workdir, code, scrapes, seconds=time.monotonic() - started)
            result.exit_codes = {s.name: s.process.poll() if s.process else None for s in services}
            if prom_port is not None:
                result.prometheus = _query_after_run(prom_port)
            else:
                result.prometheus = {"skipped": "prometheus is not installed"}
            result.prometheus["port"] = prom_port
            return result
        finally:
            if prometheus is not None:
                prometheus.terminate()
                try:
                    prometheus.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    prometheus.kill()
                    prometheus.wait(timeout=5)
