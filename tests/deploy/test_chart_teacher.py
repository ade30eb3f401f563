"""The Helm chart with a distillation teacher (issue 32 part 2): run.config.teacher_model makes the reference needed
even with kl_beta = 0 (the trainer's --reference local, or the reference service serving the teacher and checking
its tokenizer against model.path at start), and model.teacherVolume is mounted at the teacher's path in the trainer
and reference pods."""

from __future__ import annotations

from tests.deploy.from_chart import by_kind, render_chart
from tests.deploy.test_chart import reference_layout, validate_all

TEACHER = {"run": {"config": {"kl_beta": 0.0, "teacher_model": "/models/teacher"}}}
VOLUME = {"persistentVolumeClaim": {"claimName": "teacher", "readOnly": True}}


def test_a_teacher_needs_the_reference_even_without_kl() -> None:
    reference, pod, _ = reference_layout(TEACHER)
    assert reference == "local" and pod is None  # the trainer's colocated copy loads the teacher itself
    reference, pod, waits = reference_layout({**TEACHER, "reference": {"placement": "service"}})
    assert reference == "r-fleetrl-reference:50061" and pod is not None and "r-fleetrl-reference:50061" in waits
    assert pod[pod.index("--model") + 1] == "/models/teacher"
    assert pod[pod.index("--student-model") + 1] == "/models/base"
    plain = {"run": {"config": {"kl_beta": 0.0}}, "reference": {"placement": "service"}}
    assert reference_layout(plain)[:2] == (None, None)
    kl = {"run": {"config": {"kl_beta": 0.01}}, "reference": {"placement": "service"}}
    pod = reference_layout(kl)[1]
    assert pod[pod.index("--model") + 1] == "/models/base" and "--student-model" not in pod


def test_the_teacher_volume_is_mounted_at_the_teachers_path() -> None:
    values = {**TEACHER, "model": {"teacherVolume": VOLUME}, "reference": {"placement": "service"}}
    manifests = render_chart(values, name="r")
    validate_all(manifests)
    deployments = by_kind(manifests, "Deployment")
    for name in ("r-fleetrl-trainer", "r-fleetrl-reference"):
        spec = deployments[name]["spec"]["template"]["spec"]
        (container,) = spec["containers"]
        mounts = {m["name"]: m for m in container["volumeMounts"]}
        assert mounts["teacher"]["mountPath"] == "/models/teacher" and mounts["teacher"]["readOnly"] is True
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert volumes["teacher"]["persistentVolumeClaim"] == VOLUME["persistentVolumeClaim"]
    default = by_kind(render_chart({}, name="r"), "Deployment")["r-fleetrl-trainer"]["spec"]["template"]["spec"]
    assert "teacher" not in {v["name"] for v in default["volumes"]}
