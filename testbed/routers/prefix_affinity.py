"""Prefix-cache affinity with a load cap: SGLang model gateway's `cache_aware` policy.

Rule (lightseekorg/smg at 73da68c, model_gateway/src/policies/cache_aware.rs): the pool is
imbalanced when max - min outstanding > `balance_abs_threshold` and max > `balance_rel_threshold` x min (L283-307);
then the request goes to the least loaded replica whatever it caches. Otherwise it goes to the
replica holding the longest prefix of its prompt if that prefix's share of the prompt exceeds
`cache_threshold`, else to the least loaded (L1005-1025; the earlier sglang sgl-router sent a miss
to the replica with the smallest tree instead). Ties in match go to the less loaded, then the
lowest index (as in the gateway's event-driven mode, L928-975). Defaults are the gateway's
(policies/mod.rs L136-138: 0.5, 32, 1.1). llm-d's `prefix-cache-scorer` scores the same
match share, matched blocks / prompt blocks (scheduling/scorer/prefix/plugin.go L95), and
weighs it against its load scorers instead of switching.

What the router knows of the caches (`cache_view`):
- `approximate` (default; SGLang's approximate tree, llm-d's approximate prefix producer): its
  own record of the prefixes it routed where, capped at each replica's KV capacity
  (`testbed/routers/_routed_prefixes.py`). It cannot see evictions, so under KV pressure it
  routes to a replica that no longer holds the prefix.
- `actual`: each replica's prefix cache as it is now (`ReplicaView.cached_prefix_tokens`), what
  the gateway's event-driven mode and llm-d's `precise-prefix-cache-scorer` see through the
  engines' KV events. It sees a prefix only once its prefill has been scheduled, so a burst of
  requests sharing a new prefix spreads before the first one lands.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from testbed.core.bounds import bounded
from testbed.core.request import Request
from testbed.core.router import BaseRouter, ReplicaView, RouterKnobs, register_router
from testbed.routers._load import least_outstanding
from testbed.routers._routed_prefixes import RoutedPrefixes, prefix_chain

CACHE_VIEWS = ("approximate", "actual")


@dataclass
class PrefixAffinityKnobs(RouterKnobs):
    name: str = "prefix_affinity"
    cache_view: str = "approximate"  # approximate (the router's record of what it routed where) | actual (the caches)
    cache_threshold: float = bounded(0.5, ge=0, le=1)  # follow the longest match only above this share of the prompt
    balance_abs_threshold: int = bounded(32, ge=0)  # imbalanced when max - min outstanding exceeds this ...
    balance_rel_threshold: float = bounded(1.1, ge=1)  # ... and max exceeds this times min

    def __post_init__(self):
        super().__post_init__()
        if self.cache_view not in CACHE_VIEWS:
            raise ValueError(f"router.cache_view={self.cache_view!r}: expected one of {', '.join(CACHE_VIEWS)}")


@register_router
class PrefixAffinity(BaseRouter):
    name = "prefix_affinity"
    Knobs = PrefixAffinityKnobs

    def __init__(self, knobs: PrefixAffinityKnobs | None = None):
        super().__init__(knobs)
        self._routed = RoutedPrefixes() if self.knobs.cache_view == "approximate" else None

    def route(self, req: Request, replicas: Sequence[ReplicaView], now: float) -> int:
        k = self.knobs
        chain = prefix_chain(req) if self._routed is not None and req.prefix_hashes else None
        loads = [r.outstanding for r in replicas]
        lo, hi = min(loads), max(loads)
        if hi - lo > k.balance_abs_threshold and hi > k.balance_rel_threshold * lo:
            i = loads.index(lo)
        else:
            i = self._best_match(req, replicas, loads, chain)
        if chain:
            self._routed.record(replicas, i, req, chain)
        return i

    def _best_match(self, req: Request, replicas: Sequence[ReplicaView], loads: list[int],
                    chain: list[int] | None) -> int:
        if not req.prefix_hashes:
            return least_outstanding(replicas)
        if chain is not None:
            matched = self._routed.matched_tokens(replicas, req, chain)
        else:
            matched = [r.cached_prefix_tokens(req) for r in replicas]
        best = min(range(len(replicas)), key=lambda j: (-matched[j], loads[j], j))
        if matched[best] > self.knobs.cache_threshold * req.prompt_len:
            return best
        return least_outstanding(replicas)
