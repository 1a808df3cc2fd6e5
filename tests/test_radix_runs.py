"""SGLang's radix tree kept per node and its free blocks queued per release (testbed/core/kv.py,
radix_lru.py) against the per-block bookkeeping they replaced (tests/kv_ref.py, radix_lru_ref.py:
HEAD 3866720's), step by step: the same operations on both take the same blocks, hit the same
prefixes and leave the same free queue, so the run-based tree evicts in exactly the order the
per-block one did."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kv_ref import BlockManagerRef
from testbed.core.kv import BlockManager
from testbed.core.request import Request, RequestState


def _state(rid, prompt, out, hashes):
    return RequestState(Request(id=rid, arrival=0.0, prompt_len=prompt, output_len=out,
                                prefix_hashes=tuple(hashes), prefix_block_tokens=4))


def _pair(num_blocks, block_size, mode="finished"):
    new = BlockManager(num_blocks, block_size, True, 0, mode)
    ref = BlockManagerRef(num_blocks, block_size, True, 0, mode)
    return new, ref


def _same(new, ref, states_new, states_ref):
    assert list(new.free_order()) == list(ref.free_order())
    assert new.num_free_blocks == ref.num_free_blocks and new.num_used_blocks == ref.num_used_blocks
    if new._radix is not None:
        assert new._radix.size == ref._radix.size
    for rid, s in states_new.items():
        r = states_ref[rid]
        assert s.blocks == r.blocks and s.num_cached_blocks == r.num_cached_blocks
        if not s.blocks:  # (a lookup is defined for a request holding none: in SGLang's mode a live life's own
            assert new.match_prefix(s) == ref.match_prefix(r)  # blocks are tagged per node, not as the
            # per-block reference's stale index tags would read them until that life ends)


def _other_op(kv, op, r, chunk, tokens, run, wait):
    """An operation but an admission: a running request's prefill chunk, decode tokens (registered as
    scheduled in vLLM's mode), retraction (it waits again, holding nothing) or finish; a waiting request's
    lookup; an eviction."""
    if op == "evict":
        kv.evict_to_free(tokens % kv.num_blocks + 1)
    if r in wait and op == "look_up":
        kv.touch(wait[r], wait[r].known_len)
    if r not in run:
        return
    s = run[r]
    if op == "prefill" and s.num_computed < s.req.prompt_len:
        n = min(s.req.prompt_len - s.num_computed, 1 + chunk * 3)
        if kv.can_allocate(kv.blocks_needed(s, n)):
            kv.allocate(s, n)
            s.num_computed += n
            kv.register(s, s.num_computed)
    elif op == "grow" and s.num_computed >= s.req.prompt_len:
        n = chunk + 1
        if kv.can_allocate(kv.blocks_needed(s, n)):
            kv.allocate(s, n)
            s.num_computed += n
            s.num_generated += n
            if kv.cache_decode:
                kv.register(s, s.num_computed)
    elif op == "retract":
        kv.free(s)
        s.num_computed = 0
        s.num_generated = 0
        del run[r]
        wait[r] = s
    elif op == "finish":
        kv.free(s, finished=True)
        del run[r]


ops = st.lists(
    st.tuples(st.sampled_from(["admit", "admit", "prefill", "grow", "grow", "retract", "finish",
                               "look_up", "evict"]),
              st.integers(0, 9), st.integers(1, 40), st.lists(st.integers(0, 2), max_size=5),
              st.integers(0, 3)),
    min_size=1, max_size=80)


@settings(max_examples=300, deadline=None)
@given(num_blocks=st.integers(8, 96), block_size=st.sampled_from([1, 1, 2, 4]), ops=ops,
       mode=st.sampled_from(["finished", "finished", "scheduled"]), slack=st.sampled_from([-10**9, -16, -4, 0, 65536]))
def test_run_based_radix_tree_matches_the_per_block_one(num_blocks, block_size, ops, mode, slack):
    # admissions (looked up, hit, allocated in chunks), decodes, retractions (a retracted request comes
    # back and re-hits its own prompt, whose blocks note their index and life only then), finishes,
    # lookups and evictions, on both block managers in lockstep; in vLLM's mode too (decode blocks
    # registered as scheduled, evicted least recently released first)
    new, ref = _pair(num_blocks, block_size, mode)
    if new._radix is not None:  # the released runs compacted (dead runs dropped, the rest filtered block by
        new._radix.slack = slack  # block) at every release (-10**9), often (-16, -4, 0), or never in so small a
        # cache (the default): the same blocks queued in the same order
    kvs = (new, ref)
    running: tuple[dict, dict] = ({}, {})  # rid -> state, per manager
    waiting: tuple[dict, dict] = ({}, {})  # retracted: rid -> state
    rid = 0
    slots: dict[int, int] = {}  # slot -> rid
    for op, slot, tokens, hashes, chunk in ops:
        r = slots.get(slot)
        for kv, run, wait in zip(kvs, running, waiting):
            if op == "admit":
                if r is None:
                    s = _state(rid + 1, tokens, 1 + tokens % 7, hashes)
                elif r in wait:
                    s = wait[r]
                else:
                    continue
                kv.touch(s, s.known_len - 1)
                s.num_computed = kv.acquire_prefix(s)
                n = min(s.req.prompt_len - s.num_computed, 1 + chunk * 5)
                if kv.can_allocate(kv.blocks_needed(s, n)):
                    kv.allocate(s, n)
                    s.num_computed += n
                    kv.register(s, s.num_computed)
                    run[s.id] = s
                    wait.pop(s.id, None)
                else:
                    kv.free(s)
                    wait[s.id] = s
            else:
                _other_op(kv, op, r, chunk, tokens, run, wait)
        if op == "admit" and r is None:
            rid += 1
            slots[slot] = rid
        for kv, run in zip(kvs, running):
            kv.check_invariants(run.values())
        _same(new, ref, running[0], running[1])
        for w_new, w_ref in zip(waiting[0].values(), waiting[1].values()):
            assert new.match_prefix(w_new) == ref.match_prefix(w_ref)
    for kv, run in zip(kvs, running):
        for s in list(run.values()):
            kv.free(s, finished=True)
        kv.evict_to_free(num_blocks)
        kv.check_invariants([])
    assert list(new.free_order()) == list(ref.free_order())


def test_a_lookup_stamps_whole_nodes_and_the_oldest_leaf_goes_first():
    # page size 1: A (6 tokens) and B (6) are retracted, prompts cached; a lookup of A's first 3
    # splits A there and stamps both halves (the walk entered A's node), so B is the oldest leaf: the
    # 4 blocks C needs evict B whole (6), 2 of them left uncached at the queue's head, and A still
    # hits all it may (5 of 6 tokens: one is left to compute), as the per-block tree has it
    new, ref = _pair(12, 1)
    evicted = []
    for kv in (new, ref):
        a, b = _state(1, 6, 1, ()), _state(2, 6, 1, ())
        for s in (a, b):
            kv.allocate(s, 6)
            s.num_computed = 6
            kv.register(s, 6)
        kv.free(b)  # retracted: its prompt stays cached, and it can look it up
        kv.free(a)
        kv.touch(a, 3)
        kv.check_invariants([])
        c = _state(3, 4, 1, ())
        kv.allocate(c, 4)
        kv.check_invariants([c])
        evicted.append((c.blocks, list(kv.free_order()), kv.match_prefix(a), kv.match_prefix(b)))
    assert evicted[0] == evicted[1]
    assert evicted[0][2] == 5 and evicted[0][3] == 0 and len(evicted[0][1]) == 8  # B's 2 spare blocks, then A's 6


def test_a_release_whose_blocks_all_left_the_queue_is_dropped_whole():
    # page size 1, a cache of 64 tokens, one 10-token request after another, each finished: once the cache is
    # full each allocation evicts the oldest request's leaf whole, so that release's run holds nothing queued;
    # with compaction forced at every release the run goes by its count (no look at its blocks), the queue
    # stays the per-block reference's, and a request that was retracted and re-hits part of its prompt
    # (a revival) takes its blocks off its run's count too
    new, ref = _pair(64, 1)
    new._radix.slack = -10**9
    for i in range(12):
        for kv in (new, ref):
            s = _state(i + 1, 10, 3, [])
            kv.touch(s, s.known_len - 1)
            s.num_computed = kv.acquire_prefix(s)
            kv.allocate(s, 10)
            s.num_computed = 10
            kv.register(s, 10)
            kv.free(s, finished=i % 3 != 2)
            if i % 3 == 2:  # retracted: it comes back and re-hits its prompt
                s.num_computed = 0
                kv.touch(s, s.known_len - 1)
                s.num_computed = kv.acquire_prefix(s)
                assert s.num_computed == 9
                kv.allocate(s, 1)
                s.num_computed = 10
                kv.register(s, 10)
                kv.free(s, finished=True)
            kv.check_invariants([])
        assert list(new.free_order()) == list(ref.free_order())
    radix = new._radix
    assert min(radix.live) > 1 and len(radix.runs) == len(radix.live) < 12
    assert all(radix.live.values())


own_ops = st.lists(
    st.tuples(st.sampled_from(["admit", "admit", "prefill", "grow", "retract", "retract", "finish", "look_up",
                               "evict", "fill"]),
              st.integers(0, 3), st.integers(1, 30), st.integers(0, 4), st.booleans()),
    min_size=1, max_size=120)


@settings(max_examples=300, deadline=None)
@given(num_blocks=st.integers(10, 48), block_size=st.sampled_from([1, 1, 2]), ops=own_ops,
       hashes=st.lists(st.integers(0, 1), max_size=3))
def test_a_retracted_requests_own_blocks_are_found_by_node_as_by_block(num_blocks, block_size, ops, hashes):
    # SGLang's mode tags a request's own content per radix node (RadixLRU.orid / oj0 / oat / oseq), where the
    # per-block reference tags every block: a few requests retracted again and again (so several past lives,
    # each hitting part of the one before, the hit sometimes capped as a chunked admission caps it), others
    # filling the cache so that their blocks are evicted and taken again; after every operation each waiting
    # request finds the same candidates at every index of its own content, the same hit, and the same
    # preview match, as the per-block tags give
    new, ref = _pair(num_blocks, block_size)
    kvs = (new, ref)
    running: tuple[dict, dict] = ({}, {})
    waiting: tuple[dict, dict] = ({}, {})
    rid = 0
    slots: dict[int, int] = {}
    for op, slot, tokens, chunk, capped in ops:
        r = slots.get(slot)
        for kv, run, wait in zip(kvs, running, waiting):
            if op == "admit" and (r is None or r in wait):
                s = wait[r] if r is not None else _state(rid + 1, tokens, 1 + tokens % 5, hashes if slot == 0 else ())
                kv.touch(s, s.known_len - 1)
                cap = (1 + chunk * 3) * block_size if capped else None
                s.num_computed = kv.acquire_prefix(s, cap)
                n = min(s.known_len - s.num_computed, 1 + chunk * 4)
                if n > 0 and kv.can_allocate(kv.blocks_needed(s, n)):
                    kv.allocate(s, n)
                    s.num_computed += n
                    kv.register(s, min(s.num_computed, s.req.prompt_len))
                    run[s.id] = s
                    wait.pop(s.id, None)
                else:
                    kv.free(s)
                    wait[s.id] = s
            elif op == "fill":  # another request takes blocks, evicting, and leaves finished
                s = _state(10_000 + rid, tokens, 1, ())
                n = min(tokens, kv.num_free_blocks * block_size)
                if n:
                    kv.allocate(s, n)
                    s.num_computed = n
                    kv.register(s, n)
                    kv.free(s, finished=True)
            else:
                _other_op(kv, op, r, chunk, tokens, run, wait)
        if op in ("admit", "fill"):
            rid += 1
            if op == "admit" and r is None:
                slots[slot] = rid
        for kv, run in zip(kvs, running):
            kv.check_invariants(run.values())
        _same(new, ref, running[0], running[1])
        p_new, p_ref = new.preview(), ref.preview()
        for w_new, w_ref in zip(waiting[0].values(), waiting[1].values()):
            assert new.match_prefix(w_new) == ref.match_prefix(w_ref)
            assert p_new.match(w_new) == p_ref.match(w_ref)
            for j in range(len(new.prefix_keys(w_new)), (w_new.known_len - 1) // block_size):
                assert list(new.candidates(w_new, j)) == list(ref.candidates(w_ref, j)), (w_new.id, j)


def test_two_lives_holding_one_index_give_both_candidates_first_inserted_first():
    # page size 1: a request prefills its 8-token prompt and is retracted (life A, one node); it comes back
    # hitting only 2 tokens (a capped admission), computes one more into a new block, and is retracted again
    # (life B): index 2 is cached twice, A's block first (A inserted it first), and it hits A's whole prompt
    # but the last token; then one leaf is evicted (the cache short of one block caching nothing): A's rest,
    # the older, so B's block at index 2 is left, and it hits 3 tokens
    new, ref = _pair(24, 1)
    seen = []
    for kv in (new, ref):
        other, s = _state(2, 10, 1, ()), _state(1, 8, 2, ())
        kv.allocate(other, 10)  # (it takes the lowest blocks and gives them back uncached, so that B's
        kv.allocate(s, 8)  # block at index 2 is numbered below A's: the order is by life, not block)
        kv.free(other, finished=True)
        s.num_computed = 8
        kv.register(s, 8)
        kv.free(s)  # life A
        s.num_computed = kv.acquire_prefix(s, 2)
        kv.allocate(s, 1)
        s.num_computed = 3
        kv.register(s, 3)
        life_b2 = s.blocks[2]
        kv.free(s)  # life B
        kv.check_invariants([])
        both = list(kv.candidates(s, 2))
        hit = kv.match_prefix(s)
        kv.evict_to_free(kv.num_blocks - 9 + 1)  # (9 tree blocks: A's 8 and B's 1)
        kv.check_invariants([])
        seen.append((both, life_b2, hit, list(kv.candidates(s, 2)), kv.match_prefix(s)))
    assert seen[0] == seen[1]
    both, life_b2, hit, after, hit_after = seen[0]
    assert len(both) == 2 and both[1] == life_b2 < both[0] and hit == 7
    assert after == [life_b2] and hit_after == 3
