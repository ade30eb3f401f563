"""The Helm chart k8s/fleetrl: rendered by Helm's own engine (helm-python-sdk) for the default values and the
scaled GPU values file, every manifest validated against the Kubernetes schemas (kubernetes-validate), the values
schema, Pod Security "restricted", tokens from Secrets, alerts and dashboard, the rows from a volume or a URL,
and the rendered pods' container commands run as local processes to train two steps."""

from __future__ import annotations

import copy
import hashlib
import json
import re
import subprocess
from pathlib import Path

import pytest

from tests.deploy.from_chart import CHART, WORKLOADS, by_kind, chart_services, render_chart, values_file
from tests.deploy.from_compose import dockerfile_entrypoint
from tests.deploy.localstack import REPO, LocalService, LocalStack
from tests.deploy.pod_security import restricted_violations

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
            # CRDs: their schemas ship with prometheus-operator, not Kubernetes
            {"ServiceMonitor": check_service_monitor, "PrometheusRule": check_prometheus_rule}[manifest["kind"]](
                manifest
            )
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


def check_prometheus_rule(manifest: dict) -> None:
    """The fields prometheus-operator's PrometheusRule CRD requires, with their types."""
    assert manifest["apiVersion"] == "monitoring.coreos.com/v1"
    for group in manifest["spec"]["groups"]:
        assert isinstance(group["name"], str) and group["rules"]
        for rule in group["rules"]:
            assert set(rule) <= {"alert", "record", "expr", "for", "labels", "annotations", "keep_firing_for"}
            assert isinstance(rule["alert"], str) and isinstance(rule["expr"], str)
            assert all(isinstance(v, str) for v in {**rule.get("labels", {}), **rule.get("annotations", {})}.values())


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
    service = {"run": {"config": {"kl_beta": 0.01}}, "reference": {"placement": "service"}}
    full = render_chart(service, name="full")  # full fine-tuning keeps a reference service where one is asked for
    assert "full-fleetrl-reference" in by_kind(full, "Deployment")
    lora = render_chart({**values, "reference": {"placement": "service"}}, name="lora")
    assert not [m for m in lora if m["metadata"]["name"].endswith("-reference")]  # but LoRA needs none


def test_the_scaled_values_train_float32_master_weights_with_bfloat16_compute():
    """At lr 1e-6 pure bfloat16 rounds most updates away (docs/trainer.md): the scaled values keep float32 master
    weights (and AdamW state) and compute in bfloat16, and push in bfloat16."""
    from fleetrl import Config

    config = Config(**values_file(SCALED)["run"]["config"])
    assert config.dtype == "float32" and config.compute_dtype in ("auto", "bfloat16")
    assert config.inference_dtype == "bfloat16" and config.learning_rate <= 1e-5


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
    # kl_beta 0.001 > 0: the reference is a frozen copy in the 8 ranks, no pod of its own.
    assert main["args"][main["args"].index("--reference") + 1] == "local"
    assert not [m for m in scaled_manifests if m["metadata"]["name"].endswith("-reference")]
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

    for values in ({}, values_file(SCALED), multi_node_values(values_file(SCALED), sharding="hsdp")):
        report = helm.lint(str(CHART), values, strict=True, kube_version="v1.30.0")
        errors = [m for m in report["messages"] if m["severity"] >= 2]
        assert not errors and not report["errors"], json.dumps(report, indent=1)


def write_rows(path: Path, n: int = 24) -> str:
    """A JSONL rows file; returns its sha256."""
    path.write_text("".join(json.dumps({"prompt": f"count {i} to {i + 3}:"}) + "\n" for i in range(n)))
    return hashlib.sha256(path.read_bytes()).hexdigest()


def smoke_values(model_dir: str, rows_url: str, rows_sha256: str) -> dict:
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
        "run": {
            "config": config,
            "rollout": "tests.integration.up.rollouts:make_rollout_fn",
            "data": {"source": "url", "url": rows_url, "sha256": rows_sha256},
        },
        "inference": {"engine": "hf", "extraArgs": []},
        "controller": {"metricsLingerSeconds": 1},
        "gateway": {"autoscaling": {"enabled": False}, "replicas": 1, "metricsLingerSeconds": 1},
    }


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("trainer_nodes", [1, 2])
def test_chart_pods_train_two_steps(tmp_path: Path, tiny_model_dir: str, free_port: int, trainer_nodes: int):
    """Every pod the chart renders, its container's command as written (image entrypoint + args), started at
    once as Kubernetes would; the controller's init container downloads the rows (a file:// URL standing for
    the web) and checks their sha256, the gateway's holds it until the stack serves. With 2 trainer nodes: two
    torchrun agents (pods) meet at pod 0, the controller trains through the Service selecting pod 0 (rank 0), and
    both ranks checkpoint to the shared claim. The KL reference (kl_beta > 0): a reference pod with one node
    (reference.placement service), a frozen copy in the two trainer ranks with two (the default placement)."""
    rows = tmp_path / "served" / "train.jsonl"
    rows.parent.mkdir()
    sha256 = write_rows(rows)
    values = smoke_values(tiny_model_dir, rows.as_uri(), sha256)
    if trainer_nodes > 1:
        values["trainer"] = {"nodes": trainer_nodes, "rendezvousPort": free_port}
    else:
        values["reference"] = {"placement": "service"}
    manifests = render_chart(values, name="smoke")
    entrypoint = dockerfile_entrypoint(REPO / "docker" / "Dockerfile.cpu")
    pods, inits = chart_services(manifests, tmp_path, entrypoint)
    components = {"controller", "gateway", "inference", "trainer"} | ({"reference"} if trainer_nodes == 1 else set())
    assert {p.role for p in pods} == {f"smoke-fleetrl-{c}" for c in components}
    with LocalStack(pods, tmp_path, first_address=40) as stack:
        stack.start_pods(inits, timeout_s=240)
        controller = next(p.name for p in pods if p.role == "smoke-fleetrl-controller")
        assert stack.wait_exit(controller, timeout_s=300) == 0, stack.all_log_tails()
    lines = [
        json.loads(x)
        for x in (tmp_path / "pvc" / "smoke-fleetrl-controller" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [m["step"] for m in lines] == [1, 2]
    assert lines[-1]["producer/rows_failed"] == 0 and lines[-1]["train/kl_ref"] > 0  # the policy left the reference
    final = tmp_path / "pvc" / "smoke-fleetrl-trainer" / "final"
    assert (final / "config.json").exists() and (final / "model.safetensors").exists()
    assert (
        "healthy: SERVING" in (tmp_path / f"{next(p.name for p in pods if 'gateway' in p.role)}.init-0.log").read_text()
    )
    assert f"sha256 {sha256}" in (tmp_path / f"{controller}.init-0.log").read_text()
    if trainer_nodes > 1:
        logs = [(tmp_path / f"smoke-fleetrl-trainer-{i}.log").read_text() for i in range(trainer_nodes)]
        assert "rank 0/2: process group up" in logs[0] and "rank 1/2: process group up" in logs[1], logs[0][-2000:]
        shards = {p.name for p in (tmp_path / "pvc" / "smoke-fleetrl-trainer").glob("step-*/*.distcp")}
        assert shards == {"__0_0.distcp", "__1_0.distcp"}  # each rank's DCP shard, on the one shared claim


def reference_layout(values: dict) -> tuple[str | None, list[str] | None, list[str]]:
    """The trainer's --reference, the reference pod's args (None: no reference manifests), and what the gateway's
    init container waits for."""
    manifests = render_chart(values, name="r")
    validate_all(manifests)
    deployments = by_kind(manifests, "Deployment")
    (trainer,) = deployments["r-fleetrl-trainer"]["spec"]["template"]["spec"]["containers"]
    args = [str(a) for a in trainer["args"]]
    reference = args[args.index("--reference") + 1] if "--reference" in args else None
    named = [m for m in manifests if m["metadata"]["name"] == "r-fleetrl-reference"]
    pod = deployments["r-fleetrl-reference"]["spec"]["template"]["spec"] if named else None
    assert not named or {m["kind"] for m in named} == {"Deployment", "Service"}
    (init,) = deployments["r-fleetrl-gateway"]["spec"]["template"]["spec"]["initContainers"]
    waits = [str(a) for a in init["command"]]
    return reference, [str(a) for a in pod["containers"][0]["args"]] if pod else None, waits


def test_the_reference_runs_in_the_trainer_unless_placed_in_a_service():
    """reference.placement trainer (default): kl_beta > 0 gives the trainer --reference local and renders no
    reference Deployment or Service, and gateways wait for none; placement service: the Service's address, a pod
    on the trainer's device kind and compute dtype (reference.gpus); `enabled` still decides whether there is a
    reference at all."""
    from fleetrl.services.reference.launcher import build_parser, config_from_args

    kl = {"run": {"config": {"kl_beta": 0.01}}}
    reference, pod, waits = reference_layout(kl)
    assert reference == "local" and pod is None and not any("reference" in a for a in waits)
    reference, pod, waits = reference_layout({**kl, "reference": {"placement": "service"}})
    assert reference == "r-fleetrl-reference:50061" and "r-fleetrl-reference:50061" in waits
    config = config_from_args(build_parser().parse_args(pod[2:]))
    assert (config.device, config.dtype) == ("cpu", "float32")  # a CPU trainer's compute dtype
    gpu = {**kl, "trainer": {"gpus": 4}, "reference": {"placement": "service", "gpus": 1}}
    config = config_from_args(build_parser().parse_args(reference_layout(gpu)[1][2:]))
    assert (config.device, config.dtype) == ("cuda", "bfloat16")  # compute_dtype auto on a GPU trainer
    fp32 = {**gpu, "run": {"config": {"kl_beta": 0.01, "compute_dtype": "float32"}}}
    assert config_from_args(build_parser().parse_args(reference_layout(fp32)[1][2:])).dtype == "float32"
    for placement in ("trainer", "service"):
        off = {**kl, "reference": {"placement": placement, "enabled": False}}
        assert reference_layout(off)[:2] == (None, None)
        forced = {"run": {"config": {"kl_beta": 0.0}}, "reference": {"placement": placement, "enabled": True}}
        assert reference_layout(forced)[0] == ("local" if placement == "trainer" else "r-fleetrl-reference:50061")


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


def test_inference_serves_the_dtype_the_trainer_publishes_in():
    """--dtype is run.config.inference_dtype, else run.config.dtype, else float32: a replica refuses weights of
    another dtype than it serves, so a chart that got this wrong would fail every push."""
    from fleetrl.services.inference.launcher import build_parser, config_from_args

    def dtype(config: dict) -> str:
        manifests = render_chart({"run": {"config": config}}, name="r")
        pod = by_kind(manifests, "StatefulSet")["r-fleetrl-inference"]["spec"]["template"]["spec"]
        args = [str(a) for a in pod["containers"][0]["args"]]
        return config_from_args(build_parser().parse_args(args[2:])).dtype

    assert dtype({}) == "float32"
    assert dtype({"dtype": "bfloat16"}) == "bfloat16"
    assert dtype({"dtype": "float32", "inference_dtype": "bfloat16"}) == "bfloat16"


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


# --- values.schema.json -------------------------------------------------------------------------------------


def render_error(values: dict) -> str:
    """The message Helm fails with when rendering these values (the test fails when it renders)."""
    import helm_python as helm

    with pytest.raises(helm.HelmError) as failure:
        render_chart(values, name="bad")
    return str(failure.value)


@pytest.mark.parametrize(
    ("values", "named"),
    [
        ({"inferance": {"replicas": 2}}, "'inferance' not allowed"),
        ({"inference": {"replica": 2}}, "at '/inference': additional properties 'replica' not allowed"),
        (
            {"gateway": {"autoscaling": {"maxReplica": 4}}},
            "at '/gateway/autoscaling': additional properties 'maxReplica'",
        ),
        ({"run": {"data": {"sorce": "url"}}}, "at '/run/data': additional properties 'sorce' not allowed"),
        ({"run": {"rows": '{"prompt": "1+1="}'}}, "at '/run': additional properties 'rows' not allowed"),  # removed
        ({"run": {"config": {"learnig_rate": 1e-6}}}, "invalid propertyName 'learnig_rate'"),
    ],
)
def test_a_misspelt_key_fails_rendering_naming_it(values: dict, named: str):
    assert named in render_error(values)


@pytest.mark.parametrize(
    ("values", "named"),
    [
        ({"inference": {"replicas": "two"}}, "at '/inference/replicas': got string, want integer"),
        ({"serviceMonitor": {"enabled": "yes"}}, "at '/serviceMonitor/enabled': got string, want boolean"),
        ({"trainer": {"grpcPort": 70000}}, "at '/trainer/grpcPort'"),
        ({"run": {"data": {"source": "s3"}}}, "at '/run/data/source'"),
        ({"run": {"data": {"source": "url"}}}, "at '/run/data/url': minLength"),  # url source without a URL
        ({"run": {"data": {"source": "volume"}}}, "at '/run/data/claimName': minLength"),
        ({"run": {"data": {"source": "url", "url": "https://x/r.jsonl", "sha256": "abc"}}}, "at '/run/data/sha256'"),
        ({"inference": {"relayPort": "5573"}}, "at '/inference/relayPort': got string, want integer"),
        ({"inference": {"relayPort": 0}}, "at '/inference/relayPort'"),  # fixed: 0 (pick) cannot be declared
        ({"clusterDomain": "Cluster Local"}, "at '/clusterDomain'"),
        ({"reference": {"placement": "gpu"}}, "at '/reference/placement'"),
        ({"reference": {"placement": "service", "gpus": 2}}, "at '/reference/gpus'"),  # the service runs on one
    ],
)
def test_a_wrong_type_or_value_fails_rendering_naming_the_key(values: dict, named: str):
    assert named in render_error(values)


def test_both_shipped_values_files_pass_the_schema():
    import helm_python as helm

    with helm.Chart.load(str(CHART)) as chart:
        assert chart.schema is not None
        chart.validate_schema(values_file(CHART / "values.yaml"))
        chart.validate_schema(chart.merge_values(values_file(SCALED)))


def test_every_level_of_the_schema_rejects_unknown_keys():
    """Each object the schema spells out (properties) closes it with additionalProperties: false; the open ones
    are Kubernetes objects (checked by the API server) and string maps (labels, files)."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    open_objects = []

    def walk(node: dict, where: str) -> None:
        if "properties" in node and node.get("additionalProperties") is not False:
            open_objects.append(where)
        for key, child in node.get("properties", {}).items():
            walk(child, f"{where}/{key}")

    walk(schema, "")
    assert not open_objects, open_objects


def test_run_config_keys_are_fleetrl_config_fields():
    """run.config's key names in the schema are fleetrl.Config's fields: a new field needs its name added."""
    from fleetrl import Config

    schema = json.loads((CHART / "values.schema.json").read_text())
    names = schema["properties"]["run"]["properties"]["config"]["propertyNames"]["enum"]
    assert sorted(names) == sorted(Config.model_fields)


# --- Pod Security "restricted", the ServiceAccount ---------------------------------------------------------


def everything_values() -> dict:
    """Every optional part on: GPUs, the reference, rows from a URL, tokens, alerts, dashboard, gpu-scaled."""
    return {
        **values_file(SCALED),
        "run": {
            **values_file(SCALED)["run"],
            "data": {"source": "url", "url": "https://example.com/rows/train.jsonl"},
        },
        "secrets": {"wandbApiKey": "wandb-secret-value", "hfToken": "hf_secret_value"},
        "reference": {**values_file(SCALED)["reference"], "placement": "service", "gpus": 1},
    }


def pod_specs(manifests: list[dict]) -> dict[str, dict]:
    return {m["metadata"]["name"]: m["spec"]["template"]["spec"] for m in manifests if m["kind"] in WORKLOADS}


@pytest.mark.parametrize("case", ["default", "scaled", "everything"])
def test_every_pod_meets_pod_security_restricted(case: str):
    values = {"default": {}, "scaled": values_file(SCALED), "everything": everything_values()}[case]
    manifests = render_chart(values, name="psa")
    pods = pod_specs(manifests)
    assert len(pods) >= 4
    problems = {name: restricted_violations(pod) for name, pod in pods.items()}
    assert not {k: v for k, v in problems.items() if v}, problems
    for name, pod in pods.items():
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, name
        assert pod["securityContext"]["runAsUser"] == 10001 and pod["securityContext"]["fsGroup"] == 10001


def test_the_restricted_check_catches_each_weakening(default_manifests):
    """restricted_violations is not a no-op: each weakened field is reported."""
    pod = copy.deepcopy(pod_specs(default_manifests)["demo-fleetrl-trainer"])
    assert restricted_violations(pod) == []
    container = pod["containers"][0]
    container["securityContext"]["allowPrivilegeEscalation"] = True
    container["securityContext"]["capabilities"] = {"drop": ["NET_RAW"], "add": ["SYS_ADMIN"]}
    container["securityContext"]["readOnlyRootFilesystem"] = False
    del pod["securityContext"]["seccompProfile"], container["securityContext"]["seccompProfile"]
    pod["securityContext"]["runAsNonRoot"] = False
    del container["securityContext"]["runAsNonRoot"]
    pod["volumes"].append({"name": "host", "hostPath": {"path": "/"}})
    problems = "\n".join(restricted_violations(pod))
    for rule in (
        "allowPrivilegeEscalation",
        "drop ALL",
        "adds capabilities",
        "root filesystem",
        "seccomp",
        "runAsNonRoot",
        "volume host",
    ):
        assert rule in problems, rule


def test_writable_paths_are_empty_dirs_over_a_read_only_root(default_manifests):
    """/tmp, $HOME (Hugging Face and vLLM caches) and /var/lib/fleetrl (the run's log folder) are writable in
    every main container; /dev/shm is an in-memory emptyDir for inference and trainer."""
    for name, pod in pod_specs(default_manifests).items():
        volumes = {v["name"]: v for v in pod["volumes"]}
        mounts = {m["mountPath"]: m for m in pod["containers"][0]["volumeMounts"]}
        for path in ("/tmp", "/home/fleetrl", "/var/lib/fleetrl"):
            assert "emptyDir" in volumes[mounts[path]["name"]] and not mounts[path].get("readOnly"), (name, path)
        if name.endswith(("-inference", "-trainer")):
            assert volumes[mounts["/dev/shm"]["name"]]["emptyDir"]["medium"] == "Memory"
        run = mounts.get("/var/lib/fleetrl/run")
        if name.endswith("-controller"):
            assert "persistentVolumeClaim" in volumes[run["name"]]  # the ledger and metrics.jsonl survive


def test_every_pod_runs_as_the_release_service_account_without_a_token(default_manifests):
    (account,) = by_kind(default_manifests, "ServiceAccount").values()
    assert account["metadata"]["name"] == "demo-fleetrl" and account["automountServiceAccountToken"] is False
    for name, pod in pod_specs(default_manifests).items():
        assert pod["serviceAccountName"] == "demo-fleetrl" and pod["automountServiceAccountToken"] is False, name
    manifests = render_chart({"serviceAccount": {"create": False, "name": "rl-runner"}}, name="demo")
    assert not by_kind(manifests, "ServiceAccount")
    assert {p["serviceAccountName"] for p in pod_specs(manifests).values()} == {"rl-runner"}


# --- Secrets for tracker and hub tokens ---------------------------------------------------------------------


def container_env(pod: dict, container: str) -> dict[str, dict]:
    (found,) = [c for c in [*pod.get("initContainers", []), *pod["containers"]] if c["name"] == container]
    return {e["name"]: e for e in found.get("env", [])}


def test_tokens_reach_the_pods_that_need_them_from_a_secret_never_a_config_map(tmp_path: Path):
    manifests = render_chart(everything_values(), name="tok")
    validate_all(manifests)
    secret = by_kind(manifests, "Secret")["tok-fleetrl-tokens"]
    assert {k: base64_text(v) for k, v in secret["data"].items()} == {
        "WANDB_API_KEY": "wandb-secret-value",
        "HF_TOKEN": "hf_secret_value",
    }
    for config_map in by_kind(manifests, "ConfigMap").values():
        text = json.dumps(config_map)
        assert "wandb-secret-value" not in text and "hf_secret_value" not in text
    pods = pod_specs(manifests)
    ref = {"secretKeyRef": {"name": "tok-fleetrl-tokens", "key": "WANDB_API_KEY"}}
    assert container_env(pods["tok-fleetrl-controller"], "controller")["WANDB_API_KEY"]["valueFrom"] == ref
    hf = {"secretKeyRef": {"name": "tok-fleetrl-tokens", "key": "HF_TOKEN"}}
    assert container_env(pods["tok-fleetrl-controller"], "fetch-rows")["HF_TOKEN"]["valueFrom"] == hf
    assert container_env(pods["tok-fleetrl-gateway"], "gateway")["HF_TOKEN"]["valueFrom"] == hf
    for name, pod in pods.items():  # no token where nothing uses it
        for container in pod["containers"]:
            env = container_env(pod, container["name"])
            assert ("WANDB_API_KEY" in env) == name.endswith("-controller"), name
            assert ("HF_TOKEN" in env) == name.endswith("-gateway"), name
            assert all("value" not in e for k, e in env.items() if k in ("WANDB_API_KEY", "HF_TOKEN"))
    local, _ = chart_services(manifests, tmp_path, ["fleetrl"])  # as the pod sees it: the Secret's value
    assert next(p for p in local if p.role == "tok-fleetrl-controller").env["WANDB_API_KEY"] == "wandb-secret-value"


def test_tokens_from_an_existing_secret_and_none_at_all(default_manifests, tmp_path: Path):
    manifests = render_chart(
        {"secrets": {"existingSecret": "team-tokens", "wandbApiKeyKey": "wandb", "hfTokenKey": "hf"}}, name="ex"
    )
    validate_all(manifests)
    assert "ex-fleetrl-tokens" not in by_kind(manifests, "Secret")
    pods = pod_specs(manifests)
    wandb = container_env(pods["ex-fleetrl-controller"], "controller")["WANDB_API_KEY"]["valueFrom"]
    assert wandb == {"secretKeyRef": {"name": "team-tokens", "key": "wandb", "optional": True}}
    hf = container_env(pods["ex-fleetrl-gateway"], "gateway")["HF_TOKEN"]["valueFrom"]
    assert hf == {"secretKeyRef": {"name": "team-tokens", "key": "hf", "optional": True}}
    local, _ = chart_services(manifests, tmp_path, ["fleetrl"])  # optional and absent: the variable is unset
    assert "WANDB_API_KEY" not in next(p for p in local if p.role == "ex-fleetrl-controller").env
    assert set(by_kind(default_manifests, "Secret")) == {"demo-fleetrl-auth"}
    for pod in pod_specs(default_manifests).values():
        env = container_env(pod, pod["containers"][0]["name"])
        assert not {"WANDB_API_KEY", "HF_TOKEN"} & set(env)


def base64_text(value: str) -> str:
    import base64

    return base64.b64decode(value).decode()


# --- PrometheusRule and the Grafana dashboard ---------------------------------------------------------------

PROMQL_WORDS = {
    "up", "time", "resets", "increase", "rate", "max_over_time", "sum", "by", "and", "or", "unless", "on",
    "namespace", "run", "kind", "outcome", "app_kubernetes_io_component",
}  # fmt: skip


def exported_by_services(name: str) -> bool:
    """A fleetrl series name is documented in docs/metrics.md (checked against a live scrape of every service
    by test_metrics_docs.py) and its metric module names it (services/<service>/metrics.py)."""
    from tests.deploy.test_metrics_docs import documented_names

    service = name.split("_")[1]
    source = (REPO / "services" / service / "metrics.py").read_text()
    rest = name.removeprefix(f"fleetrl_{service}_").removesuffix("_total")
    return name in documented_names() and re.search(rf'["_]{re.escape(rest)}"', source) is not None


def rule_spec(values: dict | None = None, name: str = "demo") -> dict:
    manifests = render_chart({"prometheusRule": {"enabled": True}, **(values or {})}, name=name)
    (rule,) = by_kind(manifests, "PrometheusRule").values()
    check_prometheus_rule(rule)
    return rule["spec"]


def test_prometheus_rule_is_off_by_default_and_alerts_on_exported_metrics(default_manifests):
    assert not by_kind(default_manifests, "PrometheusRule")
    spec = rule_spec({"inference": {"replicas": 3}, "run": {"name": "gsm8k"}})
    rules = {r["alert"]: r for group in spec["groups"] for r in group["rules"]}
    for alert in ("FleetrlControllerDown", "FleetrlNoTrainingStep", "FleetrlInferenceReplicaMissing",
                  "FleetrlTrainerMissing", "FleetrlTargetDown"):  # fmt: skip
        assert alert in rules, alert
    assert (
        'fleetrl_controller_members{namespace="rl", run="gsm8k", kind="inference"} < 3'
        in (rules["FleetrlInferenceReplicaMissing"]["expr"])
    )
    assert rules["FleetrlNoTrainingStep"]["expr"].endswith("> 900")
    for alert, rule in rules.items():
        assert 'run="gsm8k"' in rule["expr"] and 'namespace="rl"' in rule["expr"], alert  # this run only
        names = set(re.findall(r"\b[a-z_][a-z0-9_]*\b", re.sub(r'"[^"]*"|\[[^]]*\]', "", rule["expr"])))
        metrics = {n for n in names if n.startswith("fleetrl_")}
        assert names - metrics <= PROMQL_WORDS, (alert, names - metrics)
        for metric in metrics:
            assert exported_by_services(metric), f"{alert}: {metric} is not exported by the services"
    assert not exported_by_services("fleetrl_controller_run_failed")  # the check can fail


def test_prometheus_rule_passes_promtool_and_fires(tmp_path: Path):
    """promtool checks the rendered groups and unit-tests two alerts on this run's series: a missing inference
    replica (2 of 3) for 5 minutes, and no step for noStepMinutes; another run's series never fire them."""
    import shutil

    if shutil.which("promtool") is None:
        pytest.skip("promtool is not installed (Debian package prometheus: see docs/deploy.md, 'Checks')")
    spec = rule_spec({"inference": {"replicas": 3}, "prometheusRule": {"enabled": True, "noStepMinutes": 10}})
    rules = tmp_path / "rules.yml"
    rules.write_text(json.dumps(spec))
    check = subprocess.run(["promtool", "check", "rules", str(rules)], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    this, other = 'namespace="rl", run="demo"', 'namespace="rl", run="other"'
    tests = {
        "rule_files": [str(rules)],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [
                    {"series": f'fleetrl_controller_members{{{this}, kind="inference"}}', "values": "3 3 2x10"},
                    {"series": f'fleetrl_controller_members{{{other}, kind="inference"}}', "values": "1x12"},
                    {"series": f"fleetrl_controller_last_step_timestamp_seconds{{{this}}}", "values": "0x20"},
                ],
                "alert_rule_test": [
                    {"eval_time": "5m", "alertname": "FleetrlInferenceReplicaMissing", "exp_alerts": []},
                    {
                        "eval_time": "9m",
                        "alertname": "FleetrlInferenceReplicaMissing",
                        "exp_alerts": [
                            {
                                "exp_labels": {
                                    "severity": "warning",
                                    "namespace": "rl",
                                    "run": "demo",
                                    "kind": "inference",
                                },
                                "exp_annotations": {
                                    "summary": "Fewer inference replicas than the 3 deployed",
                                    "description": "Only 2 of run demo's 3 inference replicas have been live members of"
                                    " the controller for 5 minutes: a replica is down, restarting or cannot reach the"
                                    " controller. Rollouts go to the others.",
                                },
                            }
                        ],
                    },
                    {"eval_time": "9m", "alertname": "FleetrlNoTrainingStep", "exp_alerts": []},
                    {
                        "eval_time": "12m",
                        "alertname": "FleetrlNoTrainingStep",
                        "exp_alerts": [
                            {
                                "exp_labels": {"severity": "critical", "namespace": "rl", "run": "demo"},
                                "exp_annotations": {
                                    "summary": "No training step for 10 minutes",
                                    "description": "Run demo finished its last step 12m 0s ago (or started that long"
                                    " ago without one). fleetrl_controller_rollout_queue_depth and"
                                    " fleetrl_controller_rows_in_flight show whether rows are being worked on.",
                                },
                            }
                        ],
                    },
                ],
            }
        ],
    }
    test_file = tmp_path / "rules.test.yml"
    test_file.write_text(json.dumps(tests))
    result = subprocess.run(["promtool", "test", "rules", str(test_file)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_grafana_dashboard_config_map_carries_the_repo_dashboard(default_manifests):
    assert not [m for m in default_manifests if "grafana_dashboard" in m["metadata"]["labels"]]
    manifests = render_chart(
        {"grafanaDashboard": {"enabled": True, "annotations": {"grafana_folder": "fleetrl"}}}, name="demo"
    )
    validate_all(manifests)
    (dashboard,) = [m for m in manifests if m["metadata"]["labels"].get("grafana_dashboard") == "1"]
    assert dashboard["kind"] == "ConfigMap" and dashboard["metadata"]["annotations"] == {"grafana_folder": "fleetrl"}
    repo_dashboard = REPO / "monitoring" / "grafana" / "dashboards" / "fleetrl.json"
    assert json.loads(dashboard["data"]["fleetrl.json"]) == json.loads(repo_dashboard.read_text())


# --- The prompt rows: a volume or a URL ---------------------------------------------------------------------


def controller_service(manifests: list[dict], workdir: Path):
    """(LocalStack, the controller's LocalService, its init containers) from the rendered chart."""
    pods, inits = chart_services(manifests, workdir, dockerfile_entrypoint(REPO / "docker" / "Dockerfile.cpu"))
    stack = LocalStack(pods, workdir, first_address=200)
    controller = next(p for p in pods if p.role.endswith("-controller"))
    return stack, controller, inits[controller.name]


def rows_argument(stack: LocalStack, controller) -> Path:
    """The --rows file of the controller's command, with its container paths turned into local folders."""
    argv = stack.command(controller)
    return Path(argv[argv.index("--rows") + 1])


def test_rows_from_an_existing_volume(tmp_path: Path):
    """source volume: the claim is mounted read-only and --rows names the file in it; the rows are no
    ConfigMap's data."""
    values = {"run": {"data": {"source": "volume", "claimName": "datasets", "claimPath": "gsm8k/train.jsonl"}}}
    manifests = render_chart(values, name="vol")
    validate_all(manifests)
    pod = pod_specs(manifests)["vol-fleetrl-controller"]
    data = next(v for v in pod["volumes"] if v["name"] == "data")
    assert data["persistentVolumeClaim"] == {"claimName": "datasets", "readOnly": True}
    mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "data")
    assert mount == {"name": "data", "mountPath": "/var/lib/fleetrl/data", "readOnly": True}
    stack, controller, inits = controller_service(manifests, tmp_path)
    assert not inits
    on_claim = tmp_path / "pvc" / "datasets" / "gsm8k" / "train.jsonl"  # what from_chart mounts for the claim
    on_claim.parent.mkdir(parents=True)
    sha = write_rows(on_claim, n=3)
    rows = rows_argument(stack, controller)
    assert hashlib.sha256(rows.read_bytes()).hexdigest() == sha  # the claim's file, through the mount
    assert all("rows" not in key for cm in by_kind(manifests, "ConfigMap").values() for key in cm["data"])


def test_rows_from_a_url_are_fetched_and_checked_by_an_init_container(tmp_path: Path):
    """source url: the controller's init container downloads the URL (file:// here) into the data emptyDir that
    the controller mounts read-only; a wrong sha256 fails it and leaves no file for the controller."""
    served = tmp_path / "served" / "train.jsonl"
    served.parent.mkdir()
    sha = write_rows(served, n=5)
    for expected, code in ((sha, 0), ("0" * 64, 1)):
        workdir = tmp_path / f"run-{code}"
        values = {"run": {"data": {"source": "url", "url": served.as_uri(), "sha256": expected.upper()}}}
        manifests = render_chart(values, name="url")
        validate_all(manifests)
        stack, controller, inits = controller_service(manifests, workdir)
        (fetch,) = inits
        fetch.address = controller.address
        result = subprocess.run(
            stack.command(fetch), env=stack.environment(fetch), cwd=REPO, capture_output=True, text=True, timeout=60
        )
        assert result.returncode == code, result.stdout + result.stderr
        rows = rows_argument(stack, controller)
        assert rows.name == "train.jsonl"
        if code == 0:
            assert rows.read_bytes() == served.read_bytes() and f"sha256 {sha}" in result.stdout
        else:
            assert not rows.exists() and "expected " + "0" * 64 in result.stderr
            assert not list(rows.parent.iterdir())  # no partial file either


def test_a_url_source_opens_egress_to_its_port_only_for_the_controller():
    for url, port in (("https://huggingface.co/datasets/x/resolve/main/a.parquet", 443),
                      ("http://minio.data:9000/rows/a.jsonl", 9000)):  # fmt: skip
        manifests = render_chart({"run": {"data": {"source": "url", "url": url}}}, name="eg")
        validate_all(manifests)
        policy = by_kind(manifests, "NetworkPolicy")["eg-fleetrl-fetch-rows"]["spec"]
        assert policy["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "controller"
        assert policy["egress"] == [{"ports": [{"port": port, "protocol": "TCP"}]}]
        args = pod_specs(manifests)["eg-fleetrl-controller"]["containers"][0]["args"]
        assert args[args.index("--rows") + 1] == "/var/lib/fleetrl/data/" + url.rsplit("/", 1)[1]
    manifests = render_chart({"run": {"data": {"source": "url", "url": "file:///opt/rows.jsonl"}}}, name="eg")
    assert "eg-fleetrl-fetch-rows" not in by_kind(manifests, "NetworkPolicy")


# --- A multi-node trainer, tensor-parallel inference replicas ------------------------------------------------


def multi_node_values(base: dict | None = None, **trainer: object) -> dict:
    base = copy.deepcopy(base or {})
    base["trainer"] = {**base.get("trainer", {}), "nodes": 2, **trainer}
    return base


def trainer_objects(manifests: list[dict], name: str) -> tuple[dict, dict, dict, dict]:
    """(the StatefulSet, its headless Service, the rank-0 Service, the checkpoint claim) of a multi-node trainer."""
    trainer = f"{name}-fleetrl-trainer"
    assert trainer not in by_kind(manifests, "Deployment")
    services = by_kind(manifests, "Service")
    return (
        by_kind(manifests, "StatefulSet")[trainer],
        services[f"{trainer}-nodes"],
        services[trainer],
        by_kind(manifests, "PersistentVolumeClaim")[trainer],
    )


def torchrun_flags(container: dict) -> dict[str, str]:
    """The torchrun flags of the container's command, as torch's own parser reads them."""
    from torch.distributed.run import get_args_parser

    command = container["command"]
    assert command[:3] == ["tini", "--", "torchrun"], command
    args = get_args_parser().parse_args(command[3:])
    assert (args.module, args.training_script) == (True, "fleetrl.services.trainer.launcher")
    return vars(args)


@pytest.mark.parametrize("case", ["cpu", "scaled"])
def test_a_multi_node_trainer_is_a_stateful_set_meeting_at_pod_0(case: str):
    """nodes = 2: a StatefulSet of two pods (all at once), each a torchrun agent meeting at pod 0's stable name
    through the headless Service; the controller's and gateways' trainer Service selects pod 0 (rank 0) alone;
    the checkpoint claim is shared (ReadWriteMany); every manifest is valid and every pod `restricted`."""
    values = multi_node_values() if case == "cpu" else multi_node_values(values_file(SCALED), sharding="hsdp")
    manifests = render_chart(values, name="mn")
    validate_all(manifests)
    problems = {name: restricted_violations(pod) for name, pod in pod_specs(manifests).items()}
    assert not {k: v for k, v in problems.items() if v}, problems
    sts, headless, rank0, claim = trainer_objects(manifests, "mn")
    assert sts["spec"]["replicas"] == 2 and sts["spec"]["podManagementPolicy"] == "Parallel"
    assert sts["spec"]["serviceName"] == "mn-fleetrl-trainer-nodes"
    pod_labels = sts["spec"]["template"]["metadata"]["labels"]
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is True
    assert headless["spec"]["selector"] == sts["spec"]["selector"]["matchLabels"]
    assert [p["name"] for p in headless["spec"]["ports"]] == ["rendezvous"]  # no metrics: not scraped twice
    assert rank0["spec"]["selector"] == {
        **sts["spec"]["selector"]["matchLabels"],
        "statefulset.kubernetes.io/pod-name": "mn-fleetrl-trainer-0",
    }
    assert all(pod_labels.get(k) == v for k, v in sts["spec"]["selector"]["matchLabels"].items())
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    flags = torchrun_flags(container)
    procs, gpus = (1, 0) if case == "cpu" else (8, 8)
    assert flags["nnodes"] == "2" and flags["nproc_per_node"] == str(procs)
    assert flags["rdzv_backend"] == "c10d" and flags["rdzv_id"] == "mn-fleetrl-trainer"
    assert flags["rdzv_endpoint"] == "mn-fleetrl-trainer-0.mn-fleetrl-trainer-nodes.rl.svc:29400"
    assert flags["local_addr"] == "$(POD_NAME).mn-fleetrl-trainer-nodes.rl.svc"  # pod 0's sorts first: rank 0
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert container["resources"].get("limits", {}).get("nvidia.com/gpu", 0) == gpus
    args = [str(a) for a in container["args"]]
    assert args[args.index("--device") + 1] == ("cpu" if case == "cpu" else "cuda")
    assert args[args.index("--advertise-host") + 1] == "mn-fleetrl-trainer"  # the rank-0 Service
    from fleetrl.services.trainer.launcher import build_parser

    assert build_parser().parse_args(args).sharding == ("fsdp" if case == "cpu" else "hsdp")  # the launcher's flags
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["rendezvous"] == 29400
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):  # rank 0's health, from every pod
        command = container[probe]["exec"]["command"]
        assert command[-1] == "mn-fleetrl-trainer-0.mn-fleetrl-trainer-nodes.rl.svc:50071", probe
    controller = pod_specs(manifests)["mn-fleetrl-controller"]["containers"][0]["args"]
    assert controller[controller.index("--trainer") + 1] == "mn-fleetrl-trainer:50071"


def test_a_multi_node_trainer_runs_as_local_pods_with_pod_0_behind_the_trainer_service(tmp_path: Path):
    """As the pods would run it (from_chart): the rank-0 Service's name is pod 0's alone, the rendezvous and
    probes name pod 0 through the headless Service, and each agent's --local-addr is its own pod's name."""
    manifests = render_chart(multi_node_values(procsPerNode=2, sharding="hsdp"), name="mn")
    pods, _ = chart_services(manifests, tmp_path, ["fleetrl"])
    nodes = sorted((p for p in pods if p.role == "mn-fleetrl-trainer"), key=lambda p: p.name)
    assert [p.name for p in nodes] == ["mn-fleetrl-trainer-0", "mn-fleetrl-trainer-1"]
    stack = LocalStack(pods, tmp_path, first_address=80)
    assert stack.addresses["mn-fleetrl-trainer"] == nodes[0].address
    assert stack.addresses["mn-fleetrl-trainer-1.mn-fleetrl-trainer-nodes.rl.svc"] == nodes[1].address
    for node in nodes:
        argv = stack.command(node)
        assert argv[argv.index("--rdzv-endpoint") + 1] == f"{nodes[0].address}:29400"
        assert argv[argv.index("--local-addr") + 1] == node.address
        assert node.probe is not None and node.probe.kind == "exec"
        probe = stack.command(LocalService(node.name, node.probe.argv, address=node.address))
        assert probe[-1] == f"{nodes[0].address}:50071"


def test_one_trainer_node_keeps_the_deployment():
    """nodes = 1 (the default): the Deployment, its one Service, a ReadWriteOnce claim, no torchrun rendezvous;
    procsPerNode > 1 on CPU runs torchrun --standalone, gpusPerNode overrides gpus."""
    manifests = render_chart({}, name="one")
    assert "one-fleetrl-trainer-nodes" not in by_kind(manifests, "Service")
    assert by_kind(manifests, "PersistentVolumeClaim")["one-fleetrl-trainer"]["spec"]["accessModes"] == [
        "ReadWriteOnce"
    ]
    pod = pod_specs(manifests)["one-fleetrl-trainer"]
    assert by_kind(manifests, "Deployment")["one-fleetrl-trainer"]["spec"]["strategy"] == {"type": "Recreate"}
    assert "command" not in pod["containers"][0] and "--sharding" not in pod["containers"][0]["args"]
    manifests = render_chart({"trainer": {"procsPerNode": 2, "gpusPerNode": 2, "gpus": 0}}, name="one")
    validate_all(manifests)
    (container,) = pod_specs(manifests)["one-fleetrl-trainer"]["containers"]
    assert container["command"][:6] == ["tini", "--", "torchrun", "--standalone", "--nproc-per-node", "2"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 2


@pytest.mark.parametrize(
    ("values", "named"),
    [
        ({"trainer": {"sharding": "hsdp"}}, "trainer.sharding hsdp needs trainer.nodes > 1"),
        ({"trainer": {"nodes": 2, "sharding": "hsdp"}}, "and trainer.procsPerNode > 1 (has 2 x 1)"),
        ({"trainer": {"gpusPerNode": 2, "procsPerNode": 4}}, "trainer.procsPerNode (4) is above"),
        ({"trainer": {"nodes": 0}}, "at '/trainer/nodes'"),
        ({"trainer": {"sharding": "ddp"}}, "at '/trainer/sharding'"),
        ({"inference": {"engine": "hf", "tensorParallelSize": 2}}, "at '/inference/tensorParallelSize': value must"),
        ({"inference": {"tensorParallelSize": 2}}, "tensorParallelSize 2 needs inference.gpus > 0"),
    ],
)
def test_an_impossible_layout_fails_rendering(values: dict, named: str):
    assert named in render_error(values)


def test_tensor_parallel_replicas_ask_for_their_gpus():
    """inference.tensorParallelSize: --tensor-parallel-size on every replica, which the launcher reads, and
    gpus x tensorParallelSize GPUs each; 1 (the default) passes no flag."""
    from fleetrl.services.inference.launcher import build_parser, config_from_args

    values = values_file(SCALED)
    values["inference"] = {**values["inference"], "tensorParallelSize": 4}
    manifests = render_chart(values, name="tp")
    validate_all(manifests)
    (container,) = pod_specs(manifests)["tp-fleetrl-inference"]["containers"]
    args = [str(a) for a in container["args"]]
    assert args[args.index("--tensor-parallel-size") + 1] == "4"
    assert config_from_args(build_parser().parse_args(args[2:])).tensor_parallel_size == 4
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 4
    (container,) = pod_specs(render_chart(values_file(SCALED), name="tp"))["tp-fleetrl-inference"]["containers"]
    assert "--tensor-parallel-size" not in container["args"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1


@pytest.mark.integration
@pytest.mark.slow
def test_two_trainer_pods_meet_and_rank_0_serves_from_pod_0(tmp_path: Path, tiny_model_dir: str, free_port: int):
    """The two trainer pods' commands as written (torchrun agents, c10d at pod 0 through the headless name), each
    pod on its own loopback address: both become ready by their probe (rank 0's health through the headless
    name), and rank 0 serves gRPC on pod 0's address, the one the rank-0 Service names; pod 1 serves nothing."""
    from fleetrl.commands.health import ProbeError, check_grpc

    config = {"max_seq_len": 64, "max_completion_tokens": 8, "kl_beta": 0.0, "seed": 0}
    values = {
        "model": {"volume": {"hostPath": {"path": tiny_model_dir, "type": "Directory"}}},
        "run": {"config": config},
        "trainer": {"nodes": 2, "rendezvousPort": free_port},
    }
    manifests = render_chart(values, name="mn")
    pods, _ = chart_services(manifests, tmp_path, dockerfile_entrypoint(REPO / "docker" / "Dockerfile.cpu"))
    nodes = sorted((p for p in pods if p.role == "mn-fleetrl-trainer"), key=lambda p: p.name)
    with LocalStack(nodes, tmp_path, first_address=60) as stack:
        assert stack.addresses["mn-fleetrl-trainer-0.mn-fleetrl-trainer-nodes.rl.svc"] == nodes[0].address
        stack.start()  # no init containers, no order: both agents at once
        for node in nodes:
            stack.wait_healthy(node.name, timeout_s=240)
        assert check_grpc(f"{nodes[0].address}:50071") == "SERVING"
        with pytest.raises(ProbeError):
            check_grpc(f"{nodes[1].address}:50071", timeout_s=2)
    first, second = ((tmp_path / f"{node.name}.log").read_text() for node in nodes)
    assert "rank 0/2: process group up" in first and "'world_size': 2" in first, first[-2000:]
    assert "rank 1/2: process group up" in second and "trainer serving" not in second, second[-2000:]


# --- Relayed weight pushes: the replicas' relay ports --------------------------------------------------------


def labels_match(selector: dict, labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in (selector.get("matchLabels") or {}).items())


def policy_admits(policy: dict, source: dict[str, str], target: dict[str, str], port: int) -> bool:
    """Whether the NetworkPolicy spec lets a pod labelled `source` open TCP `port` on one labelled `target`
    (ingress at the target, egress at the source; podSelector peers, numeric ports)."""

    def allows(rules: list[dict], peer: dict[str, str]) -> bool:
        return any(
            any(labels_match(p.get("podSelector", {}), peer) for p in rule.get("from", rule.get("to", [])))
            and (not rule.get("ports") or any(p["port"] == port for p in rule["ports"]))
            for rule in rules
        )

    selected = labels_match(policy["podSelector"], target) and labels_match(policy["podSelector"], source)
    return selected and allows(policy["ingress"], source) and allows(policy["egress"], target)


@pytest.mark.parametrize("values", [{}, {"inference": {"relayPort": 6001}, "clusterDomain": "k8s.example"}])
def test_inference_replicas_reach_each_others_weight_relay(values: dict):
    """Every replica runs --relay-port (the launcher reads it), declares it (containerPort, the headless
    Service), the NetworkPolicy lets replicas open it on each other, and the name a relay advertises (the pod's
    hostname, its pod name) resolves for peers: the pods search the headless Service's domain, under which the
    StatefulSet's pods are named."""
    from fleetrl.services.inference.launcher import build_parser, config_from_args

    port = values.get("inference", {}).get("relayPort", 5573)
    domain = values.get("clusterDomain", "cluster.local")
    manifests = render_chart({**values, "inference": {"replicas": 3, **values.get("inference", {})}}, name="relay")
    validate_all(manifests)
    statefulset = by_kind(manifests, "StatefulSet")["relay-fleetrl-inference"]
    pod = statefulset["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    args = [str(a) for a in container["args"]]
    assert config_from_args(build_parser().parse_args(args[2:])).relay_port == port
    assert {"name": "relay", "containerPort": port} in container["ports"]
    service = by_kind(manifests, "Service")["relay-fleetrl-inference"]["spec"]
    assert service["clusterIP"] == "None" and {"name": "relay", "port": port, "targetPort": "relay"} in service["ports"]
    assert statefulset["spec"]["serviceName"] == "relay-fleetrl-inference"  # pods: <pod>.relay-fleetrl-inference
    assert pod["spec"]["dnsConfig"] == {"searches": [f"relay-fleetrl-inference.rl.svc.{domain}"]}
    labels = pod["metadata"]["labels"]
    assert labels_match({"matchLabels": service["selector"]}, labels)
    policy = by_kind(manifests, "NetworkPolicy")["relay-fleetrl"]["spec"]
    assert policy_admits(policy, labels, labels, port)
    assert not policy_admits(policy, {"app": "elsewhere"}, labels, port)  # the check can say no


def test_a_weight_fanout_reaches_the_controller_through_run_config():
    """weight_fanout is a run key: run.config carries it into run.toml, which the controller's --config reads."""
    import tomllib

    from fleetrl import Config

    manifests = render_chart({"run": {"config": {"weight_fanout": "chain"}}}, name="fan")
    run_toml = tomllib.loads(by_kind(manifests, "ConfigMap")["fan-fleetrl-config"]["data"]["run.toml"])["run"]
    assert Config(**run_toml).weight_fanout == "chain"
    args = pod_specs(manifests)["fan-fleetrl-controller"]["containers"][0]["args"]
    assert args[args.index("--config") + 1] == "/etc/fleetrl/run/run.toml"
