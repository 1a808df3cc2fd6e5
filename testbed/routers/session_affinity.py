"""Session affinity: the requests of one session (`Request.session_id`) follow the replica that
served the session's last request; a new session, and a request of no session, goes to the
replica with the fewest outstanding requests (as `least_outstanding`).

llm-d's `session-affinity-scorer` gives the pod that served the session's previous request, named
in the `x-session-token` header of its response, the top score (llm-d-inference-scheduler
pkg/epp/framework/plugins/scheduling/scorer/sessionaffinity/session_affinity.go L21, L65-85); SGLang
model gateway's `consistent_hashing` and `manual` policies pin a routing key to a worker the same
way. A session's earlier turns are the prefix of its next prompt, so stickiness is prefix
affinity for conversations without reading any cache. Its risk is imbalance: a few long sessions
can pile onto one replica. `max_load_gap` > 0 caps it: when the session's replica has that many
more outstanding requests than the least loaded one, the request goes to the least loaded and
the session follows it there (the header now names the new pod); 0 never moves a session."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from testbed.core.bounds import bounded
from testbed.core.request import Request
from testbed.core.router import BaseRouter, ReplicaView, RouterKnobs, register_router
from testbed.routers._load import least_outstanding


@dataclass
class SessionAffinityKnobs(RouterKnobs):
    name: str = "session_affinity"
    max_load_gap: int = bounded(0, ge=0)  # > 0: move a session whose replica has this many more outstanding requests than the least loaded; 0 = never


@register_router
class SessionAffinity(BaseRouter):
    name = "session_affinity"
    Knobs = SessionAffinityKnobs

    def __init__(self, knobs: SessionAffinityKnobs | None = None):
        super().__init__(knobs)
        self._replica_of: dict[str, int] = {}  # session id -> the replica of its latest request

    def route(self, req: Request, replicas: Sequence[ReplicaView], now: float) -> int:
        session = req.session_id
        if not session:
            return least_outstanding(replicas)
        i = self._replica_of.get(session)
        if i is None or i >= len(replicas) or self._over_gap(replicas, i):
            i = least_outstanding(replicas)
        self._replica_of[session] = i
        return i

    def _over_gap(self, replicas: Sequence[ReplicaView], i: int) -> bool:
        gap = self.knobs.max_load_gap
        return gap > 0 and replicas[i].outstanding - min(r.outstanding for r in replicas) >= gap
