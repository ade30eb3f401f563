"""monitoring/: alert rules checked and unit-tested by promtool, the Prometheus config checked, the dashboard
and rules only query documented metrics, and a real Prometheus scraping the compose stack reads them back."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.deploy.conftest import COMPOSE_STEPS, need_tool
from tests.deploy.localstack import REPO
from tests.deploy.test_metrics_docs import documented_names, matches_documented

MONITORING = REPO / "monitoring"
RULES = MONITORING / "alerts" / "fleetrl.rules.yml"
DASHBOARD = MONITORING / "grafana" / "dashboards" / "fleetrl.json"
METRIC = re.compile(r"\bfleetrl_[a-z0-9_]+")


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([need_tool("promtool"), *args], capture_output=True, text=True, timeout=60)


def test_promtool_check_rules():
    result = promtool("check", "rules", str(RULES))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 7 rules found" in result.stdout


def test_alert_rules_fire_when_they_should():
    """promtool's rule unit tests: staleness above the bound, an old replica for 5 minutes, no step for 15
    minutes, a breaker seen open once, failing rollouts, failed rows; and silence before their thresholds."""
    result = promtool("test", "rules", str(MONITORING / "alerts" / "fleetrl.rules.test.yml"))
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_check_config():
    result = promtool("check", "config", "--syntax-only", str(MONITORING / "prometheus.yml"))
    assert result.returncode == 0, result.stdout + result.stderr


def test_issue_alerts_are_all_there():
    rules = yaml.safe_load(RULES.read_text())
    names = {r["alert"] for group in rules["groups"] for r in group["rules"]}
    assert {
        "FleetrlNoTrainingStep",
        "FleetrlStalenessAboveBound",
        "FleetrlReplicaServingOldVersion",
        "FleetrlGatewayCircuitOpen",
    } <= names


def exprs(dashboard: dict) -> list[str]:
    return [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]


def exposed(name: str) -> str:
    """The metric a series name belongs to (x_bucket/x_sum/x_count of a histogram x)."""
    return re.sub(r"_(bucket|sum|count)$", "", name)


def test_dashboard_loads_and_covers_the_issue_sections():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] == "fleetrl-run" and dashboard["panels"]
    rows = [p["title"] for p in dashboard["panels"] if p["type"] == "row"]
    assert rows == [
        "Pipeline health",
        "Staleness vs bound",
        "Rows and queues",
        "Throughput",
        "Waits",
        "Weight pushes",
        "Learning curves",
        "Judge pool",
    ]
    for panel in dashboard["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}" and panel["targets"], panel["title"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))


def test_every_dashboard_query_selects_the_run():
    """A `run` variable, and every series selector of every panel filtered by it: two runs sharing one Prometheus
    are never merged (the scrape configs set the label: monitoring/prometheus.yml, the chart's ServiceMonitor)."""
    dashboard = json.loads(DASHBOARD.read_text())
    (run,) = [v for v in dashboard["templating"]["list"] if v["name"] == "run"]
    assert run["type"] == "query" and "run)" in run["query"]["query"]
    for expr in exprs(dashboard):
        selectors = re.findall(r"\bfleetrl_[a-z0-9_]+(\{[^}]*\})?", expr)
        assert selectors and all('run="$run"' in s for s in selectors), expr


def test_learning_curves_come_from_the_controllers_step_counters():
    """Reward, KL, loss, entropy, grad norm and lr are means over every step of a window, from counters (no short
    step is lost between scrapes), for metrics the controller sums."""
    from fleetrl.controller.step_sums import CURVE_KEYS

    dashboard = json.loads(DASHBOARD.read_text())
    curves = {"Reward", "KL", "Loss, entropy, grad norm", "Learning rate"}
    panels = [p for p in dashboard["panels"] if p.get("title") in curves]
    assert len(panels) == len(curves)
    for panel in panels:
        for target in panel["targets"]:
            expr = target["expr"]
            (key,) = set(re.findall(r'metric="([^"]+)"', expr))
            assert key in CURVE_KEYS, key
            assert 'sign="positive"' in expr and 'sign="negative"' in expr
            assert "rate(fleetrl_controller_step_value_count_total" in expr and "fleetrl_trainer_" not in expr


def test_prometheus_gives_every_fleetrl_target_a_run_label():
    config = yaml.safe_load((MONITORING / "prometheus.yml").read_text())
    for job in config["scrape_configs"]:
        if job["job_name"].startswith("fleetrl-"):
            assert {"target_label": "run", "replacement": "__FLEETRL_RUN__"} in job["relabel_configs"], job
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    command = " ".join(compose["services"]["prometheus"]["command"])
    assert (
        "s/__FLEETRL_RUN__/${FLEETRL_RUN:-fleetrl}/" in command
        and "--config.file=/prometheus/prometheus.yml" in command
    )


def test_dashboard_and_rules_query_only_documented_metrics():
    documented = documented_names()
    queried = {m for e in exprs(json.loads(DASHBOARD.read_text())) for m in METRIC.findall(e)}
    queried |= set(METRIC.findall(RULES.read_text()))
    undocumented = sorted(m for m in queried if not matches_documented(m, documented))
    assert not undocumented, f"not in docs/metrics.md: {undocumented}"


def test_provisioning_points_grafana_at_prometheus_and_the_dashboard():
    datasource = yaml.safe_load((MONITORING / "grafana/provisioning/datasources/prometheus.yml").read_text())
    assert datasource["datasources"][0]["url"] == "http://prometheus:9090"
    provider = yaml.safe_load((MONITORING / "grafana/provisioning/dashboards/fleetrl.yml").read_text())
    path = provider["providers"][0]["options"]["path"]
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    volumes = compose["services"]["grafana"]["volumes"]
    assert f"./monitoring/grafana/dashboards:{path}:ro" in volumes


@pytest.mark.integration
@pytest.mark.slow
def test_prometheus_scrapes_the_stack_and_answers_queries(compose_run):
    """A real Prometheus (monitoring/prometheus.yml, scrape interval shortened to 1 s, service names mapped to
    the stack's loopback addresses) scraped the run; its HTTP API returns the trainer's step count, the
    controller's version, the gateways' counters (a target per gateway), and our alert rules loaded."""
    need_tool("prometheus")
    result = compose_run.prometheus
    steps = result["fleetrl_trainer_steps_total"]
    assert steps and float(steps[0]["value"][1]) == COMPOSE_STEPS, steps
    assert steps[0]["metric"]["job"] == "fleetrl-trainer"
    assert float(result["max_over_time(fleetrl_controller_trained_steps[10m])"][0]["value"][1]) >= 1
    assert float(result["max_over_time(fleetrl_controller_version[10m])"][0]["value"][1]) >= 1
    gateways = result["count(count_over_time(fleetrl_gateway_rollouts_total[10m])) by (instance)"]
    assert gateways  # scraped from the gateway job's targets (one per scaled gateway, as dns_sd_configs finds)
    targets = {r["metric"]["instance"] for r in result["up"] if r["metric"]["job"] == "fleetrl-gateway"}
    assert len(targets) == 2
    jobs = {r["metric"]["job"] for r in result["up"]}
    assert {
        "fleetrl-controller",
        "fleetrl-trainer",
        "fleetrl-inference",
        "fleetrl-reference",
        "fleetrl-gateway",
    } <= jobs
    loaded = {r["name"] for group in result["rules"] for r in group["rules"]}
    assert "FleetrlNoTrainingStep" in loaded and "FleetrlGatewayCircuitOpen" in loaded
    # Every fleetrl series carries the run label the scrape config sets (the dashboard's $run).
    fleetrl_targets = [r for r in result["up"] if r["metric"]["job"].startswith("fleetrl-")]
    assert fleetrl_targets and {r["metric"].get("run") for r in fleetrl_targets} == {"fleetrl"}
    assert steps[0]["metric"]["run"] == "fleetrl"


def test_dashboard_file_is_the_one_compose_mounts():
    assert Path(DASHBOARD).is_file()
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    env = compose["services"]["grafana"]["environment"]
    assert env["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"].endswith("/fleetrl.json")
