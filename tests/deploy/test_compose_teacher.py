"""docker-compose.yml with a distillation teacher (issue 32 part 2): FLEETRL_TEACHER_DIR is mounted at
/models/teacher in every fleetrl container (a run.toml's `teacher_model = "/models/teacher"` then resolves in the
trainer's colocated reference too), and FLEETRL_REFERENCE_MODEL makes the reference service (cpu and gpu) serve the
teacher, checking its tokenizer against the student's (/models/base) at start. Unset: the base model, as before."""

from __future__ import annotations

from tests.deploy.conftest import COMPOSE_FILE
from tests.deploy.from_compose import REPO, load_compose
from tests.deploy.test_compose import env_example, reference_config


def test_the_reference_service_serves_the_teacher_the_env_names() -> None:
    services = load_compose(COMPOSE_FILE, env_example())["services"]
    for name in ("reference", "reference-gpu"):
        config = reference_config(services[name]["command"])
        assert (config.model, config.student_model) == ("/models/base", "/models/base")
    env = env_example() | {"FLEETRL_REFERENCE_MODEL": "/models/teacher", "FLEETRL_TEACHER_DIR": "./models/teacher"}
    services = load_compose(COMPOSE_FILE, env)["services"]
    for name in ("reference", "reference-gpu"):
        config = reference_config(services[name]["command"])
        assert (config.model, config.student_model) == ("/models/teacher", "/models/base")
    for name in ("trainer", "reference", "trainer-gpu"):
        assert f"{REPO}/models/teacher:/models/teacher:ro" in services[name]["volumes"]
