"""docker-compose.yml as local services: the fleetrl containers' commands, environment, mounts, healthchecks and
depends_on exactly as compose resolves them.

    services = compose_services(REPO / "docker-compose.yml", env, profiles={"cpu"}, workdir=tmp, scale={"gateway": 2})

`load_compose` reads the file through compose itself (`docker-compose config`, Debian's docker-compose, which
`scripts/install.sh test` installs) wherever the tool is on PATH, so the tests see what compose sees: YAML merge
keys, variable interpolation, override files and profiles by compose's own code. Only where the tool is absent does
`read_compose` stand in: an in-Python reader that resolves merge keys by the YAML merge rule (in a merge list the
earlier mapping wins: https://yaml.org/type/merge.html, as compose does) with its own loader rather than whatever
the installed PyYAML does (PyYAML 6.0.4 reversed the order), and interpolates variables the way compose does
(`${VAR}`, `${VAR:-default}`, `${VAR-default}`, `${VAR:?error}`, `$$`). tests/deploy/test_compose.py holds the
reader equal to `docker-compose config` on every profile.

More files (`overrides`, as `-f docker-compose.yml -f more.yml`) merge into the first: mappings key by key, a
service's `command` and `entrypoint` replaced; the reader refuses other lists of a service the first file has.
Named volumes become folders under `workdir/volumes/` (shared by every service that mounts them, as a volume
is); bind mounts are the host folders themselves. The image's ENTRYPOINT comes from the service's Dockerfile
unless the service sets `entrypoint`.
Services that do not run the fleetrl image (prometheus, grafana) are left out; `prometheus_config` turns the
Prometheus scrape config into one for these local addresses.
"""

from __future__ import annotations

import copy
import functools
import json
import re
import shutil
import subprocess
import tempfile
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


class _MergeLoader(yaml.SafeLoader):
    """SafeLoader with the YAML merge key resolved by the spec, whatever the installed PyYAML's own rule is: the
    mapping's own keys win over merged ones, and in a merge list (`<<: [*a, *b]`) an earlier mapping wins over a
    later one."""

    def flatten_mapping(self, node: yaml.MappingNode) -> None:
        merged: dict[Any, tuple[yaml.Node, yaml.Node]] = {}
        own: list[tuple[yaml.Node, yaml.Node]] = []
        for key_node, value_node in node.value:
            if key_node.tag != "tag:yaml.org,2002:merge":
                if key_node.tag == "tag:yaml.org,2002:value":
                    key_node.tag = "tag:yaml.org,2002:str"
                own.append((key_node, value_node))
                continue
            sources = value_node.value if isinstance(value_node, yaml.SequenceNode) else [value_node]
            for source in sources:
                if not isinstance(source, yaml.MappingNode):
                    raise ComposeError(f"line {source.start_mark.line + 1}: a merge key takes mappings only")
                self.flatten_mapping(source)
                for pair in source.value:
                    merged.setdefault(self.construct_object(pair[0], deep=True), pair)  # earlier source wins
        own_keys = {self.construct_object(k, deep=True) for k, _ in own}
        node.value = [pair for key, pair in merged.items() if key not in own_keys] + own


def read_compose(path: Path, env: dict[str, str], overrides: tuple[Path, ...] = ()) -> dict[str, Any]:
    """The in-Python reader: the compose file (merged with `overrides`, in order) with YAML merges resolved,
    extension fields dropped and variables interpolated from `env` alone."""
    data: dict[str, Any] = {}
    for file in (path, *overrides):
        more = yaml.load(file.read_text(), Loader=_MergeLoader)
        data = _merge(data, {k: v for k, v in more.items() if not k.startswith("x-")}, "")
    return _as_compose_prints(_interpolate_tree(data, env), path.parent)


def _as_compose_prints(config: dict[str, Any], base: Path) -> dict[str, Any]:
    """The spelling `docker-compose config` prints: build contexts and bind-mount sources absolute, a volume's
    mode (rw) and a port's protocol (tcp) spelled out, `depends_on` as a mapping, a disabled healthcheck as
    `test: [NONE]`, a named volume's empty spec as `{}`."""

    def volume(spec: str) -> str:
        source, target, *mode = spec.split(":")
        if source.startswith("."):
            source = str((base / source).resolve())
        return ":".join([source, target, *(mode or ["rw"])])

    for service in config.get("services", {}).values():
        if isinstance(service.get("build"), dict):
            service["build"]["context"] = str((base / service["build"].get("context", ".")).resolve())
        if "volumes" in service:
            service["volumes"] = [volume(v) for v in service["volumes"]]
        if "ports" in service:
            service["ports"] = [p if "/" in str(p) else f"{p}/tcp" for p in service["ports"]]
        if isinstance(service.get("depends_on"), list):
            service["depends_on"] = {d: {"condition": "service_started"} for d in service["depends_on"]}
        if (service.get("healthcheck") or {}).get("disable"):
            service["healthcheck"] = {"test": ["NONE"]}
    if "volumes" in config:
        config["volumes"] = {name: spec or {} for name, spec in config["volumes"].items()}
    return config


def compose_config(
    path: Path, env: dict[str, str], overrides: tuple[Path, ...] = (), profiles: tuple[str, ...] = ()
) -> dict[str, Any]:
    """`docker-compose config` on the file (and `overrides`) with exactly `env` (no .env file) and `profiles`:
    the configuration compose itself resolves. Raises ComposeError with compose's message if it refuses."""
    key = (str(path), tuple(str(o) for o in overrides), tuple(sorted(env.items())), tuple(profiles))
    return copy.deepcopy(_compose_config(*key))


@functools.lru_cache(maxsize=64)
def _compose_config(
    path: str, overrides: tuple[str, ...], env: tuple[tuple[str, str], ...], profiles: tuple[str, ...]
) -> dict[str, Any]:
    exe = shutil.which("docker-compose")
    if exe is None:
        raise ComposeError("docker-compose is not installed")
    files = [arg for file in (path, *overrides) for arg in ("-f", file)]
    process_env = {"PATH": "/usr/bin:/bin", **dict(env)}
    if profiles:
        process_env["COMPOSE_PROFILES"] = ",".join(profiles)
    with tempfile.TemporaryDirectory() as tmp:
        no_env_file = Path(tmp) / "empty.env"  # compose would read the project's .env otherwise
        no_env_file.write_text("")
        result = subprocess.run(
            [exe, "--project-directory", str(Path(path).parent), "--env-file", str(no_env_file), *files, "config"],
            capture_output=True,
            text=True,
            env=process_env,
            timeout=60,
        )
    if result.returncode != 0:
        raise ComposeError(f"docker-compose config: {result.stderr.strip()}")
    return yaml.safe_load(result.stdout)


def load_compose(
    path: Path, env: dict[str, str], overrides: tuple[Path, ...] = (), profiles: tuple[str, ...] = ()
) -> dict[str, Any]:
    """The compose file as compose resolves it: `docker-compose config` where the tool is installed, else the
    in-Python reader (`read_compose`)."""
    if shutil.which("docker-compose"):
        return compose_config(path, env, overrides, profiles)
    return read_compose(path, env, overrides)


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
    if not test or test == ["NONE"]:
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
    data = load_compose(path, env, overrides, tuple(sorted(profiles)))
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


__all__ = [
    "REPO",
    "ComposeError",
    "compose_config",
    "compose_services",
    "interpolate",
    "load_compose",
    "prometheus_config",
    "read_compose",
]
