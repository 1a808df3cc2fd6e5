"""The per-block radix tree that testbed/core/radix_lru.py kept before its nodes were runs (HEAD 3866720),
kept as the reference model its property tests compare the run-based tree with, step by step.

SGLang's radix-cache eviction order, kept over a BlockManager's blocks (`kv.cache_decode_tokens=finished`).

Why: which cached prefix survives a shortage decides later hits, and SGLang does not evict the
way vLLM does (least recently released block first). Its `RadixCache.evict` (sglang 0.5.23
mem_cache/radix_cache.py L552-580) takes the evictable leaves (no child, no lock) into a heap
keyed by `last_access_time` (`LRUStrategy.get_priority`, mem_cache/evict_policy.py L16-18),
pops the oldest, frees the whole node (every page of it), pushes its parent once that is a
childless unlocked node, and stops once at least the tokens asked for are freed. A lookup
(`_match_prefix_helper`, L651-675) and an insert (`_insert_helper`, L705-760) stamp every node
they enter with one access time, the node where the walk stops inside included (its tail is
split off, L660-663 / L728-735, and keeps that stamp); a node made by an insert is stamped at
its creation (`TreeNode.__init__`, L259).

Here a tree node is a run of blocks: `parent[b]` is the block holding the content before b's
(-1 at the root), `cont[b]` the next block of b's own node (-1 where b ends its node: a leaf, a
branch or a split point), `kids[b]` how many tree blocks hang under b, `stamp[b]` its node's
last access (a tick of a logical clock: one tick per lookup or insert, as the real clock orders
them). Every block of a node shares its stamp, so only a node's last block is ever keyed in the
heap. The heap holds (stamp, block) entries pushed when a block becomes a free leaf or a free
leaf is re-stamped; an entry is stale once its block's stamp, lock or children changed, and is
skipped when popped (lazy deletion; the heap is compacted once it holds more than twice as
many entries as the tree has blocks). A lookup costs O(blocks it walks), an eviction O(blocks it frees): never O(cache size).

The BlockManager keeps, in this mode, every free block that caches nothing at the front of its
free queue and every free tree block behind them, so an allocation takes uncached blocks first
and evicts only for the rest, as SGLang's allocator evicts only the shortfall
(`evict_to_free_tokens`, mem_cache/allocator/base.py L155-169): it takes the evicted blocks in
eviction order and leaves those a whole leaf freed beyond its need at the queue's front, next in
line, so one allocation of n blocks and n allocations of one take the same blocks.
"""
from __future__ import annotations

import heapq


class RadixLRURef:
    """The radix tree's shape and access stamps over `kv`'s blocks (a BlockManager in SGLang mode)."""

    def __init__(self, kv):
        n = kv.num_blocks
        self.kv = kv
        self.parent = [-1] * n
        self.cont = [-1] * n
        self.kids = [0] * n
        self.stamp = [0] * n
        self.clock = 0
        self.heap: list[tuple[int, int]] = []
        self.free_cached = 0  # tree blocks in the free queue (evictable)
        self.size = 0  # tree blocks

    # --- membership ---------------------------------------------------------------------
    def in_tree(self, b: int) -> bool:
        kv = self.kv
        return kv._own_rid[b] >= 0 or b in kv._key_of

    def is_leaf(self, b: int) -> bool:
        return self.kids[b] == 0

    def _tick(self) -> int:
        self.clock += 1
        return self.clock

    def _push_if_leaf(self, b: int) -> None:
        """A free childless tree block is an evictable leaf (`_update_leaf_status`, L790-803)."""
        if self.kids[b] == 0 and self.kv._ref[b] == 0:
            heapq.heappush(self.heap, (self.stamp[b], b))
            if len(self.heap) > 2 * self.size + 64:
                self._compact()

    def _compact(self) -> None:
        live = {(t, b) for t, b in self.heap if self._valid(t, b)}
        self.heap = sorted(live)

    def _valid(self, t: int, b: int) -> bool:
        return self.stamp[b] == t and self.kids[b] == 0 and self.kv._ref[b] == 0 and self.in_tree(b)

    # --- the tree's operations ----------------------------------------------------------
    def _split(self, b: int, t: int | None) -> None:
        """A walk stopped at block b: if b's node goes on, its tail becomes a node of its own
        (`_split_node`, L677-700), stamped `t` (the walk entered that node) unless t is None."""
        c = self.cont[b]
        if c < 0:
            return
        self.cont[b] = -1
        if t is None:
            return
        stamp, cont = self.stamp, self.cont
        x = c
        while True:
            stamp[x] = t
            nx = cont[x]
            if nx < 0:
                break
            x = nx
        self._push_if_leaf(x)

    def touch(self, path: list[int]) -> None:
        """A lookup matched these tree blocks, from the root (`match_prefix` / `touch_prefix`):
        re-stamp them, and the node it stopped inside, which is split there."""
        if not path:
            return
        t = self._tick()
        stamp = self.stamp
        for b in path:  # a loop stores into a list several times faster than map(stamp.__setitem__, ...)
            stamp[b] = t
        last = path[-1]
        self._split(last, t)
        self._push_if_leaf(last)

    def split_at(self, blocks: list[int], n: int) -> None:
        """A request locks the tree's first n blocks of its path: a node boundary after them (the
        lookup that found them split there)."""
        if n:
            self._split(blocks[n - 1], None)

    def checkpoint(self, blocks: list[int], m: int, full: int, prompt: int) -> None:
        """The request's blocks[:full] are tree blocks, [m, full) just added: SGLang's
        `RadixCache.checkpoint` (L510-543): insert the sequence (stamps the path, splits where it
        left the tree, the new tail one node), re-insert the prompt (splits at its page boundary,
        L487-502), then look the sequence up again (L524), which stamps the whole path last."""
        t1 = self._tick()
        t3 = t1 + 1  # the lookup after the insert (below)
        stamp = self.stamp
        if m:
            self._split(blocks[m - 1], t1)  # the node it left the tree inside keeps this insert's stamp
        if m < full:
            # blocks outside the tree have no children and no node continuation (evict resets them)
            parent, cont, kids = self.parent, self.cont, self.kids
            seg = blocks[m:full]
            head = seg[0]
            parent[head] = blocks[m - 1] if m else -1
            if m:
                kids[blocks[m - 1]] += 1
            # one loop over the node's blocks (this runs over every block of every prompt and answer:
            # Python 3.11 stores into a list in a loop several times faster than map(list.__setitem__, ...))
            # (the new blocks take the lookup's stamp here already: nothing between reads it)
            prev = head
            stamp[head] = t3
            for b in seg[1:]:
                parent[b] = prev
                cont[prev] = b
                kids[prev] = 1
                stamp[b] = t3
                prev = b
            self.size += full - m
        if 0 < prompt < full:
            self._split(blocks[prompt - 1], None)
        self.clock = t3
        for b in blocks[:m]:
            stamp[b] = t3
        if m == full and full:
            self._split(blocks[full - 1], t3)

    def added(self, blocks: list[int], start: int, end: int) -> None:
        """blocks[start:end] (held) joined the tree under blocks[start - 1] as one new node, stamped
        now (a host tier's load-back: `init_load_back` inserts the loaded pages)."""
        if start >= end:
            return
        self.checkpoint(blocks, start, end, 0)

    # --- release, revive, evict ------------------------------------------------------------
    def released(self, n: int, leaves: list[int]) -> None:
        """n tree blocks entered the free queue (their last holder unlocked them); `leaves` are
        those among them with no child."""
        self.free_cached += n
        for b in leaves:
            self._push_if_leaf(b)

    def revived(self, n: int) -> None:
        """n free tree blocks left the free queue (a request locked them)."""
        self.free_cached -= n

    def make_uncached(self, num_blocks: int) -> None:
        """Evict until `num_blocks` free blocks cache nothing, or nothing is evictable
        (`evict_to_free_tokens`: evict the shortfall); the evicted blocks go to the free queue's
        front, in eviction order."""
        short = num_blocks - (self.kv.num_free_blocks - self.free_cached)
        if short > 0:
            self.kv._to_front(self.evict(short))

    def evict(self, num_blocks: int) -> list[int]:
        """`RadixCache.evict`: oldest leaf node first, whole nodes, until `num_blocks` are freed;
        returns the evicted blocks, in eviction order (still in the free queue, where they were)."""
        kv = self.kv
        heap, parent, cont, kids, stamp = self.heap, self.parent, self.cont, self.kids, self.stamp
        ref, own_rid, key_of = kv._ref, kv._own_rid, kv._key_of
        out: list[int] = []
        evicted = 0
        while evicted < num_blocks and heap:
            t, b = heapq.heappop(heap)
            if stamp[b] != t or kids[b] or ref[b] or not (own_rid[b] >= 0 or b in key_of):
                continue  # stale
            node = [b]  # the node: b back to its first block
            x, p = b, parent[b]
            while p >= 0 and cont[p] == x:
                x = p
                node.append(x)
                p = parent[x]
            for x in node:  # then one pass to drop it from the tree
                if own_rid[x] >= 0:
                    own_rid[x] = -1
                else:
                    kv._drop_key(x)
                parent[x] = -1
                kids[x] = 0
                cont[x] = -1
            out += node
            evicted += len(node)
            if p >= 0:
                kids[p] -= 1
                if kids[p] == 0 and ref[p] == 0:
                    heapq.heappush(heap, (stamp[p], p))
        self.free_cached -= evicted
        self.size -= evicted
        return out

    # --- checking ---------------------------------------------------------------------------
    def check(self) -> None:
        kv = self.kv
        n = kv.num_blocks
        tree = [self.in_tree(b) for b in range(n)]
        assert self.size == sum(tree), f"tree size {self.size}, {sum(tree)} tree blocks"
        assert self.free_cached == sum(1 for b in kv.free_order() if tree[b]), "free tree-block count is off"
        seen_cached = False
        for b in kv.free_order():  # free blocks caching nothing come first
            if tree[b]:
                seen_cached = True
            else:
                assert not seen_cached, f"uncached free block {b} behind a cached one"
        kids = [0] * n
        for b in range(n):
            if not tree[b]:
                continue
            p = self.parent[b]
            if p >= 0:
                assert tree[p], f"tree block {b} hangs under block {p}, not in the tree"
                kids[p] += 1
                assert kv._ref[p] >= kv._ref[b], f"block {b} held by more requests than its parent {p}"
            c = self.cont[b]
            if c >= 0:
                assert self.parent[c] == b and kv._ref[c] == kv._ref[b] and self.stamp[c] == self.stamp[b], \
                    f"blocks {b} -> {c} of one node differ in parent, holders or stamp"
        heap = set(self.heap)
        for b in range(n):
            if tree[b]:
                assert kids[b] == self.kids[b], f"block {b}: {self.kids[b]} children counted, {kids[b]} found"
                if self.cont[b] >= 0:
                    assert kids[b] == 1, f"block {b} continues its node but has {kids[b]} children"
                if kids[b] == 0 and kv._ref[b] == 0:
                    assert (self.stamp[b], b) in heap, f"evictable leaf {b} missing from the heap"
