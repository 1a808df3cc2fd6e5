"""The contract between the simulator and a router, and the registry of routers.

With several replicas, a router picks the replica each arriving request joins, once, at its
arrival (as vLLM's and SGLang's routers and llm-d's endpoint picker do: a request never moves
between replicas). A router is a small object like a policy: `route(req, replicas, now)` returns
an index into `replicas`, a read-only `ReplicaView` of each replica's queues and KV cache. Its
knobs are a dataclass that doubles as the Hydra schema of `testbed/conf/router/<name>.yaml`.
The core holds the contract and the registry; the bundled routers live in `testbed.routers`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Protocol, Sequence, runtime_checkable

from testbed.core.bounds import check_ranges
from testbed.core.registry import Registry
from testbed.core.request import Request, RequestState

if TYPE_CHECKING:
    from testbed.core.loop import StepLoop


class ReplicaView:
    """What a router may see of one replica: its queues and KV cache, read-only.

    Reads the replica's live loop, so building it costs nothing per arrival. The counts are
    those a real router can know: SGLang's router and llm-d's scorers read the engines'
    running and waiting counts and KV usage from their metrics, and a cache-aware router
    tracks each replica's cached prefixes.

    `settle`, when the simulator sets it, is called before the KV cache is read: a replica in the
    middle of a fast-forwarded decode run takes the blocks its steps so far would hold
    (testbed/sim/decode_runs.py)."""

    __slots__ = ("index", "_loop", "_kv", "settle")

    def __init__(self, index: int, loop: "StepLoop"):
        self.index = index
        self._loop = loop
        self._kv = loop.kv
        self.settle: Callable[[], None] | None = None

    @property
    def num_waiting(self) -> int:
        """Requests routed here and not yet holding device KV (new, preempted or swapped)."""
        return len(self._loop.waiting)

    @property
    def num_running(self) -> int:
        """Requests holding device KV."""
        return len(self._loop.running)

    @property
    def outstanding(self) -> int:
        """Requests routed here and not yet finished (waiting, swapped or running)."""
        return len(self._loop.live)

    @property
    def num_blocks(self) -> int:
        return self._kv.num_blocks

    @property
    def free_blocks(self) -> int:
        if self.settle is not None:
            self.settle()
        return self._kv.num_free_blocks

    @property
    def kv_usage(self) -> float:
        """Used share of the device KV blocks (vLLM's `kv_cache_usage` gauge)."""
        if self.settle is not None:
            self.settle()
        return self._kv.num_used_blocks / self._kv.num_blocks

    @property
    def block_size(self) -> int:
        return self._kv.block_size

    @property
    def prefix_caching(self) -> bool:
        return self._kv.enable_prefix_caching

    def cached_prefix_tokens(self, req: Request) -> int:
        """Leading prompt tokens of `req` whose KV this replica's prefix cache holds now (0 without
        prefix caching or prefix ids). A lookup only: it moves no block in the cache's eviction order
        and counts in no hit-rate statistic. Asking every replica about one request hashes its
        blocks once (the probe is shared while the same request is asked about)."""
        kv = self._kv
        if not kv.enable_prefix_caching or not req.prefix_hashes:
            return 0
        if self.settle is not None:
            self.settle()
        probe = _probes.get(kv.block_size)
        if probe is None or probe.req is not req:
            probe = _probes[kv.block_size] = RequestState(req)
        return kv.match_prefix(probe)  # read-only (BlockManager.match_prefix)


_probes: dict[int, RequestState] = {}  # block size -> a holder-less state of the request last asked about


@runtime_checkable
class Router(Protocol):
    name: str

    def route(self, req: Request, replicas: Sequence[ReplicaView], now: float) -> int: ...


@dataclass
class RouterKnobs:
    """Base of every router's knob dataclass; `name` selects the router."""

    name: str = "???"

    def __post_init__(self):
        check_ranges(self, "router")


class BaseRouter:
    """Convenience base: knobs kept as attributes."""

    name = "base"
    Knobs: type[RouterKnobs] = RouterKnobs

    def __init__(self, knobs: RouterKnobs | None = None):
        self.knobs = knobs if knobs is not None else self.Knobs(name=self.name)

    def route(self, req: Request, replicas: Sequence[ReplicaView], now: float) -> int:  # pragma: no cover
        raise NotImplementedError


_ROUTERS = Registry("router", "testbed.routers")


def register_router(cls: type) -> type:
    """Class decorator: make a router selectable as `router=<cls.name>`."""
    return _ROUTERS.register(cls)


def registered_routers() -> dict[str, type]:
    """The routers registered so far (importing `testbed.routers` registers the bundled ones)."""
    return _ROUTERS.registered()


def make_router(name: str, **knobs) -> Router:
    """Build a registered router from its name and knob values (unknown knobs are an error)."""
    return _ROUTERS.make(name, **knobs)
