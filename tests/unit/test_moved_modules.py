"""Modules that moved into their role's package keep their old import paths (fleetrl.moved_modules): the old path
gives the very module at the new one, whichever is imported first."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys

import pytest

from fleetrl.moved_modules import MOVED


@pytest.mark.parametrize(("old", "new"), sorted(MOVED.items()))
def test_an_old_path_imports_the_module_at_its_new_home(old, new):
    moved = importlib.import_module(old)
    assert moved is importlib.import_module(new)
    assert moved.__name__ == moved.__spec__.name == new  # the module keeps its own identity
    assert sys.modules[old] is moved


def test_old_paths_work_in_a_fresh_interpreter_imported_before_their_new_homes():
    code = (
        "import importlib, json, sys\n"
        "from fleetrl.moved_modules import MOVED\n"
        "out = {}\n"
        "for old, new in MOVED.items():\n"
        "    first = importlib.import_module(old)\n"
        "    out[old] = first is importlib.import_module(new) and first.__spec__.name == new\n"
        "from fleetrl.sampler import Sampler\n"
        "from fleetrl.datum import Datum\n"
        "from fleetrl.gate import OffPolicyGate\n"
        "import fleetrl.gateway.sampler as s, fleetrl.trainer.datum as d, fleetrl.controller.gate as g\n"
        "out['names'] = Sampler is s.Sampler and Datum is d.Datum and OffPolicyGate is g.OffPolicyGate\n"
        "print(json.dumps(out))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert seen == {**{old: True for old in MOVED}, "names": True}


def test_a_name_that_never_existed_is_still_an_import_error():
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("fleetrl.no_such_module")
