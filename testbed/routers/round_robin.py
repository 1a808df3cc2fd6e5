"""Round robin: the i-th arrival goes to replica i mod N, whatever the replicas hold.

The baseline every router paper compares with, and the default of vLLM's and SGLang's routers
(SGLang model gateway's `round_robin` policy). Blind to load, so a burst of long prompts can
queue on one replica while another idles."""
from __future__ import annotations

from typing import Sequence

from testbed.core.request import Request
from testbed.core.router import BaseRouter, ReplicaView, register_router


@register_router
class RoundRobin(BaseRouter):
    name = "round_robin"

    def __init__(self, knobs=None):
        super().__init__(knobs)
        self._next = 0

    def route(self, req: Request, replicas: Sequence[ReplicaView], now: float) -> int:
        i = self._next % len(replicas)
        self._next = i + 1
        return i
