"""The Pod Security Standards' "restricted" profile (https://kubernetes.io/docs/concepts/security/pod-security-standards/)
as a check on one rendered pod spec, plus the read-only root filesystem the chart adds:

    problems = restricted_violations(pod_spec)   # [] when the pod would be admitted under `restricted`

Baseline rules (host namespaces, privileged, capabilities, hostPath, host ports, AppArmor, SELinux, /proc mount,
seccomp, sysctls) and restricted ones (volume types, privilege escalation, non-root, seccomp, dropping ALL).
"""

from __future__ import annotations

from typing import Any

RESTRICTED_VOLUMES = {
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "persistentVolumeClaim",
    "projected",
    "secret",
}
SAFE_SYSCTLS = {
    "kernel.shm_rmid_forced",
    "net.ipv4.ip_local_port_range",
    "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.tcp_syncookies",
    "net.ipv4.ping_group_range",
    "net.ipv4.ip_local_reserved_ports",
    "net.ipv4.tcp_keepalive_time",
    "net.ipv4.tcp_fin_timeout",
    "net.ipv4.tcp_keepalive_intvl",
    "net.ipv4.tcp_keepalive_probes",
}
SELINUX_TYPES = {None, "", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}


def _containers(pod: dict[str, Any]) -> list[dict[str, Any]]:
    return [*pod.get("initContainers", []), *pod.get("containers", []), *pod.get("ephemeralContainers", [])]


def _security_contexts(pod: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    return [("pod", pod.get("securityContext") or {})] + [
        (f"container {c['name']}", c.get("securityContext") or {}) for c in _containers(pod)
    ]


def restricted_violations(pod: dict[str, Any]) -> list[str]:
    """Every rule of the restricted profile (and readOnlyRootFilesystem) that this pod spec breaks."""
    problems: list[str] = []
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(field):
            problems.append(f"{field} is set")
    pod_sc = pod.get("securityContext") or {}
    for sysctl in pod_sc.get("sysctls", []):
        if sysctl["name"] not in SAFE_SYSCTLS:
            problems.append(f"unsafe sysctl {sysctl['name']}")
    for volume in pod.get("volumes", []):
        kinds = set(volume) - {"name"}
        if not kinds <= RESTRICTED_VOLUMES:
            problems.append(f"volume {volume['name']}: type {sorted(kinds)} is not allowed")
    for where, sc in _security_contexts(pod):
        if (sc.get("seLinuxOptions") or {}).get("type") not in SELINUX_TYPES:
            problems.append(f"{where}: SELinux type {sc['seLinuxOptions']['type']}")
        if {"user", "role"} & set(sc.get("seLinuxOptions") or {}):
            problems.append(f"{where}: SELinux user/role set")
        if (sc.get("appArmorProfile") or {}).get("type") == "Unconfined":
            problems.append(f"{where}: AppArmor Unconfined")
        if (sc.get("seccompProfile") or {}).get("type") == "Unconfined":
            problems.append(f"{where}: seccomp Unconfined")
        if sc.get("runAsUser") == 0:
            problems.append(f"{where}: runAsUser 0")
        if sc.get("runAsNonRoot") is False:
            problems.append(f"{where}: runAsNonRoot false")
    pod_seccomp = (pod_sc.get("seccompProfile") or {}).get("type")
    for container in _containers(pod):
        name = f"container {container['name']}"
        sc = container.get("securityContext") or {}
        if sc.get("privileged"):
            problems.append(f"{name}: privileged")
        if sc.get("procMount") not in (None, "Default"):
            problems.append(f"{name}: procMount {sc['procMount']}")
        if any(port.get("hostPort") for port in container.get("ports", [])):
            problems.append(f"{name}: hostPort")
        if sc.get("allowPrivilegeEscalation") is not False:
            problems.append(f"{name}: allowPrivilegeEscalation is not false")
        capabilities = sc.get("capabilities") or {}
        if "ALL" not in capabilities.get("drop", []):
            problems.append(f"{name}: capabilities do not drop ALL")
        if set(capabilities.get("add", [])) - {"NET_BIND_SERVICE"}:
            problems.append(f"{name}: adds capabilities {capabilities['add']}")
        if sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")) is not True:
            problems.append(f"{name}: runAsNonRoot is not true (pod or container)")
        if (sc.get("seccompProfile") or {}).get("type", pod_seccomp) not in ("RuntimeDefault", "Localhost"):
            problems.append(f"{name}: no RuntimeDefault or Localhost seccomp profile (pod or container)")
        if sc.get("readOnlyRootFilesystem") is not True:
            problems.append(f"{name}: root filesystem is writable")
    return problems
