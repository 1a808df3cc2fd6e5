"""A host-memory tier behind the device prefix cache (`kv.offload_gb`).

Why: a prefix evicted from device KV is recomputed on its next hit; a serving engine with
host memory to spare keeps it there and copies it back over the host link instead, which
is far cheaper than the prefill it saves. The real systems:

- vLLM V1's OffloadingConnector (`--kv-offloading-size`) stores every block to CPU as it
  is computed (`OffloadingConnectorScheduler._build_store_jobs`,
  vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py L1570), in an LRU
  CPU cache (`LRUCachePolicy`, vllm/v1/kv_offload/cpu/policies/lru.py; eviction on a full
  store in `CPUOffloadingManager.prepare_store`, cpu/manager.py L311-334). At admission the
  scheduler takes the GPU prefix hit first, then asks the connector how many tokens past it
  the CPU holds (`get_num_new_matched_tokens`, scheduler.py L1039; called from
  vllm/v1/core/sched/scheduler.py L969-1043) and allocates fresh GPU blocks they are loaded into
  (`update_state_after_alloc`, scheduler.py L1146). Its hits are reported apart from the GPU
  prefix cache's: connector queries are the tokens past the local hit, connector hits the
  tokens loaded (sched/scheduler.py L1041-1042, L1295-1300).
- SGLang's hierarchical cache (`--enable-hierarchical-cache`, `--hicache-size`): on a device
  eviction a node with no host backup is backed up first under `--hicache-write-policy
  write_back`, and deleted under write-through (`UnifiedTreeCore.evict_device_leaf`, sglang
  0.5.23 mem_cache/unified_cache/unified_tree_core.py L1788-1815); host-resident prefix nodes
  are loaded back when a request that hits them is admitted (`init_load_back`,
  managers/schedule_policy.py L1470-1525), before that batch's forward.

Both write through by default: vLLM always; SGLang's `--hicache-write-policy` is `write_through`
by default (sglang 0.5.23 arg_groups/fields/memory.py L121-127), a node backed up once inserted
(hit count >= 1, `UnifiedTreeCore._inc_hit_count_and_check` L1104-1122 with the threshold of
unified_radix_cache.py L558-560). `kv.offload_write_policy`:

- `write_through`: a shared-prefix block's key enters the host tier when the block is cached
  (registered), so the host also holds what is still on the device; a device eviction adds
  nothing, and a key the host tier dropped meanwhile is gone once evicted from the device.
- `write_back`: a key enters the host tier when its last device copy is evicted (SGLang's
  `write_back`), so device and host together hold more distinct prefix than either.

The host tier is an LRU of keys (vLLM's `LRUCachePolicy`); a store or a load refreshes a key.
It holds only keys of a trace's shared prefix, not a request's own content (prompt tail,
outputs), which only that request could hit again after a recompute preemption. A load is
synchronous: the admitting step pays `load_blocks` blocks over the host link (vLLM loads
asynchronously and runs the request a step later; SGLang overlaps the load layer by layer with
that step's forward). Stores cost the step nothing (both copy device to host asynchronously).
"""
from __future__ import annotations

from collections import OrderedDict

from testbed.core.kv import BlockManager, KVPreview
from testbed.core.request import RequestState


WRITE_POLICIES = ("write_through", "write_back")


class OffloadingBlockManager(BlockManager):
    """A BlockManager whose shared-prefix blocks are kept, by key, in a host LRU of
    `num_offload_blocks` blocks (written through when cached, or back when evicted), and hit
    again by a prefix lookup past the device's hit.

    Statistics: `hit_tokens` / `queried_tokens` stay the device prefix cache's (vLLM's
    `prefix_cache_hit_rate`: host hits are not in it); `offload_hit_tokens` /
    `offload_queried_tokens` are vLLM's connector ("external") prefix cache counts: tokens
    loaded from host over tokens looked up past the device hit.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 num_host_blocks: int = 0, cache_decode_tokens: str = "scheduled", num_offload_blocks: int = 1,
                 write_policy: str = "write_through"):
        super().__init__(num_blocks, block_size, enable_prefix_caching, num_host_blocks, cache_decode_tokens)
        if num_offload_blocks < 1:
            raise ValueError(f"num_offload_blocks={num_offload_blocks}: must be >= 1 (0 is a plain BlockManager)")
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"kv.offload_write_policy={write_policy!r}: expected one of {WRITE_POLICIES}")
        self.write_through = write_policy == "write_through"
        self.num_offload_blocks = num_offload_blocks
        self._host_keys: OrderedDict[int, None] = OrderedDict()  # shared content keys in host memory, LRU first
        self.offload_hit_tokens = 0
        self.offload_queried_tokens = 0
        self.loaded_blocks = 0  # over the run
        self._unreported_loads = 0  # blocks loaded since the loop last took them for a step's shape

    @property
    def num_host_cached_blocks(self) -> int:
        return len(self._host_keys)

    def in_host(self, key: int) -> bool:
        return key in self._host_keys

    # --- the host tier --------------------------------------------------------------------
    def _drop_key(self, b: int) -> int | None:
        """As BlockManager's; written back, the last device copy of a key goes to host."""
        key = super()._drop_key(b)
        if key is not None and not self.write_through:
            self._keep_in_host(key)
        return key

    def register(self, state: RequestState, num_tokens: int) -> None:
        """As BlockManager's; written through, the shared-prefix blocks it caches are stored to host."""
        start = state.num_cached_blocks
        super().register(state, num_tokens)
        if self.write_through:
            keys = self.prefix_keys(state)
            for key in keys[start:min(state.num_cached_blocks, len(keys))]:
                self._keep_in_host(key)

    def _keep_in_host(self, key: int) -> None:
        host = self._host_keys
        if key in host:
            host.move_to_end(key)
            return
        host[key] = None
        if len(host) > self.num_offload_blocks:
            host.popitem(last=False)  # the least recently stored or loaded

    def _matched(self, state: RequestState) -> tuple[int, int]:
        """(device hit blocks, host hit blocks right after them), within the one-token-left cap."""
        d = self._matched_blocks(state)
        if not self.may_hit(state):
            return d, 0
        keys, host = self.prefix_keys(state), self._host_keys
        lim = min((state.known_len - 1) // self.block_size, len(keys))
        j = d
        while j < lim and keys[j] in host:
            j += 1
        return d, j - d

    # --- the BlockManager interface, host hits included -------------------------------------
    def match_prefix(self, state: RequestState) -> int:
        d, h = self._matched(state)
        return (d + h) * self.block_size

    def admission_blocks(self, state: RequestState, num_new_tokens: int) -> int:
        """As BlockManager's, plus a fresh block for every block loaded from host."""
        d, h = self._matched(state)
        revived = self._free_cached_count(self._hit_path(state))  # the device hit's blocks
        return self.blocks_for((d + h) * self.block_size + num_new_tokens) - d + revived

    def acquire_prefix(self, state: RequestState, max_tokens: int | None = None) -> int:
        """Attach the device hit, then load the host hit past it into fresh blocks (as many as
        are free: the rest is recomputed); returns the hit in tokens."""
        d, h = self._matched(state)
        bs = self.block_size
        if max_tokens is not None:
            total = min(d + h, max_tokens // bs)
            d, h = min(d, total), total - min(d, total)
        got = super().acquire_prefix(state, d * bs) // bs  # counts the lookup in the device statistics
        self.offload_queried_tokens += state.known_len - got * bs
        h = min(h, self.num_free_blocks)
        if not h:
            return got * bs
        keys = self.prefix_keys(state)[got:got + h]
        host = self._host_keys
        for key in keys:  # refreshed first, so the evictions of the blocks they load into keep them
            host.move_to_end(key)
        blocks = state.blocks
        self._grab(blocks, h)
        cached, key_of = self._cached, self._key_of
        for key, b in zip(keys, blocks[got:]):
            cached.setdefault(key, []).append(b)
            key_of[b] = key
        state.num_cached_blocks = got + h
        if self._radix is not None:  # SGLang's mode: the loaded pages join the radix tree as one node
            self._radix.added(blocks, got, got + h)
        self.offload_hit_tokens += h * bs
        self.loaded_blocks += h
        self._unreported_loads += h
        return (got + h) * bs

    def loads_for(self, state: RequestState, num_new_tokens: int) -> int:
        """Blocks admitting this waiting request with `num_new_tokens` would load from host (read-only)."""
        d, h = self._matched(state)
        total = min(d + h, (state.known_len - num_new_tokens) // self.block_size)
        return max(0, total - d)

    def take_loaded_blocks(self) -> int:
        """Blocks loaded from host since the last call (the step loop adds them to the step's shape)."""
        n, self._unreported_loads = self._unreported_loads, 0
        return n

    def preview(self) -> "OffloadPreview":
        return OffloadPreview(self)

    def check_invariants(self, states) -> None:
        super().check_invariants(states)
        assert len(self._host_keys) <= self.num_offload_blocks, \
            f"host tier holds {len(self._host_keys)} blocks, its size is {self.num_offload_blocks}"


class OffloadPreview(KVPreview):
    """KVPreview with host hits: each block a request would load counts as a hit that takes a
    free block, reported in `revive` as ("load", key) (policies count `revive` entries as hit
    blocks that consume free blocks), and its key is on the device for later items.

    Written back, a key whose every device copy this plan's allocations evict is in the host tier
    by the time a later item is admitted, so it counts as a host hit. The host tier's own LRU drops within
    the plan are not followed: a key counted may be gone at admission, which only makes the hit
    shorter (each block is then computed instead of loaded, in the same fresh block), never the
    blocks taken more than planned.
    """

    def match(self, state: RequestState) -> tuple[int, list]:
        n, revive = super().match(state)
        kv = self.kv
        if not kv.may_hit(state):
            return n, revive
        keys = kv.prefix_keys(state)
        lim = min((state.known_len - 1) // kv.block_size, len(keys))
        while n < lim and (kv.in_host(keys[n]) or self._evicted_by_plan(keys[n])):
            revive.append(("load", keys[n]))
            n += 1
        return n, revive

    def _evicted_by_plan(self, key: int) -> bool:
        if self.kv.write_through:  # an eviction stores nothing: the key is in host already, or not at all
            return False
        holders = self.kv._cached.get(key)
        return holders is not None and all(b in self._taken for b in holders)

    def _catch_up_admission(self, state: RequestState, n: int, hit: int, revive: list) -> None:
        """A host hit ("load", key) takes a fresh block, and only the device hit is already registered."""
        bs = self.kv.block_size
        loaded = sum(1 for b in revive if type(b) is tuple)
        self._touched.update(b for b in revive if type(b) is not tuple)
        self._take(self.kv.blocks_for(hit * bs + n) - hit + loaded)
        self._register(state, hit - loaded, hit * bs + n)
