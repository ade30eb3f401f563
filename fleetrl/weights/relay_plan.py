"""Who fetches a weight version from whom: ``plan_relay``, pure logic (no sockets).

The trainer's publisher serves ``root_fanout`` replicas (one by default, so its egress is one copy);
every other replica fetches from a replica that relays the version (``fleetrl.weights.relay``).
With ``fanout=1`` the replicas form a chain, with ``fanout=k`` a k-ary tree in breadth-first order.
The plan of a list is a prefix of the plan of that list with replicas appended, so a replica that
joins mid-run gets a peer as its upstream and nobody else's upstream changes.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import TypeVar

R = TypeVar("R", bound=Hashable)


def plan_relay(replicas: Sequence[R], fanout: int, *, root_fanout: int = 1) -> dict[R, R | None]:
    """Each replica's upstream, in the order given: ``None`` for the publisher, else a replica.

    The first ``root_fanout`` replicas fetch from the publisher; replica ``i`` after them fetches
    from replica ``(i - root_fanout) // fanout``, so no replica serves more than ``fanout`` others
    and each upstream comes before its downstreams (start them in this order). ``root_fanout`` at
    least ``len(replicas)`` is the direct plan: everyone fetches from the publisher.
    """
    if not isinstance(fanout, int) or isinstance(fanout, bool) or fanout < 1:
        raise ValueError(f"fanout must be an int >= 1, got {fanout!r}")
    if not isinstance(root_fanout, int) or isinstance(root_fanout, bool) or root_fanout < 1:
        raise ValueError(f"root_fanout must be an int >= 1, got {root_fanout!r}")
    replicas = list(replicas)
    if len(set(replicas)) != len(replicas):
        raise ValueError(f"replicas must be distinct, got {replicas!r}")
    return {
        replica: None if i < root_fanout else replicas[(i - root_fanout) // fanout]
        for i, replica in enumerate(replicas)
    }


def relay_depth(plan: Mapping[R, R | None]) -> int:
    """The number of hops from the publisher to the farthest replica (0 for an empty plan)."""
    depth: dict[R, int] = {}
    for replica, upstream in plan.items():
        if upstream is not None and upstream not in depth:
            raise ValueError(f"replica {replica!r} fetches from {upstream!r}, which is not planned before it")
        depth[replica] = 1 if upstream is None else depth[upstream] + 1
    return max(depth.values(), default=0)
