"""The trainer's update dict reaches each engine's own parsing (issue 39 item 3, the GPU side).

The trainer adds the version to every engine-group update it sends (`FanoutClient.update_weights`: the replica's
front end labels the update with it, and fleetrl's own "fleetrl_gloo" engine reads it). vLLM's "nccl" update info
has no such field and refuses unknown keys, so before, every nccl update failed in `parse_update_info` and fell back
to the weight stream. The replica now leaves the key out for an engine that does not take it."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferUpdateInfo

from fleetrl.services.inference.vllm_transfer import engine_update_dict
from fleetrl.weights.vllm_gloo import GlooUpdateInfo


def nccl_update(**extra):
    return {"names": ["w"], "dtype_names": ["float32"], "shapes": [[2, 2]], **extra}


def test_the_version_key_is_left_out_for_an_engine_whose_update_info_has_none():
    with pytest.raises((TypeError, ValueError)):
        NCCLWeightTransferUpdateInfo(**nccl_update(version=3))  # what the replica passed on before
    info = NCCLWeightTransferUpdateInfo(**engine_update_dict(NCCLWeightTransferUpdateInfo, nccl_update(version=3)))
    assert info.names == ["w"]


def test_an_engine_that_reads_the_version_keeps_it_and_other_keys_are_still_refused():
    assert engine_update_dict(GlooUpdateInfo, {"version": 3})["version"] == 3
    with pytest.raises(TypeError):
        NCCLWeightTransferUpdateInfo(**engine_update_dict(NCCLWeightTransferUpdateInfo, nccl_update(bogus=1)))
