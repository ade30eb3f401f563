"""The Helm chart's judge pool (issue 32 part 3): judge.enabled renders a StatefulSet of judge.replicas frozen
inference replicas of judge.modelPath (judge.volume mounted there) behind a headless Service, never named to the
controller (so never sent weights); every gateway gets each replica's address (--judge), the first one's OpenAI base
URL and the judge's model. Off by default; the schema refuses an unknown judge key."""

from __future__ import annotations

import pytest

from tests.deploy.from_chart import by_kind, render_chart
from tests.deploy.test_chart import validate_all

JUDGE = {
    "judge": {
        "enabled": True,
        "replicas": 2,
        "volume": {"persistentVolumeClaim": {"claimName": "judge", "readOnly": True}},
    }
}


def _args(container: dict) -> list[str]:
    return [str(a) for a in container["args"]]


def test_the_judge_pool_is_off_by_default() -> None:
    manifests = render_chart({}, name="r")
    assert not [m for m in manifests if m["metadata"]["name"] == "r-fleetrl-judge"]
    (gateway,) = by_kind(manifests, "Deployment")["r-fleetrl-gateway"]["spec"]["template"]["spec"]["containers"]
    assert "--judge" not in _args(gateway)


def test_a_judge_pool_is_frozen_replicas_the_gateways_reach() -> None:
    manifests = render_chart(JUDGE, name="r")
    validate_all(manifests)
    judge = by_kind(manifests, "StatefulSet")["r-fleetrl-judge"]
    assert judge["spec"]["replicas"] == 2
    spec = judge["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    args = _args(container)
    assert args[:2] == ["serve", "inference"] and args[args.index("--model") + 1] == "/models/judge"
    assert args[args.index("--engine") + 1] == "hf" and "--max-lora-rank" not in args
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts["judge-model"] == "/models/judge"
    assert {v["name"] for v in spec["volumes"]} >= {"judge-model"}
    service = by_kind(manifests, "Service")["r-fleetrl-judge"]
    assert service["spec"]["clusterIP"] == "None"
    (gateway,) = by_kind(manifests, "Deployment")["r-fleetrl-gateway"]["spec"]["template"]["spec"]["containers"]
    args = _args(gateway)
    judges = [args[i + 1] for i, a in enumerate(args) if a == "--judge"]
    assert judges == ["r-fleetrl-judge-0.r-fleetrl-judge:50051", "r-fleetrl-judge-1.r-fleetrl-judge:50051"]
    assert args[args.index("--judge-base-url") + 1] == "http://r-fleetrl-judge-0.r-fleetrl-judge:8000/v1"
    assert args[args.index("--judge-model") + 1] == "/models/judge"
    # The gateway reads the judge's tokenizer from --judge-model at start: the judge's volume is mounted there too.
    mounts = {m["name"]: m for m in gateway["volumeMounts"]}
    assert mounts["judge-model"]["mountPath"] == "/models/judge" and mounts["judge-model"]["readOnly"]
    pod = by_kind(manifests, "Deployment")["r-fleetrl-gateway"]["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "judge-model"]
    assert volume["persistentVolumeClaim"]["claimName"] == "judge"
    controller = by_kind(manifests, "Job")["r-fleetrl-controller"]["spec"]["template"]["spec"]["containers"]
    assert not any("judge" in a for a in _args(controller[0]))  # never sent weights


def test_the_judge_replicas_are_scraped_and_labelled_apart_from_the_policy() -> None:
    """The ServiceMonitor scrapes the judge Service's metrics port (its selector matches the judge Service, which
    names the port `metrics`) and copies each Service's component into `component`, the label the Grafana
    dashboard's "Judge pool" row selects (component="judge") and its policy inference panels leave out; the
    NetworkPolicy admits Prometheus to the judges' metrics port."""
    manifests = render_chart({**JUDGE, "serviceMonitor": {"enabled": True}}, name="r")
    validate_all(manifests)
    service = by_kind(manifests, "Service")["r-fleetrl-judge"]
    assert "metrics" in {p["name"] for p in service["spec"]["ports"]}
    assert service["metadata"]["labels"]["app.kubernetes.io/component"] == "judge"
    (monitor,) = by_kind(manifests, "ServiceMonitor").values()
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert all(service["metadata"]["labels"].get(k) == v for k, v in selector.items())
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] == "metrics"
    relabel = {
        "sourceLabels": ["__meta_kubernetes_service_label_app_kubernetes_io_component"],
        "targetLabel": "component",
    }
    assert relabel in endpoint["relabelings"]
    (policy,) = by_kind(manifests, "NetworkPolicy").values()
    ports = {p["port"] for rule in policy["spec"]["ingress"] for p in rule.get("ports", [])}
    assert 9405 in ports  # judge.metricsPort


def test_an_unknown_judge_key_fails_rendering_naming_it() -> None:
    with pytest.raises(Exception, match="replica"):
        render_chart({"judge": {"enabled": True, "replica": 2}}, name="r")


def test_the_judge_pods_meet_pod_security_restricted() -> None:
    from tests.deploy.pod_security import restricted_violations

    judge = by_kind(render_chart(JUDGE, name="r"), "StatefulSet")["r-fleetrl-judge"]["spec"]["template"]["spec"]
    assert restricted_violations(judge) == []
    assert judge["securityContext"]["runAsUser"] == 10001


@pytest.mark.integration
@pytest.mark.slow
def test_chart_pods_train_with_a_judge_pool(tmp_path, tiny_model_dir: str) -> None:
    """Every pod the chart renders with judge.enabled (two judge replicas of other weights, same tokenizer, from a
    hostPath volume), started as Kubernetes would: the rollout (which raises without a judge pool) scores every
    sample through setup.judge_sampler, so two trained steps carrying its `judged` metric mean the judges answered;
    the judge pods serve their own model and the controller never names them."""
    import json

    from fleetrl.tiny_model import build_tiny_model
    from tests.deploy.from_chart import chart_services
    from tests.deploy.from_compose import dockerfile_entrypoint
    from tests.deploy.localstack import REPO, LocalStack
    from tests.deploy.test_chart import smoke_values, write_rows

    judge_dir = str(build_tiny_model(tmp_path / "judge-model", seed=5))
    rows = tmp_path / "served" / "train.jsonl"
    rows.parent.mkdir()
    values = smoke_values(tiny_model_dir, rows.as_uri(), write_rows(rows))
    values["run"]["config"]["kl_beta"] = 0.0
    values["run"]["rollout"] = "tests.integration.up.judge_rollouts:make_judged_rollout_fn"
    values["judge"] = {
        "enabled": True,
        "replicas": 2,
        "engine": "hf",
        "volume": {"hostPath": {"path": judge_dir, "type": "Directory"}},
    }
    manifests = render_chart(values, name="smoke")
    entrypoint = dockerfile_entrypoint(REPO / "docker" / "Dockerfile.cpu")
    pods, inits = chart_services(manifests, tmp_path, entrypoint)
    assert {p.role for p in pods} == {
        f"smoke-fleetrl-{c}" for c in ("controller", "gateway", "inference", "trainer", "judge")
    }
    with LocalStack(pods, tmp_path, first_address=60) as stack:
        stack.start_pods(inits, timeout_s=240)
        controller = next(p.name for p in pods if p.role == "smoke-fleetrl-controller")
        assert stack.wait_exit(controller, timeout_s=300) == 0, stack.all_log_tails()
    lines = [
        json.loads(x)
        for x in (tmp_path / "pvc" / "smoke-fleetrl-controller" / "metrics.jsonl").read_text().splitlines()
    ]
    steps = [m for m in lines if "data/samples" in m]
    assert [m["step"] for m in steps] == [1, 2]
    assert all(m["env/all/judged"] == 1.0 for m in steps), steps[-1]
    for i in range(2):
        log = (tmp_path / f"smoke-fleetrl-judge-{i}.log").read_text()
        assert "serve inference" in log or "inference" in log
    controller_args = [str(a) for p in pods if p.role == "smoke-fleetrl-controller" for a in p.argv]
    assert not any("judge" in a for a in controller_args)
