"""Least KV load: the replica whose device KV cache is least used; ties go to the one with fewer
waiting requests, then the lowest index.

llm-d's `kv-cache-utilization-scorer` scores each endpoint 1 - its KV usage gauge
(llm-d-inference-scheduler at 520af47, pkg/epp/framework/plugins/scheduling/scorer/kvcacheutilization/
kvcache_utilization.go L79), vLLM's `kv_cache_usage` metric; its `queue-scorer` prefers the
shorter waiting queue (scorer/queuedepth/queue.go L78-99), here the tie-break. KV usage sees
long prompts and long contexts that a request count misses, but not requests still waiting:
a replica with an empty cache and a deep queue looks idle until its queue is admitted."""
from __future__ import annotations

from typing import Sequence

from testbed.core.request import Request
from testbed.core.router import BaseRouter, ReplicaView, register_router


@register_router
class LeastKV(BaseRouter):
    name = "least_kv"

    def route(self, req: Request, replicas: Sequence[ReplicaView], now: float) -> int:
        return min(replicas, key=lambda r: (r.kv_usage, r.num_waiting, r.index)).index
