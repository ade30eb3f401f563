"""Where each replica fetches a pushed version from: ``push_sources``, pure logic (no sockets, no gRPC).

With ``weight_fanout = "direct"`` every replica fetches from the trainer's weight stream (and relays nothing). With
"chain" or "tree" the replicas that serve a weight relay are planned by ``fleetrl.weights.plan_relay`` (fanout 1 or
2) in the order given (the controller's registration order, so a replica that joins later is appended and nobody
else's upstream changes): the first fetches from the trainer, every other from its upstream's relay, and each
loads through its own relay, which serves the version on. A replica that names no relay fetches from the trainer
directly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from fleetrl.weights.relay_plan import plan_relay

RELAY_FANOUT = {"chain": 1, "tree": 2}
WEIGHT_FANOUTS = ("direct", *RELAY_FANOUT)


@dataclass(frozen=True)
class PushSource:
    """A replica's LoadWeights source and whether it loads through its own relay (`LoadWeightsRequest.relay`)."""

    source: str
    relay: bool

    def from_peer(self, trainer_source: str) -> bool:
        return self.source != trainer_source


def push_sources(replicas: Sequence[tuple[str, str]], weight_fanout: str, trainer_source: str) -> dict[str, PushSource]:
    """Each replica's source, for `replicas` given as (member id, relay address or "") in a stable order."""
    if weight_fanout not in WEIGHT_FANOUTS:
        raise ValueError(f"weight_fanout must be one of {WEIGHT_FANOUTS}, got {weight_fanout!r}")
    if weight_fanout == "direct":
        return {member_id: PushSource(trainer_source, False) for member_id, _ in replicas}
    relays = {member_id: address for member_id, address in replicas if address}
    plan = plan_relay(list(relays), RELAY_FANOUT[weight_fanout])
    sources = {}
    for member_id, address in replicas:
        if not address:
            sources[member_id] = PushSource(trainer_source, False)
        else:
            upstream = plan[member_id]
            sources[member_id] = PushSource(trainer_source if upstream is None else relays[upstream], True)
    return sources
