"""docker-compose.yml as local services: the fleetrl containers' commands, environment, mounts, healthchecks and
depends_on exactly as written, variables interpolated the way compose does (`${VAR}`, `${VAR:-default}`,
`${VAR-default}`, `${VAR:?error}`, `$$`).

    services = compose_services(REPO / "docker-compose.yml", env, profiles={"cpu"}, workdir=tmp, scale={"gateway": 2})

More files (`overrides`, as `-f docker-compose.yml -f more.yml`) merge into the first: mappings key by key, a
service's `command` and `entrypoint` replaced; other lists of a service the first file has are refused here.
Named volumes become folders under `workdir/volumes/` (shared by every service that mounts them, as a volume
is); bind mounts are the host folders themselves. The image's ENTRYPOINT comes from the service's Dockerfile
unless the service sets `entrypoint`.
Services that do not run the fleetrl image (prometheus, grafana) are left out; `prometheus_config` turns the
Prometheus scrape config into one for these local addresses.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

from tests.deploy.localstack import REPO, LocalService, Probe

_VAR = re.compile(r"\$(?:(\$)|\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}|([A-Za-z_][A-Za-z0-9_]*))")


class ComposeError(ValueError):
    """The compose file asks for something this translation (or compose itself) refuses."""


def interpolate(text: str, env: dict[str, str]) -> str:
    def sub(m: re.Match[str]) -> str:
        if m.group(1):
            return "$"
        name = m.group(2) or m.group(5)
        op, arg = m.group(3), m.group(4) or ""
        value = env.get(name)
        # With a colon an empty value counts as missing, without one only an unset variable does.
        missing = not value if op in (":-", ":?") else value is None
        if not missing:
            return value or ""
        if op in (":-", "-"):
            return interpolate(arg, env)
        if op in (":?", "?"):
            raise ComposeError(f"required variable {name} is missing a value: {arg}")
        return ""

    return _VAR.sub(sub, text)


def _interpolate_tree(node: Any, env: dict[str, str]) -> Any:
    if isinstance(node, str):
        return interpolate(node, env)
    if isinstance(node, list):
        return [_interpolate_tree(v, env) for v in node]
    if isinstance(node, dict):
        return {k: _interpolate_tree(v, env) for k, v in node.items()}
    return node


REPLACED_LISTS = ("command", "entrypoint")


def _merge(base: Any, override: Any, where: str) -> Any:
    if isinstance(base, dict) and isinstance(override, dict):
        merged = dict(base)
        for key, value in override.items():
            merged[key] = _merge(base[key], value, f"{where}.{key}") if key in base else value
        return merged
    if isinstance(base, list) and where.rsplit(".", 1)[-1] not in REPLACED_LISTS:
        raise ComposeError(f"{where}: merging a list from an override file is not mapped here")
    return override


def load_compose(path: Path, env: dict[str, str], overrides: tuple[Path, ...] = ()) -> dict[str, Any]:
    """The compose file (merged with `overrides`, in order) with YAML merges resolved, extension fields dropped
    and variables interpolated."""
    data: dict[str, Any] = {}
    for file in (path, *overrides):
        more = yaml.safe_load(file.read_text())
        data = _merge(data, {k: v for k, v in more.items() if not k.startswith("x-")}, "")
    return _interpolate_tree(data, env)


def dockerfile_entrypoint(dockerfile: Path) -> list[str]:
    """The JSON-form ENTRYPOINT of a Dockerfile's last stage."""
    entry: list[str] = []
    for line in dockerfile.read_text().splitlines():
        if line.startswith("FROM "):
            entry = []
        elif line.startswith("ENTRYPOINT "):
            entry = json.loads(line.removeprefix("ENTRYPOINT "))
    if not entry:
        raise ComposeError(f"{dockerfile}: no JSON-form ENTRYPOINT in the final stage")
    return entry


def enabled(service: dict[str, Any], profiles: set[str]) -> bool:
    wanted = service.get("profiles")
    return not wanted or bool(set(wanted) & profiles)


def is_fleetrl(service: dict[str, Any]) -> bool:
    build = service.get("build") or {}
    return isinstance(build, dict) and str(build.get("dockerfile", "")).startswith("docker/Dockerfile")


def _mounts(service: dict[str, Any], base: Path, workdir: Path) -> dict[str, str]:
    mounts = {}
    for spec in service.get("volumes", []):
        source, target, *_ = spec.split(":")
        if source.startswith((".", "/")):
            local = (base / source).resolve()
        else:
            local = workdir / "volumes" / source
            local.mkdir(parents=True, exist_ok=True)
        mounts[target] = str(local)
    return mounts


def _probe(service: dict[str, Any]) -> Probe | None:
    test = (service.get("healthcheck") or {}).get("test")
    if not test:
        return None
    if test[0] != "CMD":
        raise ComposeError(f"healthcheck {test!r}: only the exec form [CMD, ...] runs here")
    return Probe("exec", argv=list(test[1:]))


def _depends(service: dict[str, Any]) -> dict[str, str]:
    deps = service.get("depends_on") or {}
    if isinstance(deps, list):
        return dict.fromkeys(deps, "service_started")
    return {name: spec.get("condition", "service_started") for name, spec in deps.items()}


def compose_services(
    path: Path,
    env: dict[str, str],
    profiles: set[str],
    workdir: Path,
    scale: dict[str, int] | None = None,
    overrides: tuple[Path, ...] = (),
) -> list[LocalService]:
    data = load_compose(path, env, overrides)
    base = path.parent
    out: list[LocalService] = []
    for name, service in data["services"].items():
        if not enabled(service, profiles) or not is_fleetrl(service):
            continue
        entrypoint = service.get("entrypoint") or dockerfile_entrypoint(base / service["build"]["dockerfile"])
        command = service.get("command")
        if not isinstance(command, list) or not isinstance(entrypoint, list):
            raise ComposeError(f"{name}: give the command and entrypoint in exec (list) form")
        aliases = [a for net in (service.get("networks") or {}).values() for a in (net or {}).get("aliases", [])]
        count = (scale or {}).get(name, 1)
        for i in range(count):
            out.append(
                LocalService(
                    name=name if count == 1 else f"{name}_{i + 1}",
                    argv=[*entrypoint, *command],
                    env={k: str(v) for k, v in (service.get("environment") or {}).items()},
                    mounts=_mounts(service, base, workdir),
                    hostnames=[name, *aliases] if count == 1 else [],
                    probe=_probe(service),
                    depends_on=_depends(service),
                    role=name,
                )
            )
    return out


def prometheus_config(
    path: Path, addresses: dict[str, list[str]], rules_dir: Path, interval: str = "1s", run: str = "fleetrl"
) -> str:
    """monitoring/prometheus.yml for local processes: service hostnames (static targets, or the A records a
    `dns_sd_configs` entry would resolve) become their loopback addresses; the rule files are read from
    `rules_dir`; scrapes run every `interval` so a short run is seen; the `run` label placeholder becomes `run`,
    as the compose file's Prometheus entrypoint does with $FLEETRL_RUN (default "fleetrl")."""
    config = yaml.safe_load(path.read_text().replace("__FLEETRL_RUN__", run))
    config.setdefault("global", {}).update(
        scrape_interval=interval, scrape_timeout=interval, evaluation_interval=interval
    )
    config["rule_files"] = [str(rules_dir / Path(p).name) for p in config.get("rule_files", [])]
    for job in config["scrape_configs"]:
        targets = []
        for static in job.pop("static_configs", []):
            for target in static["targets"]:
                host, port = target.rsplit(":", 1)
                targets += [f"{a}:{port}" for a in addresses.get(host, [])]
        for dns in job.pop("dns_sd_configs", []):
            if dns.get("type", "SRV") != "A":
                raise ComposeError(f"job {job['job_name']}: only A-record DNS discovery is mapped")
            targets += [f"{a}:{dns['port']}" for name in dns["names"] for a in addresses.get(name, [])]
        job["static_configs"] = [{"targets": targets}]
    return yaml.safe_dump(config, sort_keys=False)


__all__ = ["REPO", "ComposeError", "compose_services", "interpolate", "load_compose", "prometheus_config"]
