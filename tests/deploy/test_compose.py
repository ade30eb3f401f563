"""docker-compose.yml: validated by Debian's docker-compose, scale-safe by compose's own checks, and its fleetrl
services run as local processes (commands and environment as written) to train two steps."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.deploy.conftest import COMPOSE_FILE, COMPOSE_STEPS, TOKEN, need_tool
from tests.deploy.from_compose import ComposeError, interpolate, load_compose
from tests.deploy.localstack import REPO

ENV_EXAMPLE = REPO / ".env.example"
PROFILE_SETS = ("cpu", "cpu,reference", "gpu", "gpu,reference")


def env_example() -> dict[str, str]:
    out = {}
    for line in ENV_EXAMPLE.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            key, _, value = line.partition("=")
            out[key.strip()] = value.strip()
    return out


def docker_compose(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    exe = need_tool("docker-compose")
    return subprocess.run(
        [exe, "--project-directory", str(REPO), "-f", str(COMPOSE_FILE), *args],
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", **(env or {})},
        timeout=60,
    )


@pytest.mark.parametrize("profiles", PROFILE_SETS)
def test_docker_compose_config_validates_every_profile(profiles):
    result = docker_compose("--env-file", str(ENV_EXAMPLE), "config", env={"COMPOSE_PROFILES": profiles})
    assert result.returncode == 0, result.stderr
    config = yaml.safe_load(result.stdout)
    assert {"controller", "gateway", "inference", "trainer", "prometheus", "grafana"} <= set(config["services"])


def test_docker_compose_refuses_to_run_without_the_auth_token(tmp_path):
    empty = tmp_path / "empty.env"
    empty.write_text("COMPOSE_PROFILES=cpu\n")
    result = docker_compose("--env-file", str(empty), "config", "-q")
    assert result.returncode != 0
    assert "FLEETRL_AUTH_TOKEN" in result.stderr


def test_scale_gateway_passes_composes_own_scale_checks(tmp_path):
    """`docker-compose up --scale gateway=4` needs an engine; its checks on the file (no fixed container name, no
    host port) are compose's own code, run here through docker-compose's Python package."""
    exe = Path(need_tool("docker-compose"))
    python = exe.read_text().splitlines()[0].removeprefix("#!").split()  # docker-compose's own interpreter
    script = (
        "import logging, sys\n"
        "from compose.config import config\n"
        "from compose.config.environment import Environment\n"
        "from compose.service import Service\n"
        "warnings = []\n"
        "class Grab(logging.Handler):\n"
        "    def emit(self, record): warnings.append(record.getMessage())\n"
        "logging.getLogger('compose').addHandler(Grab())\n"
        f"env = Environment.from_env_file({str(REPO)!r}, {str(ENV_EXAMPLE)!r})\n"
        f"data = config.load(config.find({str(REPO)!r}, None, env))\n"
        "sd = dict(next(s for s in data.services if s['name'] == 'gateway'))\n"
        "name = sd.pop('name')\n"
        "Service(name, client=None, project='fleetrl', **sd).show_scale_warnings(4)\n"
        "print('WARN' if warnings else 'OK', warnings)\n"
    )
    result = subprocess.run([*python, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("OK"), result.stdout
    # And the override form of the same: `scale: 4` on the gateway validates.
    override = tmp_path / "scale.yml"
    override.write_text("services:\n  gateway:\n    scale: 4\n")
    scaled = docker_compose(
        "--env-file", str(ENV_EXAMPLE), "-f", str(override), "config", env={"COMPOSE_PROFILES": "cpu"}
    )
    assert scaled.returncode == 0, scaled.stderr
    assert yaml.safe_load(scaled.stdout)["services"]["gateway"]["scale"] == 4


@pytest.mark.parametrize("profiles", ["cpu,reference", "gpu"])
def test_our_interpolation_matches_docker_compose(profiles):
    """The smoke test reads the file with tests/deploy/from_compose.py; it must see what compose sees."""
    env = env_example() | {"FLEETRL_ENGINE": "hf", "FLEETRL_ROLLOUT": "pkg.mod:make"}
    result = docker_compose("config", env={**env, "COMPOSE_PROFILES": profiles})
    assert result.returncode == 0, result.stderr
    theirs = yaml.safe_load(result.stdout)["services"]
    ours = load_compose(COMPOSE_FILE, env)["services"]
    for name, service in ours.items():
        assert [str(a) for a in service.get("command", [])] == [str(a) for a in theirs[name].get("command", [])], name
        assert {k: str(v) for k, v in (service.get("environment") or {}).items()} == {
            k: str(v) for k, v in (theirs[name].get("environment") or {}).items()
        }, name


def test_interpolation_rules():
    env = {"A": "1", "EMPTY": ""}
    assert interpolate("${A}-${B:-x}-${EMPTY:-d}-${EMPTY-d}-$$A-$A", env) == "1-x-d--$A-1"
    with pytest.raises(ComposeError, match="B"):
        interpolate("${B:?set B}", env)


def test_services_find_each_other_by_name_and_gateways_need_no_per_replica_config():
    services = load_compose(COMPOSE_FILE, env_example())["services"]
    trainer = services["trainer"]["command"]
    assert trainer[trainer.index("--advertise-host") + 1] == "trainer"  # what gateways and replicas connect to
    gateway = services["gateway"]["command"]
    assert gateway[gateway.index("--controller") + 1] == "controller:50050"
    assert "--gateway-id" not in gateway and "container_name" not in services["gateway"]
    assert not services["gateway"].get("ports"), "a published port would clash when scaled"
    assert services["gateway"]["depends_on"] == {"controller": {"condition": "service_healthy"}}
    for gpu in ("inference-gpu", "trainer-gpu"):
        (device,) = services[gpu]["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
        assert services[gpu]["profiles"] == ["gpu"]
        assert services[gpu]["networks"]["default"]["aliases"] == [gpu.removesuffix("-gpu")]
    assert "--device" in services["trainer-gpu"]["command"]
    assert services["trainer-gpu"]["command"][services["trainer-gpu"]["command"].index("--device") + 1] == "cuda"
    for name in ("controller", "gateway", "inference", "trainer", "reference"):
        test = services[name]["healthcheck"]["test"]
        assert test[:4] == ["CMD", "python", "-m", "fleetrl.commands.health"], name
    assert any(v.startswith("fleetrl-checkpoints:") for v in services["trainer"]["volumes"])
    assert any(v.startswith("fleetrl-run:") for v in services["controller"]["volumes"])


def scraped_value(text: str, series: str) -> float:
    return float(text.split(series + " ")[1].split()[0])


@pytest.mark.integration
@pytest.mark.slow
def test_compose_services_train_two_steps(compose_run):
    """The compose file's services, as written, on loopback: two gateways, the reference (kl_beta > 0), the auth
    token from the environment, the shipped example rollout; three steps, then the controller exits 0."""
    assert compose_run.controller_exit == 0
    lines = compose_run.metrics_lines()
    assert [m["step"] for m in lines] == list(range(1, COMPOSE_STEPS + 1))
    assert all(m["async/version_offset_max"] <= 1 for m in lines)
    assert lines[-1]["producer/rows_failed"] == 0  # gateways waited for the stack: no row was lost at start
    assert "train/kl_ref" in lines[-1] and "perf/ref_forward_time" in lines[-1]  # the reference service answered
    ckpt = compose_run.workdir / "volumes" / "fleetrl-checkpoints"
    assert any(ckpt.glob("step-*")), "no checkpoint in the checkpoints volume"
    assert (compose_run.run_dir / "final" / "config.json").exists()  # the exported model, in the run volume
    gateways = [s for s in compose_run.services if s.role == "gateway"]
    assert len(gateways) == 2
    # Both replicas of the scaled service, same command line, joined the run (distinct member ids from their
    # hostnames and pids; the line is logged once Register succeeded) and left it cleanly when it ended. How
    # the rows split between them is up to timing: a tiny run can be over before the second one asks.
    ids = set()
    for gateway in gateways:
        log = (compose_run.workdir / f"{gateway.name}.log").read_text()
        started = re.search(r"gateway (\S+) started \(controller (\S+)\)", log)
        assert started, log[-2000:]
        assert started.group(2) == f"{next(s.address for s in compose_run.services if s.name == 'controller')}:50050"
        ids.add(started.group(1))
        assert compose_run.exit_codes[gateway.name] == 0, log[-2000:]
    assert len(ids) == 2
    scraped = [compose_run.scrapes[g.name] for g in gateways if g.name in compose_run.scrapes]
    assert scraped, "no gateway /metrics answered on its own address (--host 0.0.0.0, port 9404)"
    series = 'fleetrl_gateway_rollouts_total{result="ok"}'
    assert sum(scraped_value(text, series) for text in scraped) > 0
    assert TOKEN not in "".join((compose_run.workdir / f"{s.name}.log").read_text() for s in compose_run.services)


def test_inference_takes_the_lora_rank_from_the_env():
    """FLEETRL_MAX_LORA_RANK reaches the replica as --max-lora-rank (0 in .env.example: LoRA off)."""
    from fleetrl.services.inference.launcher import build_parser, config_from_args

    for env, rank in ((env_example(), 0), (env_example() | {"FLEETRL_MAX_LORA_RANK": "16"}, 16)):
        command = [str(a) for a in load_compose(COMPOSE_FILE, env)["services"]["inference"]["command"]]
        assert command[:2] == ["serve", "inference"]
        assert config_from_args(build_parser().parse_args(command[2:])).max_lora_rank == rank
