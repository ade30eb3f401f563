"""What containers need from the services: the trainer advertising its service name instead of its wildcard
bind address, and the controller's rollout queue depth (the gateway autoscaling signal)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from fleetrl import metric_names as mn
from fleetrl.controller.dataset import DatasetCursor
from fleetrl.controller.gate import OffPolicyGate
from fleetrl.controller.members import MemberRegistry
from fleetrl.controller.scheduler import RowScheduler
from fleetrl.controller.step_sums import StepSums
from fleetrl.services.controller.metrics import ControllerMetrics, rollout_queue_depth
from fleetrl.services.trainer.launcher import build_parser, config_from_args
from fleetrl.services.trainer.server import advertised_endpoint, create_server


def test_advertised_endpoint_replaces_only_the_host():
    assert advertised_endpoint("tcp://0.0.0.0:5571", "trainer") == "tcp://trainer:5571"
    assert advertised_endpoint("tcp://127.0.0.1:5572", None) == "tcp://127.0.0.1:5572"
    assert advertised_endpoint("tcp://0.0.0.0:5571", "fd00::1") == "tcp://[fd00::1]:5571"


async def test_trainer_bound_to_every_interface_advertises_its_service_name(tiny_model_dir):
    # async: the gRPC aio server create_server builds needs a running event loop
    args = build_parser().parse_args(
        [
            *("--model", tiny_model_dir, "--host", "0.0.0.0", "--advertise-host", "trainer", "--set", "kl_beta=0.0"),
            *("--grpc-port", "0", "--groups-port", "0", "--weights-port", "0", "--no-metrics"),
        ]
    )
    config = config_from_args(args)
    assert config.advertise_host == "trainer"
    service = create_server(config)
    try:
        groups, weights = service.groups_address, service.weights_address
        assert groups.startswith("tcp://trainer:") and weights.startswith("tcp://trainer:")
        assert groups.rsplit(":", 1)[1] == service.receiver.address.rsplit(":", 1)[1]  # the bound port
        assert service.addresses()["groups_address"] == groups
    finally:
        service.receiver.stop()
        service.publisher.close()
        service.trainer.close()


def scheduler(rows: int, max_steps: int | None = None, offpolicy: int = 1) -> RowScheduler:
    cursor = DatasetCursor([{"prompt": str(i)} for i in range(rows)], shuffle=False)
    gate = OffPolicyGate(prompt_groups_per_step=2, completions_per_prompt=4, max_head_offpolicy_versions=offpolicy)
    return RowScheduler(cursor, gate, prompt_groups_per_step=2, max_steps=max_steps)


def test_rollout_queue_depth_counts_rows_the_gate_admits_and_nobody_leased():
    s = scheduler(rows=100)
    assert rollout_queue_depth(s) == 4  # (O + 1) * P rows of headroom
    s.lease("g", 3, now=0.0)
    assert rollout_queue_depth(s) == 1
    s.lease("g", 5, now=0.0)
    assert rollout_queue_depth(s) == 0  # the gate is closed until a step is trained
    assert rollout_queue_depth(scheduler(rows=3)) == 3  # no more rows than the data has
    assert rollout_queue_depth(scheduler(rows=100, max_steps=1)) == 2  # nor than max_steps needs
    s = scheduler(rows=3)
    s.lease("g", 3, now=0.0)
    s.report(0, "failed", now=1.0, gateway_id="g")  # back in the queue for a retry
    assert rollout_queue_depth(s) == 1


def test_controller_metrics_export_the_new_names():
    s = scheduler(rows=10)

    class Orchestrator:
        def __init__(self) -> None:
            self.last_metrics = {"async/version_offset_max": 1.0, "perf/train_wait_time": 2.5, "time": 123.0}
            self.step_sums = StepSums()

    registry = CollectorRegistry()
    ControllerMetrics(registry, s, MemberRegistry(), Orchestrator())
    from prometheus_client import generate_latest

    families = {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}
    value = {name: f.samples[0].value for name, f in families.items() if f.samples and not f.samples[0].labels}
    assert value["fleetrl_controller_rollout_queue_depth"] == 4
    assert value["fleetrl_controller_train_wait_seconds"] == 2.5
    assert value["fleetrl_controller_version_offset_max"] == 1.0
    assert value["fleetrl_controller_last_step_timestamp_seconds"] == 123.0
    members = {s.labels["kind"]: s.value for s in families["fleetrl_controller_members"].samples}
    assert members == {"gateway": 0, "inference": 0, "trainer": 0}


def test_learning_curves_are_counters_that_lose_no_step():
    # Three steps between two scrapes: a last-value gauge would show only the third; the counters hold all three,
    # and a negative loss (allowed) never makes a counter go down.
    from prometheus_client import generate_latest

    class Orchestrator:
        def __init__(self) -> None:
            self.last_metrics: dict = {}
            self.step_sums = StepSums()

    registry = CollectorRegistry()
    orchestrator = Orchestrator()
    ControllerMetrics(registry, scheduler(rows=10), MemberRegistry(), orchestrator)
    for reward, loss in ((0.25, 0.5), (0.5, -1.5), (0.75, 0.25)):
        orchestrator.step_sums.add({mn.RAW_REWARD: reward, mn.LOSS: loss, mn.ENTROPY: float("nan")})
    families = {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}
    assert families["fleetrl_controller_steps"].samples[0].value == 3
    count = {s.labels["metric"]: s.value for s in families["fleetrl_controller_step_value_count"].samples}
    assert count == {mn.RAW_REWARD: 3, mn.LOSS: 3}  # a NaN is not a figure
    total = {
        (s.labels["metric"], s.labels["sign"]): s.value
        for s in families["fleetrl_controller_step_value_sum"].samples
        if s.name.endswith("_total")
    }
    assert total == {
        (mn.RAW_REWARD, "positive"): 1.5,
        (mn.RAW_REWARD, "negative"): 0.0,
        (mn.LOSS, "positive"): 0.75,
        (mn.LOSS, "negative"): 1.5,
    }
    assert orchestrator.step_sums.mean(mn.LOSS) == (0.75 - 1.5) / 3  # what the dashboard's ratio of rates gives
