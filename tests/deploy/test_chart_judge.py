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
    controller = by_kind(manifests, "Job")["r-fleetrl-controller"]["spec"]["template"]["spec"]["containers"]
    assert not any("judge" in a for a in _args(controller[0]))  # never sent weights


def test_an_unknown_judge_key_fails_rendering_naming_it() -> None:
    with pytest.raises(Exception, match="replica"):
        render_chart({"judge": {"enabled": True, "replica": 2}}, name="r")


def test_the_judge_pods_meet_pod_security_restricted() -> None:
    from tests.deploy.pod_security import restricted_violations

    judge = by_kind(render_chart(JUDGE, name="r"), "StatefulSet")["r-fleetrl-judge"]["spec"]["template"]["spec"]
    assert restricted_violations(judge) == []
    assert judge["securityContext"]["runAsUser"] == 10001
