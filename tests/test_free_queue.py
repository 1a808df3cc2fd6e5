"""The list-based free queue (testbed/core/free_queue.py) against the OrderedDict it replaced: runs queued at
the tail, blocks taken out of the middle (prefix hits, leaving stale entries behind), runs taken off the head,
the same blocks in the same order throughout, across the list's compaction too."""
from __future__ import annotations

from collections import OrderedDict

from hypothesis import given, settings
from hypothesis import strategies as st

import testbed.core.free_queue as fq
from testbed.core.free_queue import FreeQueue

ops = st.lists(st.tuples(st.sampled_from(["push", "push", "remove", "take"]), st.integers(0, 12),
                         st.integers(0, 10 ** 6)), max_size=120)


@settings(max_examples=400, deadline=None)
@given(ops=ops, compact=st.sampled_from([1, 2, 5, 1 << 16]))
def test_free_queue_matches_an_ordered_dict(ops, compact):
    saved = fq._COMPACT
    fq._COMPACT = compact  # compaction exercised often, or (the default) never in so short a run
    try:
        q, ref = FreeQueue(), OrderedDict()
        held = list(range(40))  # blocks not queued
        for op, k, seed in ops:
            if op == "push" and held:
                run = [held.pop(seed % len(held)) for _ in range(min(k, len(held)))]
                q.push(run)
                for b in run:
                    ref[b] = None
            elif op == "remove" and ref:
                b = list(ref)[seed % len(ref)]
                q.remove(b)
                del ref[b]
                held.append(b)
            elif op == "take":
                k = min(k, len(ref))
                run = q.take(k)
                assert run == [ref.popitem(last=False)[0] for _ in range(k)]
                held += run
            assert list(q) == list(ref) and q.n == len(ref) == len(q)
    finally:
        fq._COMPACT = saved
