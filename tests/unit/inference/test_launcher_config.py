"""The inference launcher and InferenceConfig: flags, TOML, validation, fast --help (no sockets)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fleetrl.services.inference.config import InferenceConfig, InferenceConfigError
from fleetrl.services.inference.launcher import build_parser, config_from_args, main


def test_flags_override_the_toml_file(tmp_path: Path) -> None:
    path = tmp_path / "inference.toml"
    path.write_text('[inference]\nmodel = "/m"\nengine = "hf"\ngrpc_port = 1234\nseed = 7\n')
    args = build_parser().parse_args(["--config", str(path), "--grpc-port", "0", "--no-http"])
    config = config_from_args(args)
    assert (config.model, config.engine, config.grpc_port, config.seed) == ("/m", "hf", 0, 7)
    assert config.http_port is None and config.metrics_port == 9400
    assert config.host == "127.0.0.1"  # loopback unless asked


def test_defaults() -> None:
    config = InferenceConfig(model="/models/tiny")
    assert config.engine == "vllm" and config.model_name == "tiny"
    assert (config.grpc_port, config.http_port, config.metrics_port) == (50051, 8000, 9400)


def test_replica_settings_default_to_the_device_and_pass_from_flags() -> None:
    config = InferenceConfig(model="/m")  # None: the device decides when the engine starts (replica_settings.py)
    assert (config.dtype, config.kv_cache_gib, config.gpu_memory_utilization) == (None, None, None)
    assert (config.enforce_eager, config.max_num_seqs, config.max_model_len) == (None, None, None)
    flags = ["--model", "/m", "--kv-cache-gib", "2.5", "--gpu-memory-utilization", "0.8", "--no-enforce-eager"]
    config = config_from_args(build_parser().parse_args([*flags, "--max-num-seqs", "32", "--max-model-len", "4096"]))
    assert (config.kv_cache_gib, config.gpu_memory_utilization, config.enforce_eager) == (2.5, 0.8, False)
    assert (config.max_num_seqs, config.max_model_len) == (32, 4096)
    assert config_from_args(build_parser().parse_args(["--model", "/m", "--enforce-eager"])).enforce_eager is True


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({"model": "/m", "engine": "tgi"}, "engine"),
        ({"model": "/m", "grpc_port": 70000}, "grpc_port"),
        ({"model": "/m", "grpc_port": 9000, "http_port": 9000}, "ports must differ"),
        ({"model": "/m", "max_num_seqs": 0}, "max_num_seqs"),
        ({"model": "/m", "kv_cache_gib": 0}, "kv_cache_gib"),
        ({"model": "/m", "gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
        ({"model": "/m", "colour": "red"}, "colour"),
        ({}, "model"),
    ],
)
def test_bad_configs_name_the_field(data: dict, field: str) -> None:
    with pytest.raises(InferenceConfigError, match=field):
        InferenceConfig.build(data)


def test_unreadable_toml_is_a_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("model = [unclosed")
    with pytest.raises(InferenceConfigError, match=r"bad\.toml"):
        InferenceConfig.from_toml(bad)


def test_main_refuses_a_missing_model_dir(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["--model", str(tmp_path / "nope"), "--engine", "hf"]) == 2
    assert "no config.json" in capsys.readouterr().err
    assert main([]) == 2


def test_help_is_fast_and_imports_nothing_heavy() -> None:
    code = (
        "import sys\n"
        "from fleetrl.commands.main import main\n"
        "try:\n    main(['serve', 'inference', '--help'])\n"
        "except SystemExit as e:\n    assert e.code == 0\n"
        "heavy = [m for m in ('torch', 'grpc', 'vllm', 'transformers') if m in sys.modules]\n"
        "print('HEAVY', heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "--engine" in out.stdout and "HEAVY []" in out.stdout


def test_controller_and_member_id_flags_join_a_run() -> None:
    args = build_parser().parse_args(["--model", "/m", "--controller", "10.0.0.2:50050", "--member-id", "inference-1"])
    config = config_from_args(args)
    assert (config.controller_address, config.member_id) == ("10.0.0.2:50050", "inference-1")
    assert InferenceConfig(model="/m").controller_address is None  # by default it waits to be named
    with pytest.raises(InferenceConfigError, match="member_id"):
        InferenceConfig.build({"model": "/m", "member_id": "inference-1"})


def test_tool_parser_flags() -> None:
    config = config_from_args(build_parser().parse_args(["--model", "/m", "--tool-call-parser", "llama3_json"]))
    assert (config.tool_call_parser, config.enable_auto_tool_choice) == ("llama3_json", True)
    config = config_from_args(build_parser().parse_args(["--model", "/m", "--tool-call-parser", "none"]))
    assert config.tool_call_parser is None
    config = config_from_args(build_parser().parse_args(["--model", "/m", "--no-auto-tool-choice"]))
    assert (config.tool_call_parser, config.enable_auto_tool_choice) == ("hermes", False)


def test_advertise_host_names_the_replica_for_its_controller_and_its_relay() -> None:
    from fleetrl.services.inference.server import advertised_address, create_server
    from tests.unit.inference.fakes import ScriptedEngine

    argv = ["--model", "/m", "--host", "0.0.0.0", "--advertise-host", "inference-2.fleetrl-inference"]
    config = config_from_args(build_parser().parse_args([*argv, "--grpc-port", "0", "--relay-port", "0"]))
    assert config.advertise_host == "inference-2.fleetrl-inference"
    assert advertised_address("0.0.0.0", 50051, config.advertise_host) == "inference-2.fleetrl-inference:50051"
    assert advertised_address("127.0.0.1", 50051) == "127.0.0.1:50051"  # without it: the bound address
    assert advertised_address("::1", 5573) == "[::1]:5573"

    async def relay_address() -> str:  # the gRPC server and the relay belong to an event loop
        service = create_server(config, ScriptedEngine())
        try:
            assert service.relay is not None
            return service.relay.address
        finally:
            await service.relay.close()
            await service.grpc_server.stop(None)

    assert asyncio.run(relay_address()).startswith("tcp://inference-2.fleetrl-inference:")


def test_the_hf_engine_takes_a_device(tmp_path: Path) -> None:
    """The hf engine ran on the CPU whatever the machine (no device setting): on a GPU machine `fleetrl up`'s hf
    replicas (the GPU check's end-to-end run) computed on the CPU."""
    from fleetrl.services.inference.server import hf_default_device, make_engine

    flags = ["--model", str(tmp_path), "--engine", "hf"]
    config = config_from_args(build_parser().parse_args([*flags, "--device", "cuda:1"]))
    assert config.device == "cuda:1"
    engine = make_engine(config)  # built, not started: no model is loaded
    assert engine._device == torch.device("cuda", 1)
    default = make_engine(config_from_args(build_parser().parse_args(flags)))
    assert str(default._device) == hf_default_device() == ("cuda" if torch.cuda.is_available() else "cpu")


def test_the_kv_cache_policy_across_a_swap_is_a_replica_setting(tmp_path: Path) -> None:
    from fleetrl.services.inference.server import make_engine

    flags = ["--model", str(tmp_path), "--engine", "vllm"]
    assert make_engine(config_from_args(build_parser().parse_args(flags))).kv_on_swap == "recompute"
    keep = config_from_args(build_parser().parse_args([*flags, "--kv-on-swap", "keep"]))
    assert keep.kv_on_swap == "keep" and make_engine(keep).kv_on_swap == "keep"
    with pytest.raises(SystemExit):
        build_parser().parse_args([*flags, "--kv-on-swap", "sometimes"])
