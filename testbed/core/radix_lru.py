"""SGLang's radix-cache eviction order, kept over a BlockManager's blocks (`kv.cache_decode_tokens=finished`).

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

Here a tree node is a run of blocks, and everything about it lives once per node: `blocks_of[e]` lists
its blocks, first to last, under its last block `e` (a leaf, a branch or a split point: the keys are
exactly the nodes' ends); at `e`, `head[e]` is its first block, `kids[e]` how many nodes hang under it
and `stamp[e]` its last access (a tick of a logical clock: one tick per lookup or insert, as the real
clock orders them); at its first block `h`, `end[h]` is `e` and `parent[h]` the last block of the node
above (-1 at the root). So a lookup or an insert re-stamps the nodes of its path, one store per node,
not per token (SGLang's page size 1 makes every token a block), walking up from the path's last block
by `head` and `parent`; a split finds the node it cuts by walking down the path a node at a step
(`end`, and the node's length), and an eviction takes a node's blocks in one lookup. Nothing is
stored per block of a node (an earlier form linked each block to the next: one store per block at an
insert, and an eviction's walk of those links was one dependent read, a cache miss, per evicted block,
26 M of them over the Azure conversation trace). Values at other positions are stale and never read
(a stale heap entry whose block no longer ends a node is recognised by `blocks_of`). The heap holds
(stamp, last block) entries pushed when a node becomes a free leaf or a free leaf is re-stamped; an
entry is stale once its block's stamp, lock or children changed, and is skipped when popped (lazy
deletion; the heap is compacted once it holds more than twice as many entries as the tree has
blocks). A lookup or a split costs O(nodes on its path), an insert O(1) beyond the slice of blocks it
adds, an eviction O(blocks it frees): never O(cache size).
The per-block tree it replaces (one stamp, parent and child count per block) is kept as the reference
model of the property tests (tests/radix_lru_ref.py), which hold the two to the same evictions.

The BlockManager keeps, in this mode, every free block that caches nothing at the front of its
free queue and every free tree block behind them, so an allocation takes uncached blocks first
and evicts only for the rest, as SGLang's allocator evicts only the shortfall
(`evict_to_free_tokens`, mem_cache/allocator/base.py L155-169): it takes the evicted blocks in
eviction order and leaves those a whole leaf freed beyond its need at the queue's front, next in
line, so one allocation of n blocks and n allocations of one take the same blocks.
"""
from __future__ import annotations

import heapq
from typing import Iterator


class RadixLRU:
    """The radix tree's shape and access stamps over `kv`'s blocks (a BlockManager in SGLang mode)."""

    def __init__(self, kv):
        n = kv.num_blocks
        self.kv = kv
        self.head = [-1] * n  # at a node's end: its first block
        self.end = [-1] * n  # at a node's first block: its last block
        self.parent = [-1] * n  # at a node's first block: the end of the node above it, -1 at the root
        self.kids = [0] * n  # at a node's end: its child nodes
        self.stamp = [0] * n  # at a node's end: its last access
        self.blocks_of: dict[int, list[int]] = {}  # node end -> the node's blocks, first to last
        # What a node's blocks cache, at its end, as one insert (`checkpoint`) wrote all of them: the request
        # whose sequence they are (`orid`, -1 for a host load's), the index of the node's first block in it
        # (`oj0`), and where its own content begins (`oat`): blocks before are shared-prefix blocks (keyed,
        # kv._key_of), the rest content only that request has, which only its later lives look up (kv.py
        # `_own_candidates`), by `oseq`, the number of the life that inserted them (kv._seq, set when that life
        # ends unfinished; 0 before). Kept per node, not per block: with page size 1 a tag per block was a
        # store per token at every insert and another at every eviction, a third of SGLang's run on the
        # Azure conversation trace (issue 27).
        self.orid = [-1] * n
        self.oj0 = [0] * n
        self.oat = [0] * n
        self.oseq = [0] * n
        self.clock = 0
        self.heap: list[tuple[int, int]] = []
        self.size = 0  # tree blocks
        # The free queue's cached part (free tree blocks, in the order they were freed; their count is
        # kv._free_tree), one entry per release: (release number, the paths it freed). A path is a list of
        # tree blocks that were whole nodes along one branch when freed, from the root down, with whether
        # the queue holds them in reverse (a release queues a request's nodes tail first, or, when nobody
        # else held any of them, its whole path in order): kept as the request's own lists, so a release
        # costs per node, not per block. A node is free exactly while `rel[e]` at its last block names the
        # release that freed it (0 while held; nodes split later copy it to both halves): what says a tree
        # block is free, as its holder count is kept per node too (kv._ref at the node's last block;
        # SGLang's `lock_ref` per TreeNode, radix_cache.py `inc_lock_ref` / `dec_lock_ref` L582-616 walk
        # nodes, not tokens), and a block that caches nothing has none (held by the request whose list
        # holds it, or free). Reviving or evicting a node changes its `rel` (or drops the node) and
        # nothing listed: a listed path is read node by node (`_queued_in`). Values of `rel` at blocks
        # that end no node are stale and never read (an earlier form stored the release at every block,
        # and zeroed it at every eviction: with page size 1 that was a scattered store per token at each
        # release and each eviction, a fifth of SGLang's 4x-load run on the Azure conversation trace).
        self.rel = [0] * n
        self.runs: list[tuple[int, list[tuple[list[int], bool]]]] = []
        self.releases = 0
        self.listed = 0  # blocks listed in runs, live or stale
        # release number -> its run's blocks still queued there, for every listed run: a run with none is
        # dropped whole when the runs are compacted, without a look at its blocks (a block-by-block filter,
        # three scattered reads per listed block, was a fifth of SGLang's 4x-load run on the Azure
        # conversation trace). Counted per node at an eviction and at a revival (a node's blocks share
        # their holders, so one release freed them all).
        self.live: dict[int, int] = {}
        self.slack = 65536  # stale listed blocks tolerated beyond the bound (tests set it low: compact often)

    # --- membership ---------------------------------------------------------------------
    def tree_blocks(self) -> set[int]:
        """Every block of the tree's nodes (for checks: O(tree size))."""
        return {x for node in self.blocks_of.values() for x in node}

    def is_leaf(self, b: int) -> bool:
        """Tree block b ends a node that has no child."""
        return b in self.blocks_of and self.kids[b] == 0

    def _tick(self) -> int:
        self.clock += 1
        return self.clock

    def _push_if_leaf(self, e: int) -> None:
        """A free childless node (ending at e) is an evictable leaf (`_update_leaf_status`, L790-803)."""
        if self.kids[e] == 0 and self.kv._ref[e] == 0:
            heapq.heappush(self.heap, (self.stamp[e], e))
            if len(self.heap) > 2 * self.size + 64:
                self._compact()

    def _compact(self) -> None:
        live = {(t, b) for t, b in self.heap if self._valid(t, b)}
        self.heap = sorted(live)

    def _valid(self, t: int, b: int) -> bool:
        return self.stamp[b] == t and b in self.blocks_of and self.kids[b] == 0 and self.kv._ref[b] == 0

    # --- the tree's operations ----------------------------------------------------------
    def _split(self, path: list[int], j: int, t: int) -> None:
        """A walk along `path` (tree blocks from the root) stopped at path[j]: if that block's node goes
        on, its tail becomes a node of its own (`_split_node`, L677-700), stamped `t` (the walk entered
        that node) unless t < 0, when both halves keep the node's stamp."""
        b = path[j]
        blocks_of = self.blocks_of
        if b in blocks_of:  # it ends its node
            return
        e, start = self._node_at(path, j)
        node = blocks_of[e]
        cut = j - start + 1
        c = node[cut]
        blocks_of[b] = node[:cut]
        blocks_of[e] = node[cut:]
        head, end, stamp = self.head, self.end, self.stamp
        h = head[e]
        head[b] = h
        end[h] = b
        head[e] = c
        end[c] = e
        self.parent[c] = b
        self.kids[b] = 1
        ref, rel = self.kv._ref, self.rel
        ref[b] = ref[e]  # both halves keep the node's holders, and its release while free
        rel[b] = rel[e]
        self.orid[b] = self.orid[e]  # ... and what it caches, the tail from its cut on
        self.oat[b] = self.oat[e]
        self.oseq[b] = self.oseq[e]
        oj0 = self.oj0
        oj0[b] = oj0[e]
        oj0[e] += cut
        if t < 0:
            stamp[b] = stamp[e]
            return
        stamp[b] = t
        stamp[e] = t
        self._push_if_leaf(e)

    def nodes_along(self, path: list[int], n: int) -> list[tuple[int, int, int]]:
        """(start, stop, last block) of each node that path[:n] runs through, from the root (path: tree
        blocks from the root, a node boundary after its first n, as a held or hit prefix has)."""
        blocks_of, end = self.blocks_of, self.end
        out = []
        start = 0
        while start < n:
            e = end[path[start]]
            stop = start + len(blocks_of[e])
            out.append((start, stop, e))
            start = stop
        return out

    def own_spans(self, life: list[int], rid: int, lo: int, cap: int) -> list[tuple[int, int, int]]:
        """(start, stop, inserting life) of the nodes along a past life of request `rid` (its blocks, from
        the root) whose blocks life[lo:cap] still cache its own content at those indices, clipped to
        [lo, cap): one run from lo (a lookup is asked for a request holding no blocks, so every life of it
        has ended and noted its nodes). The life's whole nodes are walked (`_whole_nodes`), and the walk
        ends at one that another request inserted (its blocks were evicted and taken again); a block this
        life held that a later life of the same request took back at the same index is found along that
        later life."""
        orid, oseq = self.orid, self.oseq
        out: list[tuple[int, int, int]] = []
        n = min(cap, len(life))
        for i, stop, e, _ in self._whole_nodes(life, n):
            if stop > lo:
                if orid[e] != rid:  # (a node's index is its depth, so it is the one the life has it at)
                    break
                out.append((max(i, lo), min(stop, n), oseq[e]))
        return out

    def _whole_nodes(self, path: list[int], n: int) -> Iterator[tuple[int, int, int, list[int]]]:
        """(start, stop, last block, blocks) of each node along `path` from its first block (a node's first:
        nodes only split), starting below n, while the path's next blocks are exactly a node's: a block that
        begins no node of them ends the walk (that node was evicted, so were all below it, and their
        blocks now cache something else or nothing)."""
        blocks_of, end = self.blocks_of, self.end
        i = 0
        while i < n:
            e = end[path[i]]
            node = blocks_of.get(e)
            if node is None:
                return
            stop = i + len(node)
            if node != path[i:stop]:
                return
            yield i, stop, e, node
            i = stop

    def _node_at(self, path: list[int], j: int) -> tuple[int, int]:
        """(the last block of the node holding path[j], where that node starts in path): the path's
        nodes from the root, one step per node."""
        blocks_of, end = self.blocks_of, self.end
        start = 0
        while True:
            e = end[path[start]]
            n = len(blocks_of[e])
            if start + n > j:
                return e, start
            start += n

    def _stamp_path(self, e: int, t: int) -> None:
        """Stamp `t` on the node ending at tree block e and every node above it."""
        stamp, head, parent = self.stamp, self.head, self.parent
        while e >= 0:
            stamp[e] = t
            e = parent[head[e]]

    def touch(self, path: list[int]) -> None:
        """A lookup matched these tree blocks, from the root (`match_prefix` / `touch_prefix`):
        re-stamp their nodes, the one it stopped inside split there."""
        if not path:
            return
        t = self._tick()
        last = path[-1]
        self._split(path, len(path) - 1, t)
        self._stamp_path(last, t)
        self._push_if_leaf(last)

    def split_at(self, blocks: list[int], n: int) -> None:
        """A request locks the tree's first n blocks of its path: a node boundary after them (the
        lookup that found them split there)."""
        if n:
            self._split(blocks, n - 1, -1)

    def checkpoint(self, blocks: list[int], m: int, full: int, prompt: int, rid: int = -1, own_at: int = 0) -> None:
        """The request's blocks[:full] are tree blocks, [m, full) just added: SGLang's
        `RadixCache.checkpoint` (L510-543): insert the sequence (stamps the path, splits where it
        left the tree, the new tail one node), re-insert the prompt (splits at its page boundary,
        L487-502), then look the sequence up again (L524), which stamps the whole path last. The added
        blocks from `own_at` on cache request `rid`'s own content, those before it shared-prefix keys."""
        t1 = self._tick()
        t3 = t1 + 1  # the lookup after the insert (below)
        if m:
            self._split(blocks, m - 1, t1)  # the node it left the tree inside keeps this insert's stamp
        if m < full:
            # one node: its blocks listed, its facts stored once (the lookup's stamp already: nothing
            # between reads it)
            seg = blocks[m:full]
            prev = seg[-1]
            self.blocks_of[prev] = seg
            self.head[prev] = seg[0]
            self.end[seg[0]] = prev
            self.kids[prev] = 0
            self.stamp[prev] = t3
            self.kv._ref[prev] = 1  # its one holder: the request that computed (or loaded) it
            self.rel[prev] = 0  # held
            self.orid[prev] = rid if own_at < full else -1
            self.oj0[prev] = m
            self.oat[prev] = max(own_at, m)
            self.oseq[prev] = 0
            if m:
                p = blocks[m - 1]
                self.parent[seg[0]] = p
                self.kids[p] += 1
            else:
                self.parent[seg[0]] = -1
            self.size += full - m
        if 0 < prompt < full:
            self._split(blocks, prompt - 1, -1)
        self.clock = t3
        if m:
            self._stamp_path(blocks[m - 1], t3)
            if m == full:
                self._split(blocks, full - 1, t3)

    def added(self, blocks: list[int], start: int, end: int) -> None:
        """blocks[start:end] (held) joined the tree under blocks[start - 1] as one new node, stamped
        now (a host tier's load-back: `init_load_back` inserts the loaded pages)."""
        if start >= end:
            return
        self.checkpoint(blocks, start, end, 0, -1, end)  # (every loaded block is a shared-prefix one)

    # --- release, revive, evict ------------------------------------------------------------
    def next_release(self) -> int:
        """The number of the next release: its caller marks `rel[e]` with it at the end of each node it frees."""
        self.releases += 1
        return self.releases

    def released(self, no: int, paths: list[tuple[list[int], bool]], count: int, leaves: list[int]) -> None:
        """Release `no` queued these paths' `count` tree blocks (their nodes' last holder unlocked them, and
        marked each node's `rel`), in this order, at the free queue's end; `leaves` are the nodes among them
        that have no child."""
        kv = self.kv
        if count:
            kv._free_tree += count
            self.runs.append((no, paths))
            self.live[no] = count
            self.listed += count
            if self.listed > 4 * kv._free_tree + self.slack:  # mostly stale
                self._compact_runs()
        for b in leaves:
            self._push_if_leaf(b)

    def _queued_in(self, path: list[int], no: int) -> list[int]:
        """The blocks of a listed path still queued by release `no`, from the root down: its whole nodes
        (`_whole_nodes`) whose `rel` names that release."""
        rel = self.rel
        out: list[int] = []
        for _, _, e, node in self._whole_nodes(path, len(path)):
            if rel[e] == no:
                out += node
        return out

    def _compact_runs(self) -> None:
        """Drop the runs none of whose blocks is queued (by their counts); if the rest are still mostly
        stale, keep only their queued blocks (a look at each node: amortised O(1) per listed block, as the
        next compaction waits for as many new ones)."""
        kv, live = self.kv, self.live
        kept = []
        for no, paths in self.runs:
            if live[no]:
                kept.append((no, paths))
            else:
                del live[no]
        listed = sum([len(p) for _, paths in kept for p, _ in paths])
        if listed > 2 * kv._free_tree + self.slack // 2:
            queued_in = self._queued_in
            kept = [(no, [(q, back) for q, back in ((queued_in(p, no), back) for p, back in paths) if q])
                    for no, paths in kept]
            listed = kv._free_tree
        self.runs = kept
        self.listed = listed

    def queued(self) -> Iterator[int]:
        """The free tree blocks in queue order (released first first)."""
        live, queued_in = self.live, self._queued_in
        for no, paths in self.runs:
            if not live[no]:
                continue  # none of it is queued any more
            for path, back in paths:
                q = queued_in(path, no)
                yield from (reversed(q) if back else q)

    def revive(self, e: int, count: int) -> None:
        """The free node ending at tree block e (its `count` blocks) left the free queue: a request locked it."""
        rel = self.rel
        self.kv._free_tree -= count
        self.live[rel[e]] -= count
        rel[e] = 0  # held: no release's any more

    def make_uncached(self, num_blocks: int) -> None:
        """Evict until `num_blocks` free blocks cache nothing, or nothing is evictable
        (`evict_to_free_tokens`: evict the shortfall); the evicted blocks go to the free queue's
        front, in eviction order."""
        short = num_blocks - (self.kv.num_free_blocks - self.kv._free_tree)
        if short > 0:
            self.kv._to_front(self.evict(short))

    def evict(self, num_blocks: int, out: list[int] | None = None) -> list[int]:
        """`RadixCache.evict`: oldest leaf node first, whole nodes, until `num_blocks` are freed;
        returns the evicted blocks, in eviction order (each node from its last block to its first;
        still in the free queue, where they were), appended to `out` when given (an allocation's list:
        with page size 1 every copy of a node's blocks is a pass over as many tokens)."""
        kv = self.kv
        heap, parent, kids, stamp, head = self.heap, self.parent, self.kids, self.stamp, self.head
        ref, blocks_of, oat, oj0 = kv._ref, self.blocks_of, self.oat, self.oj0
        live, rel = self.live, self.rel
        if out is None:
            out = []
        evicted = 0
        while evicted < num_blocks and heap:
            t, b = heapq.heappop(heap)
            if stamp[b] != t or b not in blocks_of or kids[b] or ref[b]:
                continue  # stale
            h = head[b]
            node = blocks_of.pop(b)
            n = len(node)
            live[rel[b]] -= n  # (one release freed the whole node: its blocks share their holders)
            keyed = oat[b] - oj0[b]  # its shared-prefix blocks (its first): their keys go, last first (a host
            if keyed > 0:  # tier keeps dropped keys in this order); its own content needs nothing dropped
                for x in reversed(node[:keyed]):
                    kv._drop_key(x)
            out += reversed(node)  # the node, last block first
            evicted += n
            p = parent[h]
            if p >= 0:
                kids[p] -= 1
                if kids[p] == 0 and ref[p] == 0:
                    heapq.heappush(heap, (stamp[p], p))
        kv._free_tree -= evicted
        self.size -= evicted
        return out

    def free_count(self, path: list[int], n: int) -> int:
        """How many of path[:n] are free (queued) tree blocks: path is tree blocks from the root, as a
        prefix hit's are; read node by node."""
        blocks_of, end, rel = self.blocks_of, self.end, self.rel
        free = start = 0
        while start < n:
            e = end[path[start]]
            stop = start + len(blocks_of[e])
            if rel[e]:
                free += min(stop, n) - start
            start = stop
        return free

    # --- checking ---------------------------------------------------------------------------
    def check(self) -> None:
        kv = self.kv
        n = kv.num_blocks
        tree = [False] * n
        for node in self.blocks_of.values():
            for x in node:
                assert not tree[x], f"block {x} is in two nodes"
                tree[x] = True
        assert self.size == sum(tree), f"tree size {self.size}, {sum(tree)} tree blocks"
        for b in kv._key_of:
            assert tree[b], f"block {b} caches a shared key off the tree"
        assert kv._free_tree == sum(1 for b in kv.free_order() if tree[b]), "free tree-block count is off"
        assert self.listed == sum(len(p) for _, paths in self.runs for p, _ in paths), "listed blocks miscounted"
        assert sorted(self.live) == sorted(no for no, _ in self.runs), "a run without its count, or a count without its run"
        for no, paths in self.runs:
            queued = sum(len(self._queued_in(p, no)) for p, _ in paths)
            assert self.live[no] == queued, f"release {no}: {self.live[no]} blocks counted queued, {queued} are"
        free_nodes = {x for e, node in self.blocks_of.items() if self.rel[e] for x in node}
        assert set(self.queued()) == free_nodes, "the queued tree blocks are not the free nodes' blocks"
        seen_cached = False
        for b in kv.free_order():  # free blocks caching nothing come first
            if tree[b]:
                seen_cached = True
            else:
                assert not seen_cached, f"uncached free block {b} behind a cached one"
        head, parent = self.head, self.parent
        kids = [0] * n
        ends = list(self.blocks_of)
        for e in ends:  # each node: its blocks from head to end, one holder count, under a tree node's end
            node = self.blocks_of[e]
            h = node[0]
            assert node[-1] == e and head[e] == h and self.end[h] == e, f"node ending at {e}: head and end disagree"
            keyed = min(max(0, self.oat[e] - self.oj0[e]), len(node))  # its first blocks hold shared keys, the rest own content
            assert all(x in kv._key_of for x in node[:keyed]), f"node ending at {e}: a shared-prefix block without its key"
            assert not any(x in kv._key_of for x in node[keyed:]), f"node ending at {e}: an own-content block with a key"
            assert keyed == len(node) or self.orid[e] >= 0, f"node ending at {e}: own content of no request"
            assert (self.rel[e] != 0) == (kv._ref[e] == 0), f"node ending at {e}: free by `rel`, held by its count, or back"
            p = parent[h]
            if p >= 0:
                assert tree[p] and p in self.blocks_of, f"node ending at {e} hangs under block {p}, not a node's end"
                kids[p] += 1
                assert kv._ref[p] >= kv._ref[e], f"block {e} held by more requests than its parent {p}"
        heap = set(self.heap)
        for e in ends:
            assert kids[e] == self.kids[e], f"block {e}: {self.kids[e]} children counted, {kids[e]} found"
            if kids[e] == 0 and kv._ref[e] == 0:
                assert (self.stamp[e], e) in heap, f"evictable leaf {e} missing from the heap"
