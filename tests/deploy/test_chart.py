"""The Helm chart k8s/fleetrl: rendered by Helm's own engine (helm-python-sdk) for the default values and the
scaled GPU values file, every manifest validated against the Kubernetes schemas (kubernetes-validate), and the
rendered pods' container commands run as local processes to train two steps."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from tests.deploy.from_chart import CHART, by_kind, chart_services, render_chart, values_file
from tests.deploy.from_compose import dockerfile_entrypoint
from tests.deploy.localstack import REPO, LocalStack

pytest.importorskip("helm_python", reason="helm-python-sdk is not installed (pip; see docs/deploy.md, 'Checks')")
kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="kubernetes-validate is not installed (pip; see docs/deploy.md, 'Checks')"
)

SCALED = CHART / "values-gpu-scaled.yaml"
KUBE_VERSIONS = ("1.27.0", kubernetes_validate.utils.latest_version())


@pytest.fixture(scope="module")
def default_manifests() -> list[dict]:
    return render_chart({}, name="demo")


@pytest.fixture(scope="module")
def scaled_manifests() -> list[dict]:
    return render_chart(values_file(SCALED), name="big")


def validate_all(manifests: list[dict]) -> list[str]:
    """Every manifest against each Kubernetes version's strict schema (unknown fields are errors too)."""
    checked = []
    for manifest in manifests:
        if manifest["apiVersion"].startswith("monitoring.coreos.com/"):
            check_service_monitor(manifest)  # a CRD: its schema ships with prometheus-operator, not Kubernetes
            checked.append(manifest["kind"])
            continue
        for version in KUBE_VERSIONS:
            try:
                kubernetes_validate.validate(manifest, version, strict=True)
            except kubernetes_validate.utils.ValidationError as exc:
                where = "/".join(str(p) for p in exc.path)
                pytest.fail(
                    f"{manifest['kind']}/{manifest['metadata']['name']} (k8s {version}): {where}: {exc.message}"
                )
        checked.append(manifest["kind"])
    return checked


def check_service_monitor(manifest: dict) -> None:
    """The fields prometheus-operator requires, with the types its CRD gives them."""
    spec = manifest["spec"]
    assert manifest["kind"] == "ServiceMonitor" and manifest["apiVersion"] == "monitoring.coreos.com/v1"
    assert isinstance(spec["selector"]["matchLabels"], dict) and spec["selector"]["matchLabels"]
    assert all(isinstance(label, str) for label in spec.get("targetLabels", []))
    for endpoint in spec["endpoints"]:
        assert set(endpoint) <= {"port", "path", "interval", "scheme", "relabelings", "metricRelabelings"}
        assert isinstance(endpoint["port"], str) and endpoint["path"].startswith("/")


def test_the_validator_rejects_a_broken_manifest(default_manifests):
    """kubernetes-validate is not a no-op: an unknown field and a wrong type both fail."""
    deployment = copy.deepcopy(next(m for m in default_manifests if m["kind"] == "Deployment"))
    deployment["spec"]["replica"] = 2
    with pytest.raises(kubernetes_validate.utils.ValidationError):
        kubernetes_validate.validate(deployment, KUBE_VERSIONS[-1], strict=True)
    deployment = copy.deepcopy(next(m for m in default_manifests if m["kind"] == "Deployment"))
    deployment["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "http"
    with pytest.raises(kubernetes_validate.utils.ValidationError):
        kubernetes_validate.validate(deployment, KUBE_VERSIONS[-1], strict=True)


def test_default_values_render_valid_manifests(default_manifests):
    kinds = validate_all(default_manifests)
    for kind in ("Job", "Deployment", "StatefulSet", "Service", "ConfigMap", "Secret", "PersistentVolumeClaim"):
        assert kind in kinds, kind
    for kind in ("NetworkPolicy", "PodDisruptionBudget", "HorizontalPodAutoscaler"):
        assert kind in kinds, kind
    assert "ServiceMonitor" not in kinds  # optional, off by default
    assert not [m for m in default_manifests if m["metadata"]["name"].endswith("-reference")]  # kl_beta = 0


def test_a_lora_run_renders_no_reference_service():
    """kl_beta > 0 with lora_rank > 0: the trainer disables its adapter for the reference logprobs, so `auto`
    deploys no reference service and the trainer is not pointed at one; the LoRA keys reach run.toml."""
    values = {"run": {"config": {"kl_beta": 0.01, "lora_rank": 8, "lora_alpha": 16, "lora_target_modules": ["q_proj"]}}}
    manifests = render_chart(values, name="lora")
    validate_all(manifests)
    assert not [m for m in manifests if m["metadata"]["name"].endswith("-reference")]
    trainer = by_kind(manifests, "Deployment")["lora-fleetrl-trainer"]["spec"]["template"]["spec"]
    assert "--reference" not in trainer["containers"][0]["args"]
    run_toml = "\n".join(m["data"].get("run.toml", "") for m in manifests if m["kind"] == "ConfigMap")
    assert "lora_rank = 8" in run_toml and "lora_alpha = 16" in run_toml, run_toml
    full = render_chart({"run": {"config": {"kl_beta": 0.01}}}, name="full")  # full fine-tuning keeps it
    assert "full-fleetrl-reference" in by_kind(full, "Deployment")


def test_scaled_gpu_values_render_valid_manifests(scaled_manifests):
    kinds = validate_all(scaled_manifests)
    assert "ServiceMonitor" in kinds
    inference = by_kind(scaled_manifests, "StatefulSet")["big-fleetrl-inference"]
    assert inference["spec"]["replicas"] == 4
    container = inference["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    trainer = by_kind(scaled_manifests, "Deployment")["big-fleetrl-trainer"]["spec"]["template"]["spec"]
    (main,) = trainer["containers"]
    assert main["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert main["command"][:4] == ["tini", "--", "torchrun", "--standalone"] and "8" in main["command"]
    assert main["args"][main["args"].index("--device") + 1] == "cuda"
    assert "big-fleetrl-reference" in by_kind(scaled_manifests, "Deployment")  # kl_beta 0.001 > 0
    controller = by_kind(scaled_manifests, "Job")["big-fleetrl-controller"]["spec"]["template"]["spec"]
    args = controller["containers"][0]["args"]
    replicas = [args[i + 1] for i, a in enumerate(args) if a == "--inference"]
    assert replicas == [f"big-fleetrl-inference-{i}.big-fleetrl-inference:50051" for i in range(4)]
    hpa = by_kind(scaled_manifests, "HorizontalPodAutoscaler")["big-fleetrl-gateway"]["spec"]
    assert (hpa["minReplicas"], hpa["maxReplicas"]) == (4, 32)
    external = [m for m in hpa["metrics"] if m["type"] == "External"]
    assert external[0]["external"]["metric"]["name"] == "fleetrl_controller_rollout_queue_depth"


def test_gateway_hpa_scales_on_cpu_unless_a_metrics_adapter_is_asked_for(default_manifests):
    hpa = by_kind(default_manifests, "HorizontalPodAutoscaler")["demo-fleetrl-gateway"]["spec"]
    assert [m["type"] for m in hpa["metrics"]] == ["Resource"]  # offline render: no external metrics API
    gateway = by_kind(default_manifests, "Deployment")["demo-fleetrl-gateway"]
    assert "replicas" not in gateway["spec"]  # the HPA owns the count


def test_probes_secret_and_network_policy(default_manifests):
    secret = by_kind(default_manifests, "Secret")["demo-fleetrl-auth"]
    assert len(secret["data"]["token"]) > 40  # a generated token, base64
    for workload in (m for m in default_manifests if m["kind"] in ("Job", "Deployment", "StatefulSet")):
        pod = workload["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        container = pod["containers"][0]
        env = {e["name"]: e for e in container["env"]}
        assert env["FLEETRL_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "demo-fleetrl-auth"
        probe = container["readinessProbe"]
        if container["name"] == "gateway":  # no gRPC server: its /metrics answers
            assert probe["httpGet"]["path"] == "/metrics"
        else:
            assert probe["grpc"]["port"] == next(p["containerPort"] for p in container["ports"] if p["name"] == "grpc")
    policy = by_kind(default_manifests, "NetworkPolicy")["demo-fleetrl"]["spec"]
    release = {"app.kubernetes.io/name": "fleetrl", "app.kubernetes.io/instance": "demo"}
    assert policy["podSelector"]["matchLabels"] == release
    assert policy["ingress"][0] == {"from": [{"podSelector": {"matchLabels": release}}]}
    assert all("ports" in rule for rule in policy["ingress"][1:])  # others reach only the metrics ports
    pdbs = by_kind(default_manifests, "PodDisruptionBudget")
    assert set(pdbs) == {"demo-fleetrl-gateway", "demo-fleetrl-inference"}


def test_notes_tell_how_to_watch_the_run():
    import helm_python as helm

    with helm.Chart.load(str(CHART)) as chart:
        notes = chart.render({}, name="demo", namespace="rl", is_install=True)["fleetrl/templates/NOTES.txt"]
    assert "kubectl -n rl logs -f job/demo-fleetrl-controller" in notes
    assert "kubectl -n rl wait --for=condition=complete job/demo-fleetrl-controller" in notes


def test_helm_lint_passes():
    import helm_python as helm

    for values in ({}, values_file(SCALED)):
        report = helm.lint(str(CHART), values, strict=True, kube_version="v1.30.0")
        errors = [m for m in report["messages"] if m["severity"] >= 2]
        assert not errors and not report["errors"], json.dumps(report, indent=1)


def smoke_values(model_dir: str) -> dict:
    rows = "".join(json.dumps({"prompt": f"count {i} to {i + 3}:"}) + "\n" for i in range(24))
    config = {
        "completions_per_prompt": 4,
        "prompt_groups_per_step": 2,
        "max_completion_tokens": 8,
        "max_seq_len": 64,
        "learning_rate": 1e-3,
        "kl_beta": 0.01,
        "max_steps": 2,
        "seed": 0,
    }
    return {
        "model": {"volume": {"hostPath": {"path": model_dir, "type": "Directory"}}},
        "run": {"config": config, "rollout": "tests.integration.up.rollouts:make_rollout_fn", "rows": rows},
        "inference": {"engine": "hf", "extraArgs": []},
        "controller": {"metricsLingerSeconds": 1},
        "gateway": {"autoscaling": {"enabled": False}, "replicas": 1, "metricsLingerSeconds": 1},
    }


@pytest.mark.integration
@pytest.mark.slow
def test_chart_pods_train_two_steps(tmp_path: Path, tiny_model_dir: str):
    """Every pod the chart renders, its container's command as written (image entrypoint + args), started at
    once as Kubernetes would; the gateway's init container holds it until the stack serves."""
    manifests = render_chart(smoke_values(tiny_model_dir), name="smoke")
    entrypoint = dockerfile_entrypoint(REPO / "docker" / "Dockerfile.cpu")
    pods, inits = chart_services(manifests, tmp_path, entrypoint)
    assert {p.role for p in pods} == {
        f"smoke-fleetrl-{c}" for c in ("controller", "gateway", "inference", "reference", "trainer")
    }
    with LocalStack(pods, tmp_path, first_address=40) as stack:
        stack.start_pods(inits, timeout_s=240)
        controller = next(p.name for p in pods if p.role == "smoke-fleetrl-controller")
        assert stack.wait_exit(controller, timeout_s=300) == 0, stack.all_log_tails()
    lines = [
        json.loads(x)
        for x in (tmp_path / "pvc" / "smoke-fleetrl-controller" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [m["step"] for m in lines] == [1, 2]
    assert lines[-1]["producer/rows_failed"] == 0 and lines[-1]["train/kl_ref"] >= 0
    final = tmp_path / "pvc" / "smoke-fleetrl-trainer" / "final"
    assert (final / "config.json").exists() and (final / "model.safetensors").exists()
    assert (
        "healthy: SERVING" in (tmp_path / f"{next(p.name for p in pods if 'gateway' in p.role)}.init-0.log").read_text()
    )


def test_a_lora_run_starts_inference_serving_adapters_of_its_rank():
    """lora_rank > 0: every inference replica gets --max-lora-rank <rank>, which the launcher accepts; full
    fine-tuning passes no such flag (LoRA off)."""
    from fleetrl.services.inference.launcher import build_parser, config_from_args

    def inference_args(values: dict) -> list[str]:
        manifests = render_chart(values, name="r")
        validate_all(manifests)
        pod = by_kind(manifests, "StatefulSet")["r-fleetrl-inference"]["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        return [str(a) for a in container["args"]]

    args = inference_args({"run": {"config": {"lora_rank": 8}}})
    assert args[args.index("--max-lora-rank") + 1] == "8"
    assert config_from_args(build_parser().parse_args(args[2:])).max_lora_rank == 8  # after `serve inference`
    assert "--max-lora-rank" not in inference_args({})


def test_every_series_gets_the_run_label_from_the_pods():
    """Each pod carries fleetrl.io/run (run.name, else the release name) and the ServiceMonitor turns it into the
    `run` label the Grafana dashboard's $run variable selects: two releases in one Prometheus stay apart."""
    for values, expected in (({}, "demo"), ({"run": {"name": "gsm8k-lr3e-6"}}, "gsm8k-lr3e-6")):
        manifests = render_chart({**values, "serviceMonitor": {"enabled": True}}, name="demo")
        pods = [m for kind in ("Deployment", "StatefulSet") for m in by_kind(manifests, kind).values()]
        assert pods
        for workload in pods:
            assert workload["spec"]["template"]["metadata"]["labels"]["fleetrl.io/run"] == expected
            assert "fleetrl.io/run" not in workload["spec"]["selector"]["matchLabels"]  # selectors stay immutable
        (monitor,) = by_kind(manifests, "ServiceMonitor").values()
        for endpoint in monitor["spec"]["endpoints"]:
            relabel = {"sourceLabels": ["__meta_kubernetes_pod_label_fleetrl_io_run"], "targetLabel": "run"}
            assert relabel in endpoint["relabelings"]
        validate_all(manifests)
