"""Least outstanding requests: the replica with the fewest requests routed to it and not yet
finished (waiting, swapped or running); ties go to the lowest index.

Outstanding requests are what a load balancer in front of the servers can count by itself
(requests sent minus responses seen), the signal of Envoy's and NGINX's least-request balancing
and of vLLM production-stack's router's session-free mode."""
from __future__ import annotations

from typing import Sequence

from testbed.core.request import Request
from testbed.core.router import BaseRouter, ReplicaView, register_router
from testbed.routers._load import least_outstanding


@register_router
class LeastOutstanding(BaseRouter):
    name = "least_outstanding"

    def route(self, req: Request, replicas: Sequence[ReplicaView], now: float) -> int:
        return least_outstanding(replicas)
