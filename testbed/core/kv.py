"""The paged KV cache's bookkeeping: which blocks each request holds, shared or not.

One `BlockManager` serves both backends: in the simulator it only counts, on the engine
its block ids index the real KV tensors, so a policy's KV decisions hold identically on
both. Prefix sharing follows vLLM's automatic prefix caching: a full block's content is
named by a key chained over every token before it, a cached block with no owner stays
reusable until it is evicted, least recently released first; in SGLang's mode
(`cache_decode_tokens="finished"`) cached blocks form SGLang's radix tree instead and are evicted
as whole leaves, least recently accessed first (testbed/core/radix_lru.py). Every operation costs
O(blocks it touches), never O(cache size). `KVPreview` lets a policy plan admissions
against the cache as its plan's earlier items will leave it.
"""
from __future__ import annotations

import functools
from itertools import chain
from typing import Iterable, Iterator

from testbed.core.free_queue import FreeQueue
from testbed.core.radix_lru import RadixLRU
from testbed.core.request import Request, RequestState


CACHE_DECODE_TOKENS = ("scheduled", "finished")
PRIVATE = 1 << 62  # num_cached_blocks of a request whose blocks must never be registered


class KVCapacityError(Exception):
    """Not enough free blocks (device or host) for an allocation."""


def prefix_block_keys(req: Request, block_size: int) -> tuple[int, ...]:
    """Content keys of the request's full KV blocks inside the trace's hashed prefix.

    Trace block i (`prefix_block_tokens` tokens, id `prefix_hashes[i]`) and our block j
    (`block_size` tokens) need not align: block j's key names the chain of trace ids up to the
    trace block holding its last token, and that token's offset in it, so equal keys mean
    equal content of every token up to the block's end.
    """
    if not req.prefix_hashes:
        return ()
    p = req.prefix_block_tokens
    # ids over the answer too (a session's parent turn, testbed/traces/sessions.py): its decoded
    # blocks get shared keys as well
    hashed = req.prompt_len + req.output_len if req.hashes_span_output else req.prompt_len
    covered = min(hashed, len(req.prefix_hashes) * p)
    return _chained_keys(req.prefix_hashes[:-(-covered // p)], p, covered, block_size)


@functools.lru_cache(maxsize=4096)
def _chained_keys(ids: tuple[int, ...], p: int, covered: int, block_size: int) -> tuple[int, ...]:
    """`prefix_block_keys` of `covered` tokens named by trace ids `ids` (`p` tokens each), kept for the
    prompts a trace sends again: the calibration runs' shared-prefix workloads send each of their hundred
    prompts 30-170 times, and a fit replays each run eight or nine times. The same ids, the same
    keys: a chain of hashes per prompt, not per request."""
    chain, key = [], 0  # chain[i] names trace blocks 0..i
    for x in ids:
        key = hash((key, x))
        chain.append(key)
    # the content of tokens [0, end) is trace blocks 0..m (m = (end - 1) // p) and end's offset in m
    # (a list comprehension, each trace block index computed once: this runs over every block of every prompt)
    return tuple([hash((chain[(m := (end - 1) // p)], end - m * p))
                  for end in range(block_size, covered // block_size * block_size + 1, block_size)])


class BlockManager:
    """Blocks, reference counts and the prefix cache, as vLLM V1's BlockPool keeps them.

    Rules (vLLM v0.32, vllm/v1/core/block_pool.py and kv_cache_manager.py):
    - One free queue holds every block no request holds, cached or not
      (`FreeKVCacheBlockQueue`, vllm/v1/core/kv_cache_utils.py L246); an allocation takes its
      head and drops its content key if it had one (`_maybe_evict_cached_block`, block_pool.py
      L729). A request releases its blocks tail first (`SingleTypeKVCacheManager.free`,
      single_type_kv_cache_manager.py L581): cached ones to the queue's end, so they are
      evicted least recently released first and a prefix's tail before its head, uncached
      ones (a partial last block) to its front, to be reused first (`BlockPool.free_blocks`,
      block_pool.py L774).
    - Every full block of every request is cached under a key chained over the whole sequence
      up to its end (`hash_block_tokens`), registered when the request is scheduled
      (`KVCacheManager.allocate_slots` -> `cache_blocks`), so a request later in the same step
      can hit it. A trace's prefix hashes name shared content; the rest of a sequence (prompt
      tail, outputs) gets keys of its own request, so only that request, resumed after a
      recompute preemption, can hit them. Two blocks may hold one key: a lookup takes the
      first registered (`BlockHashToBlockMap.get_one_block`, block_pool.py L62).
    - A hit is full blocks only and leaves at least one token to compute
      (`KVCacheManager.get_computed_blocks`, kv_cache_manager.py L295: `max_cache_hit_length = num_tokens - 1`).

    SGLang's mode (`cache_decode_tokens="finished"`, prefix caching on; sglang 0.5.23
    mem_cache/radix_cache.py): a request's computed blocks are inserted when its step completes
    (`register`, called then by the loop) and when it finishes (`free`), each content held once;
    a free block caching nothing is allocated first; beyond those, the radix tree evicts whole
    leaves, the least recently accessed first, where a lookup (`touch`, which the loop replays for
    the scheduler's lookups) or an insert re-stamps its path (`RadixLRU`, radix_lru.py). vLLM's
    mode never builds that tree: none of it changes vLLM's behaviour.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 num_host_blocks: int = 0, cache_decode_tokens: str = "scheduled"):
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks}: must be >= 1")
        if block_size < 1:
            raise ValueError(f"block_size={block_size}: must be >= 1")
        if num_host_blocks < 0:
            raise ValueError(f"num_host_blocks={num_host_blocks}: must be >= 0")
        if cache_decode_tokens not in CACHE_DECODE_TOKENS:
            raise ValueError(f"kv.cache_decode_tokens={cache_decode_tokens!r}: expected one of {CACHE_DECODE_TOKENS}")
        # "finished": SGLang's radix cache keeps a request's prefilled tokens once computed
        # (`cache_unfinished_req`) and its decoded ones only when it finishes (`cache_finished_req`);
        # a retracted request's decode tokens are freed uncached (`release_kv_cache`,
        # sglang 0.5.23 mem_cache/common.py L400-439, called by schedule_batch.py `release_req` L2389)
        self.cache_decode = cache_decode_tokens == "scheduled"
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.num_host_blocks = num_host_blocks
        # Holder counts are read only where a block can be shared or cached (a hit, an eviction, the radix
        # tree): without prefix caching no block is ever either, a block is held by one request or free, and
        # `_ref` is left unwritten. Orca's preset (1-token slots, no cache) then takes and frees its blocks
        # in list slices alone, not one store per token (issue 27). In SGLang's mode (below, `_block_refs`
        # False) the counts are the radix tree's, one per node, at its last block: taking, releasing,
        # registering a request's tree blocks costs per node, and a block that caches nothing has no count
        # (held by the one request whose list holds it, or free); `RadixLRU.rel` says which tree blocks are free.
        self._ref = [0] * num_blocks
        # The free queue (every block no request holds, the next allocated first) in two parts: `_front`,
        # the blocks queued at its front, which cache nothing, as a stack (the queue's head is its last
        # item), then `_queue`, the rest, cached or not, LRU first (testbed/core/free_queue.py). The front is
        # where the common case lives (every block at the start, a request's uncached blocks when it leaves,
        # and every block of a cache that keeps none): a run of them is taken or returned in one list slice
        # (page size 1 makes every token a block). A cached block is never in `_front`, so a hit revives it
        # from `_queue`.
        self._front: list[int] = list(range(num_blocks - 1, -1, -1))
        self._queue = FreeQueue()
        # SGLang's mode queues its free tree blocks behind `_front` per release, not per block
        # (RadixLRU.runs: page size 1 would make every token an OrderedDict entry); their count:
        self._free_tree = 0
        self._cached: dict[int, list[int]] = {}  # shared content key -> blocks holding it, first registered first
        self._key_of: dict[int, int] = {}  # block -> shared content key
        self._own_rid = [-1] * num_blocks  # request whose own content a block caches, or -1
        # ... at which of its block positions, and in which of its lives (the first registered is looked up
        # first): written when the life ends unfinished (`_note_life`), as only its own later lives read them
        self._own_idx = [0] * num_blocks
        self._own_seq = [0] * num_blocks
        self._seq = 0
        self._host_used = 0
        self.hit_tokens = 0  # prefix-cache statistics, over admissions
        self.queried_tokens = 0
        # SGLang's mode evicts as its radix tree does: oldest-accessed leaf first (testbed/core/radix_lru.py)
        self._radix = RadixLRU(self) if not self.cache_decode and enable_prefix_caching else None
        self._block_refs = enable_prefix_caching and self._radix is None  # `_ref` kept per block

    @property
    def tracks_lookups(self) -> bool:
        """True when the cache's eviction order depends on the scheduler's prefix lookups (SGLang's
        radix tree re-stamps what a lookup matches): the loop replays a plan's lookups (`touch`)."""
        return self._radix is not None

    # --- capacity -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._front) + self._queue.n + self._free_tree

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._front) - self._queue.n - self._free_tree

    def free_order(self) -> Iterator[int]:
        """The free queue from its head (the next block allocated) to its tail."""
        if self._radix is not None:
            return chain(reversed(self._front), self._radix.queued())
        return chain(reversed(self._front), self._queue)

    @property
    def num_free_host_blocks(self) -> int:
        return self.num_host_blocks - self._host_used

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._front) + self._queue.n + self._free_tree

    def blocks_needed(self, state: RequestState, num_new_tokens: int) -> int:
        return max(0, self.blocks_for(state.num_computed + num_new_tokens) - len(state.blocks))

    def num_exclusive_blocks(self, state: RequestState) -> int:
        """Blocks that would join the free queue if this request released its KV."""
        if not state.req.prefix_hashes or not self.enable_prefix_caching:  # nobody else can hold its blocks
            return len(state.blocks)
        ref = self._ref
        if self._radix is not None:  # its tree blocks (its first num_cached_blocks) by node, the rest its alone
            k = min(len(state.blocks), state.num_cached_blocks) if state.num_cached_blocks < PRIVATE else 0
            return len(state.blocks) - k + sum([stop - start for start, stop, e in self._radix.nodes_along(state.blocks, k)
                                                if ref[e] == 1])
        return sum(1 for b in state.blocks if ref[b] == 1)

    # --- prefix cache -----------------------------------------------------------------------
    # Two kinds of keys. A block inside the trace's shared prefix has a content key, chained over
    # the prefix hashes, in `_cached` (key -> holders, first registered first). A block past it
    # holds content only its own request has (prompt tail, outputs): it is tagged with (request,
    # index, registration order) in flat arrays, and only that request, resumed after a recompute
    # preemption, looks it up, among the blocks it held before (`_past_blocks`). Both behave as
    # vLLM's one hash table; the split keeps the common case (every block of every request cached)
    # to a few array writes. In SGLang's mode the tags are the radix node's, once per node
    # (RadixLRU.orid / oj0 / oseq: one insert wrote all its blocks), and a lookup walks the nodes
    # along each past life (`_own_candidates`): page size 1 made the per-block tags a store per token
    # at every insert and another at every eviction.
    def prefix_keys(self, state: RequestState) -> tuple[int, ...]:
        keys = state._block_keys
        if keys is None:
            keys = state._block_keys = prefix_block_keys(state.req, self.block_size)
        return keys

    def may_hit(self, state: RequestState) -> bool:
        """False when no block of the request can be cached: it shares no trace prefix and has
        never held a block, so none of its own blocks was ever registered."""
        return self.enable_prefix_caching and bool(state.req.prefix_hashes or state._past_blocks)

    def may_hit_among(self, states: list[RequestState]) -> list[RequestState]:
        """The requests among `states` that `may_hit`, in one pass (a cache-aware order asks it of its whole
        queue at every plan: a call per request cost more than the test)."""
        if not self.enable_prefix_caching:
            return []
        return [s for s in states if s.req.prefix_hashes or s._past_blocks]

    def candidates(self, state: RequestState, j: int):
        """The cached blocks holding the request's block j, first registered first."""
        keys = self.prefix_keys(state)
        if j < len(keys):
            return self._cached.get(keys[j], ())
        if not state._past_blocks:
            return ()
        if self._radix is not None:  # own content tagged per radix node
            table = self._own_candidates(state, j, j + 1)
            return table[0] if table else ()
        rid, own_rid, own_idx = state.req.id, self._own_rid, self._own_idx
        found = {life[j] for life in state._past_blocks
                 if j < len(life) and own_rid[life[j]] == rid and own_idx[life[j]] == j}
        return sorted(found, key=self._own_seq.__getitem__)

    def _own_hits(self, state: RequestState, start: int, cap: int) -> list[int]:
        """`candidates(state, j)[0]` for j = start, start + 1, ... below cap while there is one, in one pass
        over the request's past lives (a per-j set and sort cost every token of a re-admitted prompt: page
        size 1). Two candidates of one index never share a life, so the least `_own_seq` is the first."""
        lives = state._past_blocks
        out: list[int] = []
        if not lives or start >= cap:
            return out
        if self._radix is not None:  # own content tagged per radix node: a life's valid blocks are one slice
            if len(lives) == 1:
                spans = self._radix.own_spans(lives[0], state.req.id, start, cap)
                return lives[0][start:spans[-1][1]] if spans else out
            return [found[0] for found in self._own_candidates(state, start, cap)]
        rid, own_rid, own_idx, own_seq = state.req.id, self._own_rid, self._own_idx, self._own_seq
        if len(lives) == 1:
            life = lives[0]
            for j in range(start, min(cap, len(life))):
                b = life[j]
                if own_rid[b] != rid or own_idx[b] != j:
                    break
                out.append(b)
            return out
        for j in range(start, cap):
            best = -1
            for life in lives:
                if j < len(life):
                    b = life[j]
                    if own_rid[b] == rid and own_idx[b] == j and (best < 0 or own_seq[b] < own_seq[best]):
                        best = b
            if best < 0:
                break
            out.append(best)
        return out

    def _own_candidates(self, state: RequestState, start: int, cap: int) -> list[list[int]]:
        """SGLang's mode: `candidates(state, j)` for j = start, start + 1, ... below cap while there is one,
        read off the radix nodes along each past life (RadixLRU.own_spans) instead of tags per block."""
        radix, rid = self._radix, state.req.id
        assert radix is not None
        reach = [(life, radix.own_spans(life, rid, start, cap)) for life in state._past_blocks]
        hi = max([spans[-1][1] for _, spans in reach if spans], default=start)
        table: list[dict[int, int]] = [{} for _ in range(hi - start)]  # per index: block -> the life that inserted it
        for life, spans in reach:
            for lo, stop, seq in spans:
                for j in range(lo, stop):
                    table[j - start][life[j]] = seq
        return [sorted(found, key=found.__getitem__) for found in table]

    def _matched_blocks(self, state: RequestState) -> int:
        return len(self._hit_path(state))

    def _hit_path(self, state: RequestState, max_blocks: int | None = None) -> list[int]:
        """The blocks a request holding none would hit (at most `max_blocks`), in order: each one's first
        holder (`candidates(state, j)[0]`), the shared-prefix blocks' read off the cache in C-level passes (a
        key stays only while held), then its own blocks of an earlier life."""
        if not self.may_hit(state):
            return []
        cap = (state.known_len - 1) // self.block_size  # leave at least one token to compute
        if max_blocks is not None:
            cap = min(cap, max_blocks)
        keys = self.prefix_keys(state)
        lim = min(cap, len(keys))
        holders = list(map(self._cached.get, keys[:lim]))
        try:
            del holders[holders.index(None):]
        except ValueError:  # every shared-prefix block is cached: the request's own blocks may follow
            return [h[0] for h in holders] + self._own_hits(state, lim, cap)
        return [h[0] for h in holders]

    def match_prefix(self, state: RequestState) -> int:
        """Known tokens of a request holding no blocks that are already cached (read-only)."""
        return self._matched_blocks(state) * self.block_size

    def admission_blocks(self, state: RequestState, num_new_tokens: int) -> int:
        """Free blocks that admitting a waiting request with `num_new_tokens` would consume:
        its new blocks plus the cached prefix blocks it takes off the free queue."""
        path = self._hit_path(state)
        hit = len(path)
        return self.blocks_for(hit * self.block_size + num_new_tokens) - hit + self._free_cached_count(path)

    def _free_cached_count(self, path: list[int]) -> int:
        """How many of a prefix hit's blocks (`path`, from the sequence's start) are free (queued): those with
        no holder, or in SGLang's mode (holders counted per node, none per block) the tree's free nodes'."""
        if self._radix is not None:
            return self._radix.free_count(path, len(path))
        ref = self._ref
        return sum([1 for b in path if ref[b] == 0])

    def acquire_prefix(self, state: RequestState, max_tokens: int | None = None) -> int:
        """Attach the cached prefix blocks (at most `max_tokens` worth) to a request holding
        none; returns the hit in tokens."""
        path = self._hit_path(state, None if max_tokens is None else max_tokens // self.block_size)
        hit = len(path)
        self.queried_tokens += state.known_len  # as vLLM counts a lookup: every known token
        state.num_cached_blocks = hit
        state._own_from = hit  # blocks from here on are this life's own (`_note_life`)
        if not hit:
            return 0
        ref, queue = self._ref, self._queue
        radix = self._radix
        if radix is not None:  # SGLang's mode: the hit's nodes are locked, one count per node (`inc_lock_ref`)
            blocks = state.blocks
            blocks += path
            radix.split_at(blocks, hit)  # (a node boundary after the hit: its last node's holders differ now)
            for start, stop, e in radix.nodes_along(blocks, hit):
                if ref[e] == 0:
                    radix.revive(e, stop - start)
                ref[e] += 1
            self.hit_tokens += hit * self.block_size
            return hit * self.block_size
        for b in path:
            if ref[b] == 0:
                queue.remove(b)
            ref[b] += 1
        state.blocks += path
        self.hit_tokens += hit * self.block_size
        return hit * self.block_size

    def touch(self, state: RequestState, max_tokens: int) -> None:
        """A lookup of the request's first `max_tokens` tokens in the cache, for SGLang's eviction
        order: the tree blocks it matches are re-stamped (radix_cache.py `_match_prefix_helper`
        L651-675; see testbed/core/radix_lru.py). Nothing else changes; a no-op in vLLM's mode."""
        radix = self._radix
        if radix is None or not self.may_hit(state):
            return
        cap = max_tokens // self.block_size
        keys, cached = self.prefix_keys(state), self._cached
        lim = min(cap, len(keys))
        path = []
        j = 0
        while j < lim:
            holders = cached.get(keys[j])
            if holders is None:
                break
            path.append(holders[0])
            j += 1
        if j == lim:
            path += self._own_hits(state, j, cap)
        radix.touch(path)

    def touch_all(self, lookups: list[tuple[RequestState, int]]) -> None:
        """`touch` for each (request, tokens) lookup, in order; a request that can hit nothing (`may_hit`) is
        skipped before the call (a cache-aware order looks its whole queue up at every plan)."""
        if self._radix is None:
            return
        touch, may_hit = self.touch, self.may_hit
        for s, n in lookups:
            if may_hit(s):
                touch(s, n)

    def register(self, state: RequestState, num_tokens: int) -> None:
        """Cache the request's blocks that its first `num_tokens` tokens fill (called when the
        tokens are scheduled, as vLLM's allocate_slots does)."""
        full = num_tokens // self.block_size
        i = state.num_cached_blocks
        if i >= full or not self.enable_prefix_caching:
            if self._radix is not None and 0 < full <= i < PRIVATE:  # nothing new: the insert still stamps
                self._radix.checkpoint(state.blocks, full, full, state.req.prompt_len // self.block_size)
            return
        blocks = state.blocks
        keys = self.prefix_keys(state)
        cached, key_of = self._cached, self._key_of
        shared = min(full, len(keys))
        if self._radix is not None:  # the tree holds a prefix of what it inserts (leaves go first): where it ends
            first_new = next((j for j in range(i, shared) if keys[j] not in cached), max(i, shared))
        for j in range(i, shared):  # once per shared-prefix block of every prompt
            key, b = keys[j], blocks[j]
            holders = cached.get(key)
            if holders is None:
                cached[key] = [b]
            elif not self.cache_decode:
                # SGLang's radix tree already holds this content (a request prefilled in the same
                # step inserted it first): the insert frees the duplicate and the request reads
                # the tree's copy (radix_cache.py cache_unfinished_req / cache_finished_req)
                self._swap_for_cached(blocks, j, holders[0])
                continue
            else:
                holders.append(b)
            key_of[b] = key
        if i < shared:
            i = shared
        own_at = i
        if i < full:
            if self._radix is None:  # (SGLang's mode tags the node the insert makes, below)
                rid, own_rid = state.req.id, self._own_rid
                for b in blocks[i:full]:  # once per block of every prompt (its index and life: `_note_life`)
                    own_rid[b] = rid
            i = full
        held = state.num_cached_blocks
        state.num_cached_blocks = i
        if self._radix is not None:
            radix = self._radix
            radix.checkpoint(blocks, first_new, full, state.req.prompt_len // self.block_size, state.req.id, own_at)
            if first_new > held:  # it now holds the tree's copies of blocks [held, first_new) (`_swap_for_cached`):
                # their nodes' counts, taken after the insert split the tree there
                ref = self._ref
                for start, stop, e in radix.nodes_along(blocks, first_new):
                    if start >= held:
                        if ref[e] == 0:
                            radix.revive(e, stop - start)
                        ref[e] += 1

    # --- allocation -------------------------------------------------------------------------
    def evict_to_free(self, num_blocks: int) -> None:
        """Drop cached content from free blocks, from the queue's head (evicted first), until at
        least `num_blocks` free blocks cache nothing (SGLang's `evict_to_free_tokens`,
        sglang 0.5.23 mem_cache/allocator/base.py L155-169); in SGLang's mode (cache_decode_tokens
        finished, prefix caching on) the oldest-accessed radix leaves go first (RadixLRU)."""
        if self._radix is not None:
            self._radix.make_uncached(num_blocks)
            return
        queue, own_rid, key_of = self._queue, self._own_rid, self._key_of
        uncached = len(self._front)  # the front caches nothing
        if uncached >= num_blocks:
            return
        for b in queue:  # usually enough uncached blocks sit at the head: stop there
            if own_rid[b] < 0 and b not in key_of:
                uncached += 1
                if uncached >= num_blocks:
                    return
        leaves: dict[int, list[int]] | None = None  # request -> its free blocks caching content only it has
        for b in queue:
            if uncached >= num_blocks:
                break
            rid = own_rid[b]
            if rid >= 0:
                # content only request `rid` has is one leaf of SGLang's radix tree, and the
                # tree evicts whole leaves (radix_cache.py evict): drop all of it that is free
                if leaves is None:
                    leaves = {}
                    for c in queue:
                        if own_rid[c] >= 0:
                            leaves.setdefault(own_rid[c], []).append(c)
                for c in leaves.pop(rid, ()):
                    own_rid[c] = -1
                    uncached += 1
            elif b in key_of:
                self._drop_key(b)
                uncached += 1

    def _drop_key(self, b: int) -> int | None:
        """Block `b` no longer caches its shared content: its key when no device block caches it any more."""
        key = self._key_of.pop(b)
        holders = self._cached[key]
        holders.remove(b)
        if holders:
            return None
        del self._cached[key]
        return key

    def _swap_for_cached(self, blocks: list[int], i: int, other: int) -> None:
        """Hold tree block `other` in place of blocks[i] (SGLang's mode), which is freed uncached (only this
        request held it); `register` counts the holder on `other`'s node once the insert has split it."""
        b = blocks[i]
        blocks[i] = other
        self._front.append(b)

    def _grab(self, blocks: list[int], need: int) -> None:
        """Append `need` blocks from the free queue's head to `blocks` (evicting what they
        cached); capacity was checked. In SGLang's mode the radix tree evicts for them (`_grab_radix`)."""
        if self._radix is not None:
            self._grab_radix(blocks, need)
            return
        need = self._grab_front(blocks, need)
        if not need:
            return
        run = self._queue.take(need)
        ref, own_rid, key_of = self._ref, self._own_rid, self._key_of
        for b in run:  # once per block of every request
            if own_rid[b] >= 0:
                own_rid[b] = -1
            elif b in key_of:
                self._drop_key(b)
            ref[b] = 1
        blocks += run

    def _grab_front(self, blocks: list[int], need: int) -> int:
        """Append up to `need` blocks from the front (they cache nothing: no eviction) to `blocks`,
        in one slice; returns how many are still needed."""
        front = self._front
        n = len(front)
        if not n:
            return need
        if need < n:
            run = front[n - need:]
            del front[n - need:]
        else:
            run = front[:]
            front.clear()
        run.reverse()
        if self._block_refs:  # (SGLang's mode counts no block that caches nothing)
            ref = self._ref
            for b in run:  # a loop stores into a list faster than map(ref.__setitem__, ...) does
                ref[b] = 1
        blocks += run
        return need - len(run)

    def _grab_radix(self, blocks: list[int], need: int) -> None:
        """`_grab` in SGLang's mode: the free blocks that cache nothing first (the queue's head:
        in this mode `_front` holds exactly those), then the blocks the radix tree evicts for the
        rest, in eviction order; a whole leaf's blocks beyond the need stay free at the queue's
        front, next in line."""
        radix = self._radix
        assert radix is not None
        k = self._grab_front(blocks, need)
        if not k:
            return
        start = len(blocks) + k
        radix.evict(k, blocks)  # (no longer queued: they left the tree; no count: they cache nothing)
        if len(blocks) > start:  # a whole leaf beyond the need: its rest stays free, next in line
            self._to_front(blocks[start:])
            del blocks[start:]

    def _to_front(self, evicted: list[int]) -> None:
        """Free blocks just evicted (uncached now, so no longer in their release's run) move to the
        queue's head, the first of them first in line."""
        if evicted:
            self._front += evicted[::-1]

    def allocate(self, state: RequestState, num_new_tokens: int) -> None:
        need = self.blocks_for(state.num_computed + num_new_tokens) - len(state.blocks)
        if need <= 0:
            return
        if need > len(self._front) + self._queue.n + self._free_tree:
            raise KVCapacityError(f"needed {need} KV blocks, {self.num_free_blocks} free")
        front = self._front
        if need == 1 and front:  # a decode step's one block (page size 1: every step), without the calls
            b = front.pop()  # the queue's head in either mode: it caches nothing, so it evicts nothing
            if self._block_refs:
                self._ref[b] = 1
            state.blocks.append(b)
            return
        self._grab(state.blocks, need)

    def grow_decode_run(self, states: list[RequestState], k: int, lag: int = 0) -> bool:
        """A fast-forwarded run of `k` decode steps, in one call: each request (in order) takes the
        blocks its next `k` tokens need and, caching decode tokens when scheduled, registers its full
        blocks, as `allocate` then `register` would per step (but the last `lag` tokens: under vLLM's async
        scheduling the run's last one is cached after the next schedule, testbed/core/loop.py `in_flight`).
        False, changing nothing, when the free blocks do not cover them all."""
        bs = self.block_size
        needs = [-(-(s.num_computed + k) // bs) - len(s.blocks) for s in states]
        if sum([n for n in needs if n > 0]) > len(self._front) + self._queue.n + self._free_tree:
            return False
        if self._radix is not None:  # SGLang's mode: each request's blocks as `allocate` takes them
            for s, need in zip(states, needs):
                if need > 0:
                    self._grab_radix(s.blocks, need)
            return True
        # `_grab` and `register`'s tagging of a request's own blocks, inlined (a request mostly takes
        # 0 or 1 block here, so the calls would cost more than the work); blocks inside a shared
        # prefix, and a subclass's own register, take the calls
        take, ref, own_rid, key_of = self._queue.take, self._ref, self._own_rid, self._key_of
        caching = self.enable_prefix_caching  # holder counts kept (see __init__)
        tag = self.cache_decode and caching
        inline_register = type(self).register is BlockManager.register
        front = self._front
        for s, need in zip(states, needs):
            blocks = s.blocks
            if need > 0 and front:
                if need == 1:  # the usual decode step's block, without a call
                    b = front.pop()
                    if caching:
                        ref[b] = 1
                    blocks.append(b)
                    need = 0
                else:
                    need = self._grab_front(blocks, need)
            if need > 0:
                run = take(need)
                for b in run:
                    if own_rid[b] >= 0:
                        own_rid[b] = -1
                    elif b in key_of:
                        self._drop_key(b)
                    ref[b] = 1
                blocks += run
            if tag:
                full = (s.num_computed + k - lag) // bs
                i = s.num_cached_blocks
                if full > i:
                    keys = s._block_keys
                    if not inline_register or keys is None or len(keys) > i:
                        self.register(s, s.num_computed + k - lag)
                        continue
                    rid = s.req.id
                    for j in range(i, full):
                        own_rid[blocks[j]] = rid
                    s.num_cached_blocks = full
        return True

    def free(self, state: RequestState, finished: bool = False) -> None:
        """Release every block, tail first: cached ones to the free queue's end (evicted last,
        LRU), uncached ones to its front (reused first), as `BlockPool.free_blocks` does. An
        unfinished request remembers them, to re-hit its own when it comes back."""
        if self._radix is not None:
            self._free_into_tree(state, finished)
            return
        blocks = state.blocks
        if not self.enable_prefix_caching:  # nothing cached or shared: every block to the front, as below
            self._front += blocks  # the last block first in line
            if finished:
                state._past_blocks = []
            state.blocks = []
            state.num_cached_blocks = 0
            return
        ref, queue, key_of, own_rid = self._ref, self._queue, self._key_of, self._own_rid
        k = state.num_cached_blocks
        if finished and not self.cache_decode and self.enable_prefix_caching and k < PRIVATE:
            # SGLang inserts the whole finished sequence into its tree: its full blocks queue as cached
            if len(self.prefix_keys(state)) > k:  # shared content decoded (a session's parent: its answer
                # blocks carry ids its next turn shares): inserted under those keys, so that turn hits them
                keys = self.prefix_keys(state)
                self.register(state, min(len(keys), len(blocks), state.num_computed // self.block_size) * self.block_size)
                k = state.num_cached_blocks
            k = max(k, min(len(blocks), state.num_computed // self.block_size))
        if (not state.req.prefix_hashes or not self.enable_prefix_caching) and k < PRIVATE:
            # the common case: nobody else holds its blocks (its keys are its own, or nothing is
            # cached: no block is ever shared or tagged), the first k are cached, queued tail first
            for b in blocks:
                ref[b] = 0
            queue.push(blocks[:k][::-1])
            self._front += blocks[k:]  # the last block first in line
        else:
            first, tail = [], []
            as_cached = k if k < PRIVATE else 0  # registered, or (SGLang, finished) full
            for i in range(len(blocks) - 1, -1, -1):
                b = blocks[i]
                ref[b] -= 1
                if ref[b] == 0:
                    if i < as_cached or own_rid[b] >= 0 or b in key_of:
                        tail.append(b)
                    else:
                        first.append(b)
            queue.push(tail)
            self._front += first[::-1]  # the last block first in line
        if finished:
            state._past_blocks = []
        elif self.enable_prefix_caching and state.blocks:
            if k < PRIVATE:
                self._note_life(state, k)
            state._past_blocks.append(state.blocks)
        state.blocks = []
        state.num_cached_blocks = 0

    def _note_life(self, state: RequestState, k: int) -> None:
        """A life ends unfinished: the blocks among its first k that it registered as its own note their
        index and the life (`candidates` reads them, looking up the blocks a later life may hit). Lives are
        numbered in order, and a life registers all its blocks before the next begins, so this orders them
        as their registration did; blocks it hit keep the life that registered them."""
        self._seq += 1
        seq, rid, blocks = self._seq, state.req.id, state.blocks
        radix = self._radix
        if radix is not None:  # per node: the nodes this life inserted (RadixLRU.oseq)
            orid, oj0, oat, oseq = radix.orid, radix.oj0, radix.oat, radix.oseq
            for start, stop, e in radix.nodes_along(blocks, min(k, len(blocks))):
                if start >= state._own_from and orid[e] == rid and oat[e] - oj0[e] < stop - start:
                    oseq[e] = seq
            return
        own_rid, own_idx, own_seq = self._own_rid, self._own_idx, self._own_seq
        for j in range(state._own_from, min(k, len(blocks))):
            b = blocks[j]
            if own_rid[b] == rid:
                own_idx[b] = j
                own_seq[b] = seq

    def _free_into_tree(self, state: RequestState, finished: bool) -> None:
        """`free` in SGLang's mode: a finished request's whole computed sequence is inserted into
        the tree first (`release_kv_cache(checkpoint=True)`, mem_cache/common.py L400-439:
        `RadixCache.checkpoint` up to the KV it owns, L510-543), then every block is unlocked: tree
        blocks become evictable leaves (`dec_lock_ref`, radix_cache.py L597-616), the rest (a
        retracted request's decode tokens, a partial page) are freed at the free queue's front."""
        radix, bs = self._radix, self.block_size
        assert radix is not None
        blocks = state.blocks
        if finished and state.num_cached_blocks < PRIVATE:
            self.register(state, min(len(blocks), state.num_computed // bs) * bs)
        ref, is_leaf, rel = self._ref, radix.is_leaf, radix.rel
        k = state.num_cached_blocks
        # its tree blocks are its first k (what it hit and registered, a node boundary after them), the rest
        # cache nothing (check_invariants): each node's count drops by one (`dec_lock_ref`, per node), and a
        # node it leaves free names this release (RadixLRU.rel)
        k = min(k, len(blocks)) if k < PRIVATE else 0
        nodes = radix.nodes_along(blocks, k)
        no = radix.next_release()  # the tree blocks freed now queue as one run (RadixLRU.runs)
        if not state.req.prefix_hashes:
            # the common case: nobody else holds its blocks (its own content), so every node it held is
            # free now (a chain: only the last can be a leaf), queued in order
            for _, _, e in nodes:
                ref[e] -= 1
                rel[e] = no
            if k:  # (the list itself when it is all tree blocks: nothing changes it once released)
                radix.released(no, [(blocks if k == len(blocks) else blocks[:k], False)], k,
                               [blocks[k - 1]] if is_leaf(blocks[k - 1]) else [])
        else:  # tail first: the nodes no other request holds, each queued last block first
            leaves, paths, count = [], [], 0
            for start, stop, e in reversed(nodes):
                ref[e] -= 1
                if ref[e] == 0:
                    rel[e] = no
                    paths.append((blocks[start:stop], True))
                    count += stop - start
                    if is_leaf(e):
                        leaves.append(e)
            radix.released(no, paths, count, leaves)
        self._front += blocks[k:][::-1]  # blocks[k] first in line
        if finished:
            state._past_blocks = []
        elif blocks:
            if k < PRIVATE:
                self._note_life(state, k)
            state._past_blocks.append(blocks)
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
        if n > self.num_free_blocks:
            raise KVCapacityError(f"swap in needed {n} KV blocks, {self.num_free_blocks} free")
        self._grab(state.blocks, n)
        state.num_cached_blocks = PRIVATE  # swapped-in copies are never registered
        self._host_used -= n
        state.swapped_blocks = 0
        return n

    def preview(self) -> "KVPreview":
        """A read-only preview of this cache for a policy's plan (see KVPreview)."""
        return KVPreview(self)

    # --- checking -------------------------------------------------------------------------------
    def check_invariants(self, states: Iterable[RequestState]) -> None:
        """Every block is exactly one of free (queued) / owned, ref counts match owners, and
        the cache's two maps agree."""
        states = list(states)
        owners = [0] * self.num_blocks
        free = set(self.free_order())
        assert len(free) == self.num_free_blocks, "a block is queued twice"
        radix = self._radix
        tree = radix.tree_blocks() if radix is not None else set()
        for b in self._front:
            assert self._own_rid[b] < 0 and b not in self._key_of and b not in tree, f"block {b} caches content at the queue's front"
        host = 0
        for s in states:
            assert len(set(s.blocks)) == len(s.blocks), f"request {s.id} holds a block twice: {s.blocks}"
            for b in s.blocks:
                owners[b] += 1
            host += s.swapped_blocks
        for b in range(self.num_blocks):
            where = (b in free) + (owners[b] > 0)
            assert where == 1, f"block {b}: queued={b in free} owners={owners[b]}"
            if not self.enable_prefix_caching:  # `_ref` unwritten: one holder at most, nothing cached
                assert owners[b] <= 1, f"block {b} is shared by {owners[b]} requests without prefix caching"
                continue
            if self._radix is not None:  # counts per node (below); a block caching nothing has one holder at most
                assert owners[b] <= 1 or b in tree, f"block {b} caches nothing but has {owners[b]} holders"
                continue
            assert self._ref[b] == owners[b], f"block {b}: ref count {self._ref[b]} but {owners[b]} owners"
            if owners[b] > 1:
                assert b in self._key_of, f"block {b} is shared by {owners[b]} requests but is not a cached block"
        for key, blocks in self._cached.items():
            assert blocks, f"key {key} maps to no block"
            for b in blocks:
                assert self._key_of.get(b) == key, f"cache maps key to block {b} but the block's key differs"
        assert len(self._key_of) == sum(len(v) for v in self._cached.values()), "a keyed block is not in the cache"
        for b in self._key_of:
            assert self._own_rid[b] < 0, f"block {b} caches a shared key and a request's own content"
        assert host == self._host_used, f"host blocks used {self._host_used}, swapped states hold {host}"
        if radix is not None:
            for e, node in radix.blocks_of.items():  # a node's count: the requests holding it, each its every block
                for x in node:
                    assert owners[x] == self._ref[e], f"block {x}: {owners[x]} holders, its node {e} counts {self._ref[e]}"
            for s in states:  # its tree blocks: the first num_cached_blocks, a node boundary after them
                k = min(s.num_cached_blocks, len(s.blocks)) if s.num_cached_blocks < PRIVATE else 0
                assert all(b in tree for b in s.blocks[:k]), f"request {s.id}: a block it registered left the tree"
                assert not any(b in tree for b in s.blocks[k:]), f"request {s.id}: an unregistered block is in the tree"
                assert k == 0 or s.blocks[k - 1] in radix.blocks_of, f"request {s.id}: its tree blocks end inside a node"
            radix.check()


_ITEMS = object()  # KVPreview._pending: an entry holding a list of scheduled (request, tokens) items


class KVPreview:
    """The cache as a plan's earlier items will leave it, read-only, for a policy that admits
    the way vLLM does: one request after another, each seeing the blocks those before it
    registered (requests sharing a prefix in one step share it), not the cached blocks their
    allocations evicted from the free queue's head, and the free blocks they left.

    The loop's `_apply` then does the same operations in the same order on the BlockManager,
    so a plan made through a preview gets exactly the hits it counted on. Only the order
    before any preemption is followed (vLLM admits nothing in a step that preempted).
    """

    def __init__(self, kv: BlockManager):
        self.kv = kv
        self._head = kv.free_order()  # the queue is not changed while a policy plans
        self._taken: set[int] = set()  # queued blocks this plan's allocations take (and evict)
        self._touched: set[int] = set()  # queued cached blocks this plan's hits take off the queue
        self._new: set = set()  # keys this plan's items register
        # the plan's items so far, played into the sets above only when a request that may hit
        # asks (`match`): a trace with no shared prefix and no re-admission never pays for them
        self._pending: list[tuple] = []

    def take(self, n: int) -> None:
        """`n` blocks allocated from the free queue's head (evicting what they held)."""
        self._pending.append((None, n, None))

    def admit(self, state: RequestState, hit: int, revive: list[int], num_tokens: int) -> None:
        """A waiting request takes its hit (`match`) and `num_tokens` new tokens' blocks."""
        self._pending.append((state, num_tokens, (hit, revive)))

    def schedule(self, state: RequestState, num_tokens: int) -> None:
        """A running request is given `num_tokens` more."""
        self._pending.append((state, num_tokens, None))

    def schedule_items(self, items: list[tuple[RequestState, int]]) -> None:
        """`schedule` for each (running request, tokens) item, in order, in one call (kept as the list:
        most plans never play it)."""
        self._pending.append((_ITEMS, items, None))

    def _catch_up(self) -> None:
        kv, bs = self.kv, self.kv.block_size
        for state, n, admitted in self._pending:
            if state is None:
                self._take(n)
            elif state is _ITEMS:  # every running request of the step: `_take` and `_register` inlined
                # their blocks taken in one `_take` (nothing is touched between two of them, so it takes the same
                # blocks), and the keys of a request only looked at while it has shared keys not cached yet
                caching, new = kv.enable_prefix_caching, self._new
                need = 0
                for s, k in n:
                    upto = s.num_computed + k
                    more = -(-upto // bs) - len(s.blocks)  # kv.blocks_needed
                    if more > 0:
                        need += more
                    if caching:
                        keys = s._block_keys  # kv.prefix_keys(s), read inline where known
                        if keys is None:
                            keys = kv.prefix_keys(s)
                        cached = s.num_cached_blocks
                        if len(keys) > cached and upto // bs > cached:
                            new.update(keys[cached:upto // bs])
                self._take(need)
            elif admitted is None:
                self._take(kv.blocks_needed(state, n))
                self._register(state, state.num_cached_blocks, state.num_computed + n)
            else:
                self._catch_up_admission(state, n, *admitted)
        self._pending.clear()

    def _catch_up_admission(self, state: RequestState, n: int, hit: int, revive: list) -> None:
        self._touched.update(revive)
        self._take(self.kv.blocks_for(hit * self.kv.block_size + n) - hit)
        self._register(state, hit, hit * self.kv.block_size + n)

    def _take(self, n: int) -> None:
        taken, touched = self._taken, self._touched
        for _ in range(n):
            for b in self._head:
                if b not in touched:
                    taken.add(b)
                    break

    def _register(self, state: RequestState, start: int, num_tokens: int) -> None:
        """Note the shared-prefix keys an item registers (its own blocks no one else can hit)."""
        if self.kv.enable_prefix_caching:
            keys = self.kv.prefix_keys(state)
            self._new.update(keys[start:min(len(keys), num_tokens // self.kv.block_size)])

    def match(self, state: RequestState) -> tuple[int, list[int]]:
        """(full blocks a waiting request would hit, the queued blocks among them it would revive)."""
        kv = self.kv
        if not kv.may_hit(state):
            return 0, []
        if self._pending:
            self._catch_up()
        cap = (state.known_len - 1) // kv.block_size
        keys = kv.prefix_keys(state)
        if kv._radix is not None:
            return self._match_radix(state, cap, keys)
        ref, taken, touched, new, cached = kv._ref, self._taken, self._touched, self._new, kv._cached
        revive: list[int] = []
        n = 0
        # the shared-prefix blocks first, their holders read straight off the cache (`candidates`' first case,
        # inlined: this runs once per prefix block of every admission a policy plans)
        for n in range(min(cap, len(keys))):
            block = None
            for b in cached.get(keys[n], ()):
                if b not in taken:
                    block = b
                    break
            if block is None:
                if keys[n] not in new:
                    return n, revive
            elif ref[block] == 0 and block not in touched:  # free: queued (a cached block is never in _front)
                revive.append(block)
        else:
            n = min(cap, len(keys))
        while n < cap:
            block = next((b for b in kv.candidates(state, n) if b not in taken), None)
            if block is None and not (n < len(keys) and keys[n] in new):
                break
            if block is not None and ref[block] == 0 and block not in touched:
                revive.append(block)
            n += 1
        return n, revive

    def _match_radix(self, state: RequestState, cap: int, keys: tuple[int, ...]) -> tuple[int, list[int]]:
        """`match` in SGLang's mode, where holders are counted per node, not per block: the hit is the tree's
        path from the root (each content is held once, and the tree holds a path's every prefix), read
        node by node for which of its blocks are free (RadixLRU.rel at a node's last block)."""
        kv = self.kv
        radix = kv._radix
        assert radix is not None
        taken, touched, new, cached = self._taken, self._touched, self._new, kv._cached
        blocks_of, end, rel = radix.blocks_of, radix.end, radix.rel
        revive: list[int] = []
        nk = min(cap, len(keys))
        own = kv._own_candidates(state, nk, cap) if nk == len(keys) and state._past_blocks else []
        stop, free = 0, False  # where the path's current node ends, and whether it is free
        n = 0
        while n < cap:
            if n < nk:
                holders = cached.get(keys[n])
                on_path = holders[0] if holders else None
                block = on_path if on_path is not None and on_path not in taken else None
            else:
                found = own[n - nk] if n - nk < len(own) else []
                on_path = found[0] if found else None
                block = next((b for b in found if b not in taken), None)
            if block is None and not (n < len(keys) and keys[n] in new):
                break
            if on_path is not None:
                if n == stop:  # the path enters a node at its first block
                    e = end[on_path]
                    stop, free = n + len(blocks_of[e]), rel[e] != 0
                if block is not None and free and block not in touched:
                    revive.append(block)
            n += 1
        return n, revive
