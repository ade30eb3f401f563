"""`fleetrl up` attached to a running run (`[up] controller_address`): a gateway that exits because that run's
controller stopped answering (EXIT_CONTROLLER_LOST) is not restarted: the run is over or gone, and the next
gateway would only wait again (issue 28: a sidecar restarted gateway-r1, gateway-r2, ... until its test timed out).
"""

from __future__ import annotations

import io
import subprocess
import sys

import pytest

from fleetrl.exit_codes import EXIT_CONTROLLER_LOST
from fleetrl.up.config import UpConfig
from fleetrl.up.progress import Progress
from fleetrl.up.run import _watch
from fleetrl.up.supervisor import Child, ServiceFailed, Supervisor


def test_an_attached_gateway_whose_controller_is_gone_is_not_restarted(tmp_path):
    sup = Supervisor(tmp_path)
    process = subprocess.Popen([sys.executable, "-c", f"import sys; sys.exit({EXIT_CONTROLLER_LOST})"])
    process.wait()
    gateway = Child(
        "gateway-0", "gateway", ["python", "-m", "fleetrl", "serve", "gateway"], tmp_path / "g.log", process
    )
    sup.children.append(gateway)
    up = UpConfig.from_dict({"rollout": "m:f", "controller_address": "127.0.0.1:1"}, "test")
    progress = Progress(tmp_path / "metrics.jsonl", None, stream=io.StringIO())
    with pytest.raises(ServiceFailed, match=r"controller at 127\.0\.0\.1:1 stopped answering"):
        _watch(sup, None, [gateway], [], up, progress, [])
    assert sup.children == [gateway]  # no gateway-r1
