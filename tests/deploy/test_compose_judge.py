"""docker-compose.yml with a judge pool (issue 32 part 3): the opt-in profile `judge` runs a frozen inference
replica of FLEETRL_JUDGE_DIR (mounted at /models/judge) under the service name `judge`, never listed to the
controller; the gateways take it from FLEETRL_JUDGE / FLEETRL_JUDGE_BASE_URL / FLEETRL_JUDGE_MODEL (unset: no judge,
the empty flags mean none)."""

from __future__ import annotations

from tests.deploy.conftest import COMPOSE_FILE
from tests.deploy.from_compose import REPO, load_compose
from tests.deploy.test_compose import env_example


def gateway_config(command: list) -> object:
    """The GatewayConfig of the gateway's judge flags as compose writes them (the run config is the test's own:
    the command's --config names a file inside the container)."""
    from fleetrl import Config
    from fleetrl.gateway.config import GatewayConfig

    command = [str(a) for a in command]
    assert command[:2] == ["serve", "gateway"]
    judges = [command[i + 1] for i, a in enumerate(command) if a == "--judge"]
    assert len(judges) == 1  # one flag, empty when unset

    def value(flag: str) -> str:
        return command[command.index(flag) + 1]

    return GatewayConfig(
        run=Config(base_model="m"),
        rollout="m:f",
        judge=judges,
        judge_base_url=value("--judge-base-url"),
        judge_model=value("--judge-model"),
    )


def test_the_gateways_have_no_judge_unless_the_env_names_one() -> None:
    services = load_compose(COMPOSE_FILE, env_example())["services"]
    config = gateway_config(services["gateway"]["command"])
    assert (config.judge, config.judge_base_url, config.judge_model) == ([], None, None)
    env = env_example() | {
        "FLEETRL_JUDGE": "judge:50051",
        "FLEETRL_JUDGE_BASE_URL": "http://judge:8000/v1",
        "FLEETRL_JUDGE_MODEL": "/models/judge",
    }
    config = gateway_config(load_compose(COMPOSE_FILE, env)["services"]["gateway"]["command"])
    assert (config.judge, config.judge_base_url, config.judge_model) == (
        ["judge:50051"],
        "http://judge:8000/v1",
        "/models/judge",
    )


def test_the_judge_service_is_a_frozen_replica_of_the_judge_model() -> None:
    env = env_example() | {"FLEETRL_JUDGE_DIR": "./models/judge"}
    services = load_compose(COMPOSE_FILE, env)["services"]
    judge = services["judge"]
    assert judge["profiles"] == ["judge"]
    command = [str(a) for a in judge["command"]]
    assert command[:2] == ["serve", "inference"] and command[command.index("--model") + 1] == "/models/judge"
    assert f"{REPO}/models/judge:/models/judge:ro" in judge["volumes"]
    assert "judge" not in " ".join(str(a) for a in services["controller"]["command"])  # never sent weights


def test_the_judge_pool_scales_on_its_own_and_the_gateways_find_every_replica() -> None:
    """`docker compose up --scale judge=N`: the judge service pins nothing a second replica would clash on (no
    container name, hostname or published port), and the gateways look its name up again (--judge-resolve-s), so
    every replica's address is a judge (compose's DNS answers the service name with one address per replica)."""
    env = env_example() | {"FLEETRL_JUDGE": "judge:50051", "FLEETRL_JUDGE_BASE_URL": "http://judge:8000/v1"}
    services = load_compose(COMPOSE_FILE, env)["services"]
    judge = services["judge"]
    assert not {"container_name", "hostname", "ports"} & set(judge), judge
    command = [str(a) for a in services["gateway"]["command"]]
    config = gateway_config(command).model_copy(
        update={"judge_resolve_s": float(command[command.index("--judge-resolve-s") + 1])}
    )
    assert config.judge == ["judge:50051"] and config.judge_resolve_s == 10.0


def test_prometheus_scrapes_every_judge_replica_apart_from_the_policys() -> None:
    """A fleetrl-judge job finds each judge replica by the service name on the port its --metrics-port serves,
    labelled component=judge so the dashboard's policy inference panels leave it out (and its own panels select it)."""
    import yaml

    services = load_compose(COMPOSE_FILE, env_example())["services"]
    command = [str(a) for a in services["judge"]["command"]]
    config = yaml.safe_load((REPO / "monitoring" / "prometheus.yml").read_text())
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "fleetrl-judge"]
    (sd,) = job["dns_sd_configs"]
    assert sd["names"] == ["judge"] and sd["port"] == int(command[command.index("--metrics-port") + 1])
    assert {"target_label": "component", "replacement": "judge"} in job["relabel_configs"]
    assert {"target_label": "run", "replacement": "__FLEETRL_RUN__"} in job["relabel_configs"]


def test_the_dashboard_shows_the_judge_pool_apart_from_the_policy_replicas() -> None:
    """A "Judge pool" row: the gateways' judge calls and retries, and the judge replicas' own inference metrics
    (component="judge": compose's fleetrl-judge job and the chart's ServiceMonitor both set it); every other panel's
    inference series leaves the judges out (component!="judge"), so a judge never shows as a policy replica."""
    import json
    import re

    dashboard = json.loads((REPO / "monitoring" / "grafana" / "dashboards" / "fleetrl.json").read_text())
    panels = dashboard["panels"]
    (row,) = [i for i, p in enumerate(panels) if p["type"] == "row" and p["title"] == "Judge pool"]
    judge_panels = panels[row + 1 :]
    judge_exprs = [t["expr"] for p in judge_panels for t in p["targets"]]
    assert any("fleetrl_gateway_judge_calls_total" in e for e in judge_exprs)
    assert any("fleetrl_gateway_judge_retries_total" in e for e in judge_exprs)
    judge_inference = [s for e in judge_exprs for s in re.findall(r"fleetrl_inference_\w+\{[^}]*\}", e)]
    assert {s.split("{")[0] for s in judge_inference} >= {
        "fleetrl_inference_tokens_per_second",
        "fleetrl_inference_queue_depth",
        "fleetrl_inference_in_flight_requests",
    }
    assert all('component="judge"' in s for s in judge_inference), judge_inference
    policy = [t["expr"] for p in panels[:row] for t in p.get("targets", [])]
    policy_inference = [s for e in policy for s in re.findall(r"fleetrl_inference_\w+\{[^}]*\}", e)]
    assert policy_inference and all('component!="judge"' in s for s in policy_inference), policy_inference


def test_the_gateways_can_read_the_judges_tokenizer() -> None:
    """A gateway loads the judge's tokenizer from --judge-model (FLEETRL_JUDGE_MODEL=/models/judge) at start: the
    judge's model folder is mounted there in the gateway's container too."""
    env = env_example() | {"FLEETRL_JUDGE_DIR": "./models/judge", "FLEETRL_JUDGE_MODEL": "/models/judge"}
    services = load_compose(COMPOSE_FILE, env)["services"]
    assert f"{REPO}/models/judge:/models/judge:ro" in services["gateway"]["volumes"]
