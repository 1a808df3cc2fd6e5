"""The paged KV cache's bookkeeping: which blocks each request holds, shared or not.

One `BlockManager` serves both backends: in the simulator it only counts, on the engine
its block ids index the real KV tensors, so a policy's KV decisions hold identically on
both. Prefix sharing follows vLLM's automatic prefix caching: a full block's content is
named by a key chained over every token before it, a cached block with no owner stays
reusable until it is evicted, least recently released first. Every operation costs
O(blocks it touches), never O(cache size).
"""
from __future__ import annotations

from collections import OrderedDict, deque
from typing import Iterable

from testbed.core.request import Request, RequestState


class KVCapacityError(Exception):
    """Not enough free blocks (device or host) for an allocation."""


def prefix_block_keys(req: Request, block_size: int) -> tuple[int, ...]:
    """Content keys of the request's full KV blocks inside the trace's hashed prefix.

    Trace block i (`prefix_block_tokens` tokens, id `prefix_hashes[i]`) and our block j
    (`block_size` tokens) need not align: block j's key chains the previous key with the
    ids of every trace block it overlaps and its offset in the first, so equal keys mean
    equal content of every token up to the block's end.
    """
    if not req.prefix_hashes:
        return ()
    p = req.prefix_block_tokens
    covered = min(req.prompt_len, len(req.prefix_hashes) * p)
    keys = []
    key = 0
    for j in range(covered // block_size):
        start, end = j * block_size, (j + 1) * block_size
        ids = req.prefix_hashes[start // p:(end - 1) // p + 1]
        key = hash((key, start % p, ids))
        keys.append(key)
    return tuple(keys)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 num_host_blocks: int = 0):
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks}: must be >= 1")
        if block_size < 1:
            raise ValueError(f"block_size={block_size}: must be >= 1")
        if num_host_blocks < 0:
            raise ValueError(f"num_host_blocks={num_host_blocks}: must be >= 0")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.num_host_blocks = num_host_blocks
        self._ref = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._cached: dict[int, int] = {}  # key -> block
        self._key_of: dict[int, int] = {}  # block -> key
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached blocks with no owner, LRU first
        self._host_used = 0
        self.hit_tokens = 0  # prefix-cache statistics, over admissions
        self.queried_tokens = 0

    # --- capacity -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free) - len(self._evictable)

    @property
    def num_free_host_blocks(self) -> int:
        return self.num_host_blocks - self._host_used

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free) + len(self._evictable)

    def blocks_needed(self, state: RequestState, num_new_tokens: int) -> int:
        return max(0, self.blocks_for(state.num_computed + num_new_tokens) - len(state.blocks))

    def num_exclusive_blocks(self, state: RequestState) -> int:
        """Blocks that would join the free pool if this request released its KV."""
        if not state.req.prefix_hashes:  # never keyed, so never shared
            return len(state.blocks)
        ref = self._ref
        return sum(1 for b in state.blocks if ref[b] == 1)

    # --- prefix cache -----------------------------------------------------------------------
    def _keys(self, state: RequestState) -> tuple[int, ...]:
        keys = state._block_keys
        if keys is None:
            keys = state._block_keys = prefix_block_keys(state.req, self.block_size)
        return keys

    def _matched_blocks(self, state: RequestState) -> int:
        if not self.enable_prefix_caching or not state.req.prefix_hashes:
            return 0
        cap = (state.known_len - 1) // self.block_size  # leave at least one token to compute
        cached = self._cached
        n = 0
        for key in self._keys(state):
            if n >= cap or key not in cached:
                break
            n += 1
        return n

    def match_prefix(self, state: RequestState) -> int:
        """Prompt tokens of a request holding no blocks that are already cached (read-only)."""
        return self._matched_blocks(state) * self.block_size

    def admission_blocks(self, state: RequestState, num_new_tokens: int) -> int:
        """Free blocks that admitting a waiting request with `num_new_tokens` would consume:
        its new blocks plus the cached prefix blocks it takes off the evictable list."""
        hit = self._matched_blocks(state)
        keys, cached, evictable = self._keys(state), self._cached, self._evictable
        revived = sum(1 for i in range(hit) if cached[keys[i]] in evictable)
        return self.blocks_for(hit * self.block_size + num_new_tokens) - hit + revived

    def acquire_prefix(self, state: RequestState) -> int:
        """Attach the cached prefix blocks to a request holding none; returns the hit in tokens."""
        hit = self._matched_blocks(state)
        self.queried_tokens += state.req.prompt_len
        if not hit:
            state.num_cached_blocks = 0
            return 0
        keys, cached, ref, evictable = self._keys(state), self._cached, self._ref, self._evictable
        for i in range(hit):
            b = cached[keys[i]]
            if ref[b] == 0:
                del evictable[b]
            ref[b] += 1
            state.blocks.append(b)
        state.num_cached_blocks = hit
        self.hit_tokens += hit * self.block_size
        return hit * self.block_size

    def commit(self, state: RequestState) -> None:
        """Register the request's newly full, keyed blocks in the prefix cache.

        If another block already holds a key, this request's copy stays private and the
        chain stops there: later blocks of this request are not registered either.
        """
        if not self.enable_prefix_caching or not state.req.prefix_hashes:
            return
        keys = self._keys(state)
        i = state.num_cached_blocks
        full = min(state.num_computed // self.block_size, len(keys))
        cached, key_of = self._cached, self._key_of
        while i < full:
            key, b = keys[i], state.blocks[i]
            if key in cached:
                if cached[key] != b:
                    state.num_cached_blocks = len(keys)  # chain broken: stop registering
                    return
            else:
                cached[key] = b
                key_of[b] = key
            i += 1
        state.num_cached_blocks = i

    # --- allocation -------------------------------------------------------------------------
    def _take(self) -> int:
        if self._free:
            return self._free.popleft()
        b, _ = self._evictable.popitem(last=False)
        del self._cached[self._key_of.pop(b)]
        return b

    def allocate(self, state: RequestState, num_new_tokens: int) -> None:
        need = self.blocks_for(state.num_computed + num_new_tokens) - len(state.blocks)
        if need <= 0:
            return
        if need == 1 and self._free:  # the common case: a decode crossing into a new block
            b = self._free.popleft()
            self._ref[b] = 1
            state.blocks.append(b)
            return
        free = len(self._free) + len(self._evictable)
        if need > free:
            raise KVCapacityError(f"needed {need} KV blocks, {free} free")
        self._grab(state.blocks, need)

    def _grab(self, blocks: list[int], need: int) -> None:
        """Append `need` blocks (free list first, then LRU eviction) to `blocks`; capacity was checked."""
        ref, free = self._ref, self._free
        fresh = [free.popleft() for _ in range(min(need, len(free)))]
        for b in fresh:
            ref[b] = 1
        blocks.extend(fresh)
        for _ in range(need - len(fresh)):
            b = self._take()
            ref[b] = 1
            blocks.append(b)

    def free(self, state: RequestState) -> None:
        """Release every block, tail first, so a shared prefix's tail is evicted before its head."""
        ref, key_of, evictable, free = self._ref, self._key_of, self._evictable, self._free
        if not state.req.prefix_hashes:  # its blocks were never keyed, so never shared
            blocks = state.blocks
            for b in blocks:
                ref[b] = 0
            free.extend(reversed(blocks))
            state.blocks = []
            state.num_cached_blocks = 0
            return
        for b in reversed(state.blocks):
            ref[b] -= 1
            if ref[b] == 0:
                if b in key_of:
                    evictable[b] = None
                else:
                    free.append(b)
        state.blocks = []
        state.num_cached_blocks = 0

    # --- swap -------------------------------------------------------------------------------
    def swap_out(self, state: RequestState) -> int:
        n = len(state.blocks)
        if n > self.num_host_blocks - self._host_used:
            raise KVCapacityError(f"swap out needed {n} host blocks, {self.num_host_blocks - self._host_used} free")
        self.free(state)
        self._host_used += n
        state.swapped_blocks = n
        return n

    def swap_in(self, state: RequestState) -> int:
        n = state.swapped_blocks
        free = len(self._free) + len(self._evictable)
        if n > free:
            raise KVCapacityError(f"swap in needed {n} KV blocks, {free} free")
        self._grab(state.blocks, n)
        state.num_cached_blocks = len(self._keys(state))  # swapped-in copies are private
        self._host_used -= n
        state.swapped_blocks = 0
        return n

    # --- checking -------------------------------------------------------------------------------
    def check_invariants(self, states: Iterable[RequestState]) -> None:
        """Every block is exactly one of free / evictable / owned, and ref counts match owners."""
        owners = [0] * self.num_blocks
        host = 0
        for s in states:
            assert len(set(s.blocks)) == len(s.blocks), f"request {s.id} holds a block twice: {s.blocks}"
            for b in s.blocks:
                owners[b] += 1
            host += s.swapped_blocks
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free list twice"
        for b in range(self.num_blocks):
            where = (b in free) + (b in self._evictable) + (owners[b] > 0)
            assert where == 1, f"block {b}: free={b in free} evictable={b in self._evictable} owners={owners[b]}"
            assert self._ref[b] == owners[b], f"block {b}: ref count {self._ref[b]} but {owners[b]} owners"
            if owners[b] > 1:
                assert b in self._key_of, f"block {b} is shared by {owners[b]} requests but is not a cached block"
            if b in self._evictable:
                assert b in self._key_of, f"block {b} is evictable but not cached"
        for key, b in self._cached.items():
            assert self._key_of.get(b) == key, f"cache maps key to block {b} but the block's key differs"
        assert host == self._host_used, f"host blocks used {self._host_used}, swapped states hold {host}"
