"""The weight stream: the trainer publishes state dicts, inference servers fetch them (ZeroMQ).

``publisher`` is the sending end, ``fetch`` the receiving end, ``protocol`` the wire format and
``manifest`` the (pure) manifest, checksums and chunk plan, ``relay`` a replica re-serving a version
to its peers, ``relay_plan`` who fetches from whom and ``timeouts`` how long a transfer of so many bytes
may take.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fleetrl.lazy_import import lazy_names
from fleetrl.weights.errors import WeightTransferError
from fleetrl.weights.relay_plan import plan_relay, relay_depth
from fleetrl.weights.timeouts import MIN_TRANSFER_RATE_BYTES_PER_S, transfer_timeout_s

if TYPE_CHECKING:
    from fleetrl.weights.fetch import WeightStream, fetch_weights, iter_weights
    from fleetrl.weights.manifest import Manifest, TensorSpec, build_manifest
    from fleetrl.weights.publisher import WeightPublisher
    from fleetrl.weights.relay import WeightRelay

# The torch and ZeroMQ parts load on first use: the controller plans relays (relay_plan) and never moves a tensor.
_LAZY = {
    "WeightStream": "fetch",
    "fetch_weights": "fetch",
    "iter_weights": "fetch",
    "Manifest": "manifest",
    "TensorSpec": "manifest",
    "build_manifest": "manifest",
    "WeightPublisher": "publisher",
    "WeightRelay": "relay",
}

__getattr__ = lazy_names(__name__, _LAZY)

__all__ = [
    "MIN_TRANSFER_RATE_BYTES_PER_S",
    "Manifest",
    "TensorSpec",
    "WeightPublisher",
    "WeightRelay",
    "WeightStream",
    "WeightTransferError",
    "build_manifest",
    "fetch_weights",
    "iter_weights",
    "plan_relay",
    "relay_depth",
    "transfer_timeout_s",
]
