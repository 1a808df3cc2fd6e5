"""The part of vLLM's free block queue that may cache content, as one list read from a moving head.

vLLM keeps every free block in one doubly linked list (`FreeKVCacheBlockQueue`, vllm/v1/core/kv_cache_utils.py
L246): an allocation takes blocks from its head, a release appends a request's blocks to its tail, and a prefix
hit takes a cached block out of its middle (`remove`). The block manager keeps the uncached front of that
queue apart (`BlockManager._front`); this is the rest. An OrderedDict modelled it one entry per block: with
16-token blocks every request queues and dequeues about as many entries as it has prompt and output tokens
over 16, and those calls were a tenth of the main command's time (issue 27). Here a release appends its run
in one list extension and an allocation slices its run off the head; only a hit in the middle costs per block.

A block taken out of the middle leaves its entry behind, counted in `_stale`. The block is queued again only at
the tail, so all its stale entries lie ahead of its live one: reading from the head, an entry whose block
still has stale entries outstanding is one of them, and is skipped.
"""
from __future__ import annotations

from typing import Iterator

_COMPACT = 1 << 16  # entries read past before the list drops them


class FreeQueue:
    """Blocks in queue order (the next taken first); `n` is how many are queued."""

    __slots__ = ("_q", "_h", "n", "_stale")

    def __init__(self) -> None:
        self._q: list[int] = []
        self._h = 0  # the head: entries before it were taken
        self.n = 0
        self._stale: dict[int, int] = {}  # block -> entries of it left behind by `remove`, not yet read past

    def push(self, blocks: list[int]) -> None:
        """Queue `blocks` at the tail, the first of them first."""
        self._q += blocks
        self.n += len(blocks)

    def remove(self, b: int) -> None:
        """Take queued block `b` out (a prefix hit revives it)."""
        stale = self._stale
        stale[b] = stale.get(b, 0) + 1
        self.n -= 1

    def take(self, k: int) -> list[int]:
        """The first `k` blocks (k <= n), taken off the head."""
        q, h, stale = self._q, self._h, self._stale
        if not stale:
            run = q[h:h + k]
            h += k
        else:
            run = []
            while len(run) < k:
                b = q[h]
                h += 1
                c = stale.get(b)
                if c is None:
                    run.append(b)
                elif c == 1:
                    del stale[b]
                else:
                    stale[b] = c - 1
        self.n -= k
        if h >= _COMPACT and 2 * h >= len(q):
            del q[:h]
            h = 0
        self._h = h
        return run

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[int]:
        """The queued blocks from the head, lazily (a caller reads only as far as it needs: the queue holds
        most of the cache's blocks); the queue must not change while this is read."""
        q, stale = self._q, self._stale
        if not stale:
            return map(q.__getitem__, range(self._h, len(q)))
        return self._live(stale)

    def _live(self, stale: dict[int, int]) -> Iterator[int]:
        q = self._q
        passed: dict[int, int] = {}  # stale entries read past so far, per block
        for i in range(self._h, len(q)):
            b = q[i]
            c = stale.get(b)
            if c is not None:
                p = passed.get(b, 0)
                if p < c:
                    passed[b] = p + 1
                    continue
            yield b
