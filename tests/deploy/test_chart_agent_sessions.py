"""The Helm chart's agent sessions (issue 30): by default each gateway serves sessions on its loopback (no port,
no variables); `gateway.agentSessions.exposed` binds them on every interface at `port`, names the pod's IP in the
session URLs (the variables fleetrl.gateway.session_server reads), and `networkPolicy.agentSessionsFrom` admits the
agents' pods to that port only."""

from __future__ import annotations

from fleetrl.gateway.session_server import SESSION_ADVERTISE_HOST_ENV, SESSION_HOST_ENV, SESSION_PORT_ENV
from tests.deploy.from_chart import by_kind, render_chart
from tests.deploy.test_chart import validate_all

AGENTS = [{"podSelector": {"matchLabels": {"app": "agent-sandbox"}}}]


def _gateway(manifests: list[dict]) -> dict:
    (container,) = by_kind(manifests, "Deployment")["r-fleetrl-gateway"]["spec"]["template"]["spec"]["containers"]
    return container


def _policy(manifests: list[dict]) -> dict:
    return by_kind(manifests, "NetworkPolicy")["r-fleetrl"]


def test_sessions_stay_on_the_loopback_by_default() -> None:
    manifests = render_chart({"networkPolicy": {"agentSessionsFrom": AGENTS}}, name="r")
    gateway = _gateway(manifests)
    names = {e["name"] for e in gateway.get("env", [])}
    assert not names & {SESSION_HOST_ENV, SESSION_ADVERTISE_HOST_ENV, SESSION_PORT_ENV}
    assert [p["name"] for p in gateway["ports"]] == ["metrics"]
    assert all(rule.get("from") != AGENTS for rule in _policy(manifests)["spec"]["ingress"])


def test_exposed_sessions_bind_every_interface_name_the_pod_ip_and_admit_only_the_agents() -> None:
    values = {
        "gateway": {"agentSessions": {"exposed": True, "port": 8411}},
        "networkPolicy": {"agentSessionsFrom": AGENTS},
    }
    manifests = render_chart(values, name="r")
    validate_all(manifests)
    gateway = _gateway(manifests)
    env = {e["name"]: e for e in gateway["env"]}
    assert env[SESSION_HOST_ENV]["value"] == "0.0.0.0"
    assert env[SESSION_ADVERTISE_HOST_ENV]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert env[SESSION_PORT_ENV]["value"] == "8411"
    assert {"name": "agent-sessions", "containerPort": 8411} in gateway["ports"]
    (rule,) = [r for r in _policy(manifests)["spec"]["ingress"] if r.get("from") == AGENTS]
    assert rule["ports"] == [{"port": 8411, "protocol": "TCP"}]
