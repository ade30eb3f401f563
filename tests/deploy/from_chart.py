"""The Helm chart, rendered by Helm's own engine (helm-python-sdk), as local services: each pod of each
workload (Job, Deployment, StatefulSet) with its containers' command and args, environment (Secret references
resolved from the rendered Secret, the downward API's pod IP and name), volume mounts and readiness probes.

    manifests = render_chart(values, name="smoke")
    services, init = chart_services(manifests, workdir, entrypoint)

Volumes become folders: a ConfigMap or Secret volume is written out from the rendered object, a PVC is a
folder per claim (shared by every pod mounting it, as a ReadWriteMany claim), an emptyDir a folder per pod, a
hostPath the path itself. Kubernetes DNS names a pod is reached by (a Service selecting it alone, `<pod>.<service>`
and `<pod>.<service>.<namespace>.svc` under a StatefulSet's headless Service) become the pod's loopback address; a
StatefulSet's pods carry the `statefulset.kubernetes.io/pod-name` label its controller adds. `$(VAR)` in command
and args is expanded from the container's env, as the kubelet does. Init containers run to completion before
their pod's main container starts.
"""

from __future__ import annotations

import base64
import re
from pathlib import Path
from typing import Any

import yaml

from tests.deploy.localstack import REPO, LocalService, Probe

CHART = REPO / "k8s" / "fleetrl"
WORKLOADS = ("Job", "Deployment", "StatefulSet")
NAMESPACE = "rl"
POD_NAME_LABEL = "statefulset.kubernetes.io/pod-name"


def render_chart(values: dict[str, Any] | None = None, name: str = "fleetrl", namespace: str = NAMESPACE) -> list[dict]:
    """Every manifest the chart renders (NOTES.txt left out), through Helm's Go template engine."""
    import helm_python as helm

    with helm.Chart.load(str(CHART)) as chart:
        rendered = chart.render(values or {}, name=name, namespace=namespace, is_install=True)
    docs = []
    for path, text in sorted(rendered.items()):
        if path.endswith(".yaml"):
            docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


def values_file(path: Path) -> dict[str, Any]:
    import helm_python as helm

    return helm.values_from_yaml(path.read_text())


def by_kind(manifests: list[dict], kind: str) -> dict[str, dict]:
    return {m["metadata"]["name"]: m for m in manifests if m["kind"] == kind}


def _selects(service: dict, labels: dict[str, str]) -> bool:
    selector = service["spec"].get("selector") or {}
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def _write_items(folder: Path, data: dict[str, str], items: list[dict] | None) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for item in items or [{"key": k, "path": k} for k in data]:
        target = folder / item["path"]
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(data[item["key"]])


def _volume_folder(volume: dict, pod: str, manifests: list[dict], workdir: Path) -> str:
    name = volume["name"]
    if "configMap" in volume:
        config_map = by_kind(manifests, "ConfigMap")[volume["configMap"]["name"]]
        folder = workdir / "pods" / pod / "volumes" / name
        _write_items(folder, config_map.get("data") or {}, volume["configMap"].get("items"))
        return str(folder)
    if "secret" in volume:
        secret = by_kind(manifests, "Secret")[volume["secret"]["secretName"]]
        folder = workdir / "pods" / pod / "volumes" / name
        _write_items(folder, _secret_data(secret), volume["secret"].get("items"))
        return str(folder)
    if "persistentVolumeClaim" in volume:
        folder = workdir / "pvc" / volume["persistentVolumeClaim"]["claimName"]
    elif "emptyDir" in volume:
        folder = workdir / "pods" / pod / "volumes" / name
    elif "hostPath" in volume:
        return volume["hostPath"]["path"]
    else:
        raise ValueError(f"volume {name} of pod {pod}: unsupported source {sorted(volume)}")
    folder.mkdir(parents=True, exist_ok=True)
    return str(folder)


def _secret_data(secret: dict) -> dict[str, str]:
    data = {k: base64.b64decode(v).decode() for k, v in (secret.get("data") or {}).items()}
    data.update(secret.get("stringData") or {})
    return data


def _env(container: dict, manifests: list[dict], pod: str) -> dict[str, str]:
    env = {}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = str(var["value"])
            continue
        source = var["valueFrom"]
        if "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            secret = by_kind(manifests, "Secret").get(ref["name"])
            if secret is None or ref["key"] not in _secret_data(secret):
                if ref.get("optional"):  # a Secret made outside the chart (existingSecret): unset, as in a pod
                    continue
                raise ValueError(f"{pod}: env {var['name']}: Secret {ref['name']} has no key {ref['key']}")
            env[var["name"]] = _secret_data(secret)[ref["key"]]
        elif "fieldRef" in source and source["fieldRef"]["fieldPath"] == "metadata.name":
            env[var["name"]] = pod
        elif "fieldRef" in source and source["fieldRef"]["fieldPath"] == "status.podIP":
            env[var["name"]] = "0.0.0.0"  # the pod's own address: rewritten to its loopback address
        else:
            raise ValueError(f"{pod}: env {var['name']} from {source} is not supported here")
    return env


def _port_number(container: dict, port: int | str) -> int:
    if isinstance(port, int):
        return port
    for p in container.get("ports", []):
        if p.get("name") == port:
            return int(p["containerPort"])
    raise ValueError(f"container {container['name']} has no port named {port!r}")


def _probe(container: dict) -> Probe | None:
    probe = container.get("readinessProbe") or container.get("startupProbe")
    if probe is None:
        return None
    if "grpc" in probe:
        return Probe("grpc", port=_port_number(container, probe["grpc"]["port"]))
    if "httpGet" in probe:
        http = probe["httpGet"]
        return Probe("http", port=_port_number(container, http["port"]), path=http.get("path", "/"))
    if "exec" in probe:
        return Probe("exec", argv=list(probe["exec"]["command"]))
    raise ValueError(f"container {container['name']}: unsupported probe {sorted(probe)}")


def _pods(workload: dict, namespace: str = NAMESPACE) -> list[tuple[str, list[str]]]:
    """(pod name, extra DNS names) of each replica: StatefulSet pods get `<pod>.<serviceName>` and its
    `.<namespace>.svc` form."""
    name, kind, spec = workload["metadata"]["name"], workload["kind"], workload["spec"]
    if kind == "Job":
        return [(f"{name}-job", [])]
    replicas = int(spec.get("replicas", 1))
    if kind == "StatefulSet":
        return [
            (pod, [f"{pod}.{spec['serviceName']}", f"{pod}.{spec['serviceName']}.{namespace}.svc"])
            for pod in (f"{name}-{i}" for i in range(replicas))
        ]
    return [(f"{name}-{i}", []) for i in range(replicas)]


def _pod_labels(workload: dict, pod: str) -> dict[str, str]:
    """The pod's labels: the template's, plus the pod-name label a StatefulSet's controller adds."""
    labels = dict(workload["spec"]["template"]["metadata"].get("labels", {}))
    if workload["kind"] == "StatefulSet":
        labels[POD_NAME_LABEL] = pod
    return labels


def _expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' `$(VAR)` expansion in command and args: a defined variable is replaced, `$$` is a `$`, an
    undefined reference stays as written."""
    return re.sub(
        r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
        lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)),
        text,
    )


def _container_service(
    container: dict, pod_spec: dict, pod: str, manifests: list[dict], workdir: Path, entrypoint: list[str]
) -> LocalService:
    volumes = {v["name"]: v for v in pod_spec.get("volumes", [])}
    mounts = {}
    for mount in container.get("volumeMounts", []):
        folder = _volume_folder(volumes[mount["name"]], pod, manifests, workdir)
        mounts[mount["mountPath"]] = str(Path(folder) / mount["subPath"]) if mount.get("subPath") else folder
    env = _env(container, manifests, pod)
    command = [_expand(str(a), env) for a in container.get("command") or []]
    argv = (command or list(entrypoint)) + [_expand(str(a), env) for a in container.get("args", [])]
    return LocalService(name=pod, argv=argv, env=env, mounts=mounts, probe=_probe(container))


def chart_services(
    manifests: list[dict], workdir: Path, entrypoint: list[str], namespace: str = NAMESPACE
) -> tuple[list[LocalService], dict[str, list[LocalService]]]:
    """One LocalService per pod (its single main container) and, per pod, its init containers in order. A
    Service's name reaches a pod when the Service selects that pod alone (no load balancing here)."""
    services = list(by_kind(manifests, "Service").values())
    workloads = [m for m in manifests if m["kind"] in WORKLOADS]
    all_pods = [(w, pod, dns) for w in workloads for pod, dns in _pods(w, namespace)]
    selected: dict[str, list[str]] = {}  # Service name -> the pods it selects
    for s in services:
        selected[s["metadata"]["name"]] = [pod for w, pod, _ in all_pods if _selects(s, _pod_labels(w, pod))]
    pods: list[LocalService] = []
    inits: dict[str, list[LocalService]] = {}
    for workload in workloads:
        pod_spec = workload["spec"]["template"]["spec"]
        (main, *sidecars) = pod_spec["containers"]
        if sidecars:
            raise ValueError(f"{workload['metadata']['name']}: one container per pod expected")
        for pod, dns in _pods(workload, namespace):
            names = [name for name, chosen in selected.items() if chosen == [pod]]
            service = _container_service(main, pod_spec, pod, manifests, workdir, entrypoint)
            service.role = workload["metadata"]["name"]
            service.hostnames = dns + names
            pods.append(service)
            inits[pod] = [
                _container_service(c, pod_spec, pod, manifests, workdir, entrypoint)
                for c in pod_spec.get("initContainers", [])
            ]
    return pods, inits
