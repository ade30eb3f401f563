"""The weight stream: the trainer publishes state dicts, inference servers fetch them (ZeroMQ).

``publisher`` is the sending end, ``fetch`` the receiving end, ``protocol`` the wire format and
``manifest`` the (pure) manifest, checksums and chunk plan, ``relay`` a replica re-serving a version
to its peers and ``relay_plan`` who fetches from whom.
"""

from fleetrl.weights.errors import WeightTransferError
from fleetrl.weights.fetch import WeightStream, fetch_weights, iter_weights
from fleetrl.weights.manifest import Manifest, TensorSpec, build_manifest
from fleetrl.weights.publisher import WeightPublisher
from fleetrl.weights.relay import WeightRelay
from fleetrl.weights.relay_plan import plan_relay, relay_depth

__all__ = [
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
]
