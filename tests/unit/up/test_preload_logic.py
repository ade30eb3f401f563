"""The preload server's pure rules: which environments may be forked, the child's sys.path, the command form."""

from __future__ import annotations

import os
import signal

import pytest

from fleetrl.up.preload import child_env, child_sys_path, env_blockers, exit_code, parse_module_argv


def test_a_service_env_that_only_adds_runtime_variables_is_forked() -> None:
    server = {"HOME": "/root", "PATH": "/bin"}
    env = {**server, "FLEETRL_AUTH_TOKEN": "t", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "0", "PYTHONPATH": "/x"}
    assert env_blockers(server, env) == []


def test_variables_read_at_import_block_the_fork_whether_set_changed_or_unset() -> None:
    server = {"HOME": "/root", "HF_HOME": "/a", "TOKENIZERS_PARALLELISM": "false"}
    env = {"HOME": "/elsewhere", "HF_HOME": "/a", "TORCH_LOGS": "+dynamo", "PYTHONHASHSEED": "0"}
    assert env_blockers(server, env) == ["HOME", "PYTHONHASHSEED", "TOKENIZERS_PARALLELISM", "TORCH_LOGS"]


def test_a_variable_the_imports_set_is_no_difference_unless_given_another_value() -> None:
    imported = {"TORCHINDUCTOR_CACHE_DIR": "/tmp/torchinductor_root"}
    assert env_blockers({}, {}, imported) == []
    assert env_blockers({}, dict(imported), imported) == []
    assert env_blockers({}, {"TORCHINDUCTOR_CACHE_DIR": "/mine"}, imported) == ["TORCHINDUCTOR_CACHE_DIR"]
    assert child_env({"A": "1"}, imported) == {"A": "1", **imported}
    assert child_env({"TORCHINDUCTOR_CACHE_DIR": "/mine"}, imported) == {"TORCHINDUCTOR_CACHE_DIR": "/mine"}


def test_the_child_path_is_cwd_then_its_pythonpath_then_the_servers_site_path() -> None:
    server_path = ["/server/cwd", "/server/pp1", "/server/pp2", "/usr/lib/python3.11", "/site-packages"]
    path = child_sys_path(server_path, os.pathsep.join(["/server/pp1", "/server/pp2"]), "/run/a:/run/b", "/repo")
    assert path == ["/repo", "/run/a", "/run/b", "/usr/lib/python3.11", "/site-packages"]
    assert child_sys_path(["/s", "/usr/lib"], "", "", "/repo") == ["/repo", "/usr/lib"]


def test_only_python_dash_m_commands_of_the_same_interpreter_are_forked() -> None:
    assert parse_module_argv(["/py", "-m", "fleetrl", "serve", "x"], "/py") == ("fleetrl", ["serve", "x"])
    for argv in (["/other/py", "-m", "fleetrl"], ["/py", "script.py"], ["/py", "-m"], []):
        with pytest.raises(ValueError, match="starts"):
            parse_module_argv(argv, "/py")


def test_exit_codes_read_as_subprocess_does() -> None:
    assert exit_code(3 << 8) == 3
    assert exit_code(signal.SIGKILL) == -signal.SIGKILL
