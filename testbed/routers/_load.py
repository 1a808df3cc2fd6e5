"""The load signal the load-aware routers share: outstanding requests, ties to the lowest index."""
from __future__ import annotations

from typing import Sequence

from testbed.core.router import ReplicaView


def least_outstanding(replicas: Sequence[ReplicaView]) -> int:
    """The index of the replica with the fewest unfinished requests (the lowest index on a tie)."""
    best, fewest = 0, replicas[0].outstanding
    for i in range(1, len(replicas)):
        n = replicas[i].outstanding
        if n < fewest:
            best, fewest = i, n
    return best
