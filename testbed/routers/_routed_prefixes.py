"""A router's own record of which prompt prefixes it sent where: SGLang's approximate tree.

SGLang's model gateway keeps, per worker, a radix tree of the prompts it routed there, trimmed
to a size by evicting least recently used leaves (lightseekorg/smg model_gateway/src/policies/
cache_aware.rs L18-27, `max_tree_size`), and llm-d's approximate prefix producer keeps, per pod,
an LRU of the prompt's block hashes as large as the pod's KV blocks (llm-d-inference-scheduler
pkg/epp/framework/plugins/requestcontrol/dataproducer/approximateprefix/indexer.go L52-71). Neither
asks the engine what it holds, so both believe a prefix is cached after the engine evicted it.

Here a replica's record is an LRU of the trace's prefix blocks (`Request.prefix_hashes`, chained
so a key names a whole prefix, as the KV cache's keys do) holding at most as many tokens as the
replica's device KV cache. A routed request's blocks are touched tail first, so its head is the
most recently used and a prefix is forgotten from its tail, as vLLM evicts it.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

from testbed.core.request import Request
from testbed.core.router import ReplicaView


def prefix_chain(req: Request) -> list[int]:
    """One key per trace prefix block of `req` that its prompt reaches; key i names blocks 0..i."""
    p = req.prefix_block_tokens
    keys, key = [], 0
    for x in req.prefix_hashes[:-(-req.prompt_len // p)]:
        key = hash((key, x))
        keys.append(key)
    return keys


class RoutedPrefixes:
    """Per replica, the prefix blocks of the requests routed to it, least recently routed first."""

    def __init__(self):
        self._lru: list[OrderedDict[int, None]] = []
        self._capacity_tokens: list[int] = []

    def _ensure(self, replicas: Sequence[ReplicaView]) -> None:
        if len(self._lru) != len(replicas):
            self._lru = [OrderedDict() for _ in replicas]
            self._capacity_tokens = [r.num_blocks * r.block_size for r in replicas]

    def matched_tokens(self, replicas: Sequence[ReplicaView], req: Request, chain: list[int]) -> list[int]:
        """Per replica, the leading prompt tokens of `req` the record says it holds."""
        self._ensure(replicas)
        out = []
        for lru in self._lru:
            n = 0
            for key in chain:
                if key not in lru:
                    break
                n += 1
            out.append(min(n * req.prefix_block_tokens, req.prompt_len))
        return out

    def record(self, replicas: Sequence[ReplicaView], i: int, req: Request, chain: list[int]) -> None:
        """Remember that replica `i` now holds `req`'s prefix blocks; forget its least recent beyond capacity."""
        self._ensure(replicas)  # the first request may be routed by load alone, before any lookup
        lru = self._lru[i]
        for key in reversed(chain):
            lru[key] = None
            lru.move_to_end(key)
        cap = max(1, self._capacity_tokens[i] // req.prefix_block_tokens)
        while len(lru) > cap:
            lru.popitem(last=False)
