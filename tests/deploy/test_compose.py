"""docker-compose.yml: validated by Debian's docker-compose, scale-safe by compose's own checks, and its fleetrl
services run as local processes (commands and environment as written) to train two steps."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.deploy.conftest import COMPOSE_FILE, COMPOSE_STEPS, TOKEN, need_tool, tiny_run_toml
from tests.deploy.from_compose import (
    ComposeError,
    compose_config,
    compose_services,
    interpolate,
    load_compose,
    read_compose,
)
from tests.deploy.localstack import REPO, LocalStack, StackError

ENV_EXAMPLE = REPO / ".env.example"
PROFILE_SETS = ("cpu", "cpu,reference", "gpu", "gpu,reference", "gpu,reference-gpu")


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


def _canonical(config: dict) -> dict:
    """What may differ in spelling only: durations (compose prints 60s as 1m) and the order of a service's
    volumes (compose sorts them by mount path when it merges an override file)."""

    def seconds(value: str) -> float:
        units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001}
        return sum(float(n) * units[u] for n, u in re.findall(r"([\d.]+)(ms|h|m|s)", str(value)))

    services = {}
    for name, service in config["services"].items():
        service = dict(service)
        if "volumes" in service:
            service["volumes"] = sorted(service["volumes"], key=lambda v: v.split(":")[1])
        if "healthcheck" in service:
            check = dict(service["healthcheck"])
            for key in ("interval", "timeout", "start_period"):
                if key in check:
                    check[key] = seconds(check[key])
            service["healthcheck"] = check
        services[name] = service
    return {"services": services, "volumes": config.get("volumes") or {}}


READER_CASES = [(p, ()) for p in PROFILE_SETS] + [("cpu", ("docker-compose.rows-url.yml",))]


@pytest.mark.parametrize(("profiles", "overrides"), READER_CASES)
def test_the_in_python_reader_equals_docker_compose_config(profiles, overrides):
    """Where docker-compose is absent the tests read the file with tests/deploy/from_compose.py's own reader; on
    every profile (and with the rows-URL override file) it must give exactly what `docker-compose config` gives,
    up to the spelling compose normalises (absolute paths, default modes, durations)."""
    need_tool("docker-compose")
    env = env_example() | {"FLEETRL_ENGINE": "hf", "FLEETRL_ROLLOUT": "pkg.mod:make"}
    if overrides:
        env |= {"FLEETRL_ROWS_URL": "https://data.example.com/train.jsonl", "HF_TOKEN": "hf_x"}
    files = tuple(REPO / o for o in overrides)
    theirs = compose_config(COMPOSE_FILE, env, files, tuple(profiles.split(",")))
    ours = read_compose(COMPOSE_FILE, env, files)
    assert _canonical(ours) == _canonical(theirs)


def test_the_reader_merges_a_merge_list_by_the_yaml_rule(tmp_path):
    """In `<<: [*a, *b]` the earlier mapping wins, and the mapping's own keys win over both (yaml.org/type/merge,
    and compose): whatever rule the installed PyYAML follows (6.0.4 reversed it, and the gpu reference service then
    read `fleetrl:cpu`)."""
    file = tmp_path / "compose.yml"
    file.write_text(
        "x-a: &a {image: first, command: [a]}\n"
        "x-b: &b {image: second, restart: 'no', command: [b]}\n"
        "services:\n"
        "  s:\n    <<: [*a, *b]\n    command: [own]\n"
        "  t:\n    <<: *b\n"
        "  u:\n    <<: [*b, *a]\n"
    )
    services = read_compose(file, {})["services"]
    assert services["s"] == {"image": "first", "command": ["own"], "restart": "no"}
    assert services["t"] == {"image": "second", "restart": "no", "command": ["b"]}
    assert services["u"] == {"image": "second", "restart": "no", "command": ["b"]}
    if shutil.which("docker-compose"):  # the same file through compose itself
        theirs = compose_config(file, {})["services"]
        assert {n: {k: theirs[n][k] for k in ("image", "command")} for n in theirs} == {
            n: {k: services[n][k] for k in ("image", "command")} for n in services
        }


def test_load_compose_is_docker_compose_where_it_is_installed():
    """With the tool on PATH the tests read the file through `docker-compose config`, not the reader."""
    need_tool("docker-compose")
    services = load_compose(COMPOSE_FILE, env_example())["services"]
    assert services["inference"]["build"]["context"] == str(REPO)  # compose makes the context absolute


def test_interpolation_rules():
    env = {"A": "1", "EMPTY": ""}
    assert interpolate("${A}-${B:-x}-${EMPTY:-d}-${EMPTY-d}-$$A-$A", env) == "1-x-d--$A-1"
    with pytest.raises(ComposeError, match="B"):
        interpolate("${B:?set B}", env)


def test_override_files_merge_as_compose_does_or_are_refused(tmp_path):
    more = tmp_path / "more.yml"
    more.write_text("services:\n  gateway:\n    command: [serve, gateway]\n    depends_on: {trainer: {}}\n")
    gateway = read_compose(COMPOSE_FILE, env_example(), overrides=(more,))["services"]["gateway"]
    assert gateway["command"] == ["serve", "gateway"]  # replaced, as compose replaces a command
    assert gateway["depends_on"] == {"controller": {"condition": "service_healthy"}, "trainer": {}}  # merged
    more.write_text("services:\n  gateway:\n    volumes: [./x:/x]\n")  # compose merges these by mount path
    with pytest.raises(ComposeError, match=r"services\.gateway\.volumes"):
        read_compose(COMPOSE_FILE, env_example(), overrides=(more,))


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
    """The compose file's services, as written, on loopback: two gateways, the reference service (kl_beta > 0, the
    opt-in placement: profile reference, FLEETRL_REFERENCE=reference:50061), the auth token from the environment,
    the shipped example rollout; three steps, then the controller exits 0."""
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
    # Both replicas of the scaled service, same command line, have distinct member ids (from their hostnames and
    # pids). Each one that joined the run (its "started" line is logged once a controller answered it) left it
    # cleanly when it ended: told by a lease, heartbeat or register reply. How the rows split between them is up
    # to timing, and a tiny run can be over before the second one starts: under load one registered 0.3 s after
    # the controller had exited. That one never reached a controller; it is still waiting for one (as a gateway
    # started before its controller does) and is stopped with the stack.
    controller = f"{next(s.address for s in compose_run.services if s.name == 'controller')}:50050"
    ids, joined = set(), 0
    for gateway in gateways:
        log = (compose_run.workdir / f"{gateway.name}.log").read_text()
        started = re.search(r"gateway (\S+) started \(controller (\S+)\)", log)
        waiting = re.search(r"gateway (\S+): no answer from the controller at (\S+) yet", log)
        assert started or waiting, log[-2000:]
        assert (started or waiting).group(2) == controller
        ids.add((started or waiting).group(1))
        if started:
            joined += 1
            assert compose_run.exit_codes[gateway.name] == 0, log[-2000:]
        else:
            assert compose_run.exit_codes[gateway.name] is None, log[-2000:]
    assert len(ids) == 2 and joined >= 1
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


def test_inference_serves_the_dtype_from_the_env():
    """FLEETRL_INFERENCE_DTYPE (the run's inference_dtype) reaches the replica as --dtype; float32 by default."""
    from fleetrl.services.inference.launcher import build_parser, config_from_args

    for env, dtype in (
        (env_example(), "float32"),
        (env_example() | {"FLEETRL_INFERENCE_DTYPE": "bfloat16"}, "bfloat16"),
    ):
        command = [str(a) for a in load_compose(COMPOSE_FILE, env)["services"]["inference"]["command"]]
        assert config_from_args(build_parser().parse_args(command[2:])).dtype == dtype


# --- Where the KL reference runs: FLEETRL_REFERENCE, the reference and reference-gpu profiles ---------------------


def trainer_config(command: list, run_toml: Path) -> object:
    """The trainer's config from its compose command, the container's run.toml read from `run_toml`."""
    from fleetrl.services.trainer.launcher import build_parser, config_from_args

    command = [str(run_toml) if a == "/etc/fleetrl/user/run.toml" else str(a) for a in command]
    assert command[:2] == ["serve", "trainer"]
    return config_from_args(build_parser().parse_args(command[2:]))


def reference_config(command: list) -> object:
    from fleetrl.services.reference.launcher import build_parser, config_from_args

    command = [str(a) for a in command]
    assert command[:2] == ["serve", "reference"]
    return config_from_args(build_parser().parse_args(command[2:]))


def test_the_trainer_hosts_the_reference_unless_the_env_names_the_service(tmp_path):
    """.env.example (and an unset FLEETRL_REFERENCE): --reference local, a frozen copy in the trainer, in both the
    cpu and gpu variants, and no profile of the default runs a reference container; FLEETRL_REFERENCE names the
    opt-in service, which the reference profiles run."""
    run_toml = tmp_path / "run.toml"
    run_toml.write_text(tiny_run_toml())
    base = env_example()
    for env in (base, {k: v for k, v in base.items() if k != "FLEETRL_REFERENCE"}):
        services = load_compose(COMPOSE_FILE, env)["services"]
        for name in ("trainer", "trainer-gpu"):
            assert trainer_config(services[name]["command"], run_toml).reference == "local", name
    assert {"reference", "reference-gpu"}.isdisjoint(
        name for name, spec in load_compose(COMPOSE_FILE, base)["services"].items() if "cpu" in spec.get("profiles", [])
    )
    services = load_compose(COMPOSE_FILE, base | {"FLEETRL_REFERENCE": "reference:50061"})["services"]
    for name in ("trainer", "trainer-gpu"):
        assert trainer_config(services[name]["command"], run_toml).reference == "reference:50061", name
    assert services["reference"]["profiles"] == ["reference"]
    assert services["reference-gpu"]["profiles"] == ["reference-gpu"]


def test_the_reference_service_runs_on_the_device_and_dtype_from_the_env():
    """Profile reference: --device FLEETRL_REFERENCE_DEVICE (cpu) and --dtype FLEETRL_REFERENCE_DTYPE (float32);
    profile reference-gpu: the gpu image on cuda in bfloat16 (the gpu trainer's compute dtype), reserving
    FLEETRL_REFERENCE_GPUS, reached by the name `reference` like the CPU variant."""
    services = load_compose(COMPOSE_FILE, env_example())["services"]
    cpu = reference_config(services["reference"]["command"])
    gpu = reference_config(services["reference-gpu"]["command"])
    assert (cpu.device, cpu.dtype) == ("cpu", "float32") and (gpu.device, gpu.dtype) == ("cuda", "bfloat16")
    spec = services["reference-gpu"]
    (device,) = spec["deploy"]["resources"]["reservations"]["devices"]
    assert device["device_ids"] == ["2"] and device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
    assert spec["image"] == "fleetrl:gpu" and spec["networks"]["default"]["aliases"] == ["reference"]
    assert spec["healthcheck"] == services["reference"]["healthcheck"]
    env = env_example() | {
        "FLEETRL_REFERENCE_DEVICE": "cuda:1",
        "FLEETRL_REFERENCE_DTYPE": "bfloat16",
        "FLEETRL_REFERENCE_GPUS": "3",
    }
    services = load_compose(COMPOSE_FILE, env)["services"]
    cpu = reference_config(services["reference"]["command"])
    assert (cpu.device, cpu.dtype) == ("cuda:1", "bfloat16")
    (device,) = services["reference-gpu"]["deploy"]["resources"]["reservations"]["devices"]
    assert device["device_ids"] == ["3"]


@pytest.mark.integration
@pytest.mark.slow
def test_the_default_cpu_stack_trains_with_the_reference_in_the_trainer(tmp_path: Path, tiny_model_dir: str):
    """Profile cpu as shipped (FLEETRL_REFERENCE unset: local), kl_beta > 0: no reference container runs, the
    controller's healthcheck skips the absent reference, and the trainer's own copy gives the KL term."""
    config_dir = tmp_path / "config"
    config_dir.mkdir()
    (config_dir / "run.toml").write_text(tiny_run_toml(max_steps=2, kl_beta=0.05))
    write_rows(config_dir / "rows.jsonl", 12)
    env = {
        "FLEETRL_AUTH_TOKEN": TOKEN,
        "FLEETRL_CONFIG_DIR": str(config_dir),
        "FLEETRL_MODEL_DIR": tiny_model_dir,
        "FLEETRL_ENGINE": "hf",
        # A rollout whose rewards differ within a group: the policy moves, so the step-2 KL is above 0.
        "FLEETRL_ROLLOUT": "tests.integration.up.rollouts:make_rollout_fn",
        "FLEETRL_METRICS_LINGER_S": "0",
    }
    services = compose_services(COMPOSE_FILE, env, {"cpu"}, tmp_path)
    assert sorted(s.role for s in services) == ["controller", "gateway", "inference", "trainer"]
    with LocalStack(services, tmp_path) as stack:
        stack.start(health_timeout_s=240)
        assert stack.wait_exit("controller", timeout_s=300) == 0, stack.all_log_tails()
    run_dir = tmp_path / "volumes" / "fleetrl-run"
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2]
    assert lines[-1]["train/kl_ref"] > 0  # the policy moved away from the trainer's frozen copy


# --- The prompt rows: FLEETRL_ROWS, FLEETRL_DATA_DIR, docker-compose.rows-url.yml ------------------------------

ROWS_URL_FILE = REPO / "docker-compose.rows-url.yml"


def write_rows(path: Path, n: int = 5) -> str:
    """A JSONL rows file; returns its sha256."""
    path.write_text("".join(json.dumps({"prompt": f"count {i} to {i + 3}:"}) + "\n" for i in range(n)))
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_the_default_stack_reads_rows_from_the_config_folder_and_mounts_the_data_folder(tmp_path):
    for env, rows, data in (
        ({}, "/etc/fleetrl/user/rows.jsonl", "fleetrl-data"),
        (
            {"FLEETRL_ROWS": "/var/lib/fleetrl/data/gsm8k/train.parquet", "FLEETRL_DATA_DIR": str(tmp_path)},
            "/var/lib/fleetrl/data/gsm8k/train.parquet",
            str(tmp_path),
        ),
    ):
        result = docker_compose("--env-file", str(ENV_EXAMPLE), "config", env={"COMPOSE_PROFILES": "cpu", **env})
        assert result.returncode == 0, result.stderr
        services = yaml.safe_load(result.stdout)["services"]
        assert "fetch-rows" not in services  # the URL download is docker-compose.rows-url.yml's
        controller = services["controller"]
        assert controller["command"][controller["command"].index("--rows") + 1] == rows
        assert f"{data}:/var/lib/fleetrl/data:ro" in controller["volumes"]
        assert "depends_on" not in controller


@pytest.mark.parametrize("profiles", ["cpu", "gpu,reference"])
def test_the_rows_url_file_adds_a_one_shot_download_the_controller_waits_for(profiles):
    env = env_example() | {"FLEETRL_ROWS_URL": "https://data.example.com/gsm8k/train.jsonl", "HF_TOKEN": "hf_x"}
    result = docker_compose("-f", str(ROWS_URL_FILE), "config", env={**env, "COMPOSE_PROFILES": profiles})
    assert result.returncode == 0, result.stderr
    theirs = yaml.safe_load(result.stdout)["services"]
    assert theirs["controller"]["depends_on"] == {"fetch-rows": {"condition": "service_completed_successfully"}}
    fetch = theirs["fetch-rows"]
    assert "profiles" not in fetch and fetch.get("restart") == "no"
    assert fetch["environment"] == {"HF_TOKEN": "hf_x"}
    assert "fleetrl-data:/var/lib/fleetrl:rw" in fetch["volumes"]  # the controller's data folder, writable here
    ours = load_compose(COMPOSE_FILE, env, overrides=(ROWS_URL_FILE,))["services"]
    for name in ("fetch-rows", "controller"):  # tests/deploy/from_compose.py merges the files as compose does
        for key in ("entrypoint", "command", "depends_on"):
            assert ours[name].get(key) == theirs[name].get(key), (name, key)
    # Without a URL the file refuses to start, naming the variable.
    missing = docker_compose("-f", str(ROWS_URL_FILE), "config", "-q", env=env_example() | {"COMPOSE_PROFILES": "cpu"})
    assert missing.returncode != 0 and "FLEETRL_ROWS_URL" in missing.stderr


def test_rows_from_a_url_land_where_the_controller_reads_them_before_it_starts(tmp_path):
    """docker-compose.rows-url.yml's fetch-rows, run locally on a file:// URL with its sha256, writes the file
    into the data volume; the controller (here a stand-in with its mounts, --rows and depends_on) starts only
    after that and reads it. A wrong sha256 fails fetch-rows, leaves nothing, and the controller never starts."""
    served = tmp_path / "served" / "train.jsonl"
    served.parent.mkdir()
    sha = write_rows(served)
    for expected, ok in ((sha.upper(), True), ("0" * 64, False)):
        workdir = tmp_path / f"run-{ok}"
        env = {
            "FLEETRL_AUTH_TOKEN": TOKEN,
            "FLEETRL_ROWS_URL": served.as_uri(),
            "FLEETRL_ROWS_SHA256": expected,
            "FLEETRL_ROWS": "/var/lib/fleetrl/data/train.jsonl",
        }
        services = {
            s.name: s for s in compose_services(COMPOSE_FILE, env, {"cpu"}, workdir, overrides=(ROWS_URL_FILE,))
        }
        fetch, controller = services["fetch-rows"], services["controller"]
        assert controller.depends_on == {"fetch-rows": "service_completed_successfully"}
        rows = controller.argv[controller.argv.index("--rows") + 1]
        reader = dataclasses.replace(
            controller,
            argv=["python", "-c", "import sys; sys.stdout.write(open(sys.argv[1]).read())", rows],
            probe=None,
        )
        volume = workdir / "volumes" / "fleetrl-data"
        with LocalStack([fetch, reader], workdir) as stack:
            if ok:
                stack.start(health_timeout_s=60)
                assert stack.wait_exit("controller", timeout_s=60) == 0, stack.all_log_tails()
                assert (workdir / "controller.log").read_bytes() == served.read_bytes()
                assert (volume / "train.jsonl").read_bytes() == served.read_bytes()
                assert f"sha256 {sha}" in (workdir / "fetch-rows.log").read_text()
            else:
                with pytest.raises(StackError, match="fetch-rows exited with code 1"):
                    stack.start(health_timeout_s=60)
                assert reader.process is None
                assert "expected " + "0" * 64 in (workdir / "fetch-rows.log").read_text()
                assert not list(volume.iterdir())  # no file, no partial one


# --- Relayed weight pushes ---------------------------------------------------------------------------------


def test_inference_serves_its_weight_relay_on_a_fixed_port_under_its_service_name():
    """--relay-port 5573 (declared with `expose`), and the hostname `inference`: the relay is advertised as
    <hostname>:5573, a name the other containers resolve."""
    from fleetrl.services.inference.launcher import build_parser, config_from_args

    result = docker_compose("--env-file", str(ENV_EXAMPLE), "config", env={"COMPOSE_PROFILES": "cpu,gpu"})
    assert result.returncode == 0, result.stderr
    theirs = yaml.safe_load(result.stdout)["services"]
    for name in ("inference", "inference-gpu"):
        assert theirs[name]["hostname"] == "inference"
        assert [str(p) for p in theirs[name]["expose"]] == ["5573"]
        command = [str(a) for a in theirs[name]["command"]]
        assert config_from_args(build_parser().parse_args(command[2:])).relay_port == 5573


def test_a_weight_fanout_in_run_toml_reaches_the_controller(tmp_path):
    """weight_fanout is a run key: the run.toml in FLEETRL_CONFIG_DIR carries it to the controller."""
    from fleetrl.services.controller.launcher import build_parser
    from fleetrl.shell.args import run_config_from_args

    (tmp_path / "run.toml").write_text(tiny_run_toml() + 'weight_fanout = "chain"\n')
    env = {"FLEETRL_AUTH_TOKEN": TOKEN, "FLEETRL_CONFIG_DIR": str(tmp_path)}
    services = compose_services(COMPOSE_FILE, env, {"cpu"}, tmp_path / "work")
    stack = LocalStack(services, tmp_path / "work")
    argv = stack.command(stack.services["controller"])
    assert argv[3:5] == ["serve", "controller"]
    assert run_config_from_args(build_parser().parse_args(argv[5:])).weight_fanout == "chain"
