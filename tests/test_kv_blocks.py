"""The paged KV block manager: allocation, free, prefix sharing, eviction, swap, and
property tests that no block is ever leaked or double-owned."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from testbed.core.kv import BlockManager, KVCapacityError, prefix_block_keys
from testbed.core.request import Request, RequestState


def state(rid, prompt, hashes=(), out=4, block_tokens=512):
    return RequestState(Request(id=rid, arrival=0.0, prompt_len=prompt, output_len=out,
                                prefix_hashes=tuple(hashes), prefix_block_tokens=block_tokens))


def run_prefill(kv, s, tokens=None):
    """Admit a request and compute `tokens` of it (default: the whole prompt)."""
    s.num_computed = kv.acquire_prefix(s)
    n = (tokens if tokens is not None else s.req.prompt_len) - s.num_computed
    kv.allocate(s, n)
    s.num_computed += n
    kv.register(s, s.num_computed)


def test_allocate_and_free_counts():
    kv = BlockManager(10, 4)
    s = state(1, 10)
    assert kv.blocks_needed(s, 10) == 3
    kv.allocate(s, 10)
    assert len(s.blocks) == 3 and kv.num_free_blocks == 7 and kv.num_used_blocks == 3
    s.num_computed = 10
    assert kv.blocks_needed(s, 2) == 0 and kv.blocks_needed(s, 3) == 1  # 12 fits in 3 blocks, 13 does not
    kv.free(s)
    assert s.blocks == [] and kv.num_free_blocks == 10
    kv.check_invariants([s])


def test_failed_allocation_changes_nothing_and_names_numbers():
    kv = BlockManager(4, 4)
    a, b = state(1, 12), state(2, 12)
    kv.allocate(a, 12)
    with pytest.raises(KVCapacityError) as e:
        kv.allocate(b, 12)
    assert "3" in str(e.value) and "1 free" in str(e.value)
    assert b.blocks == [] and kv.num_free_blocks == 1
    kv.check_invariants([a, b])


@pytest.mark.parametrize("bs", [16, 48, 512, 1024])
def test_prefix_sharing_any_block_size(bs):
    kv = BlockManager(200, bs)
    a = state(1, 2048, hashes=(1, 2, 3, 4))
    b = state(2, 2048, hashes=(1, 2, 9, 9))  # shares the first 1024 tokens
    run_prefill(kv, a)
    assert kv.match_prefix(b) == (1024 // bs) * bs
    run_prefill(kv, b)
    shared = (1024 // bs)
    assert a.blocks[:shared] == b.blocks[:shared]
    assert not set(a.blocks[shared:]) & set(b.blocks[shared:])
    kv.check_invariants([a, b])


def test_keys_equal_only_for_equal_prefixes():
    a = prefix_block_keys(Request(0, 0, 1024, 1, (1, 2)), 16)
    b = prefix_block_keys(Request(1, 0, 1024, 1, (1, 3)), 16)
    c = prefix_block_keys(Request(2, 0, 1000, 1, (1, 2)), 16)
    assert len(a) == 64 and a[:32] == b[:32] and a[32] != b[32]
    assert len(c) == 62 and c == a[:62]  # only full blocks inside the prompt get keys
    assert prefix_block_keys(Request(3, 0, 1024, 1), 16) == ()


def test_match_leaves_one_token_to_compute():
    kv = BlockManager(100, 16)
    a = state(1, 1024, hashes=(5, 6))
    run_prefill(kv, a)
    twin = state(2, 1024, hashes=(5, 6))
    assert kv.match_prefix(twin) == 1024 - 16  # the last block is recomputed so a token can be sampled
    assert kv.match_prefix(state(3, 1024, hashes=(7, 6))) == 0


def test_prefix_caching_disabled():
    kv = BlockManager(100, 16, enable_prefix_caching=False)
    a, b = state(1, 1024, hashes=(5, 6)), state(2, 1024, hashes=(5, 6))
    run_prefill(kv, a)
    assert kv.match_prefix(b) == 0 and kv.acquire_prefix(b) == 0


def test_lru_eviction_order_tail_first():
    kv = BlockManager(6, 4)
    a = state(1, 16, hashes=(1,), block_tokens=16)  # 4 cached blocks
    run_prefill(kv, a)
    head, tail = a.blocks[0], a.blocks[-1]
    kv.free(a)
    assert kv.num_free_blocks == 6  # cached blocks with no owner still count as free
    b = state(2, 12)  # needs 3 blocks: 2 truly free, then the LRU cached one
    kv.allocate(b, 12)
    assert tail in b.blocks and head not in b.blocks
    # the head of the prefix survived and is still matched
    c = state(3, 16, hashes=(1,), block_tokens=16)
    assert kv.match_prefix(c) == 12  # blocks 0-2 survive; only the tail block was evicted
    kv.check_invariants([b, c])


def test_admission_counts_revived_cached_blocks():
    kv = BlockManager(8, 4)
    a = state(1, 16, hashes=(1,), block_tokens=16)
    run_prefill(kv, a)
    kv.free(a)
    twin = state(2, 16, hashes=(1,), block_tokens=16)
    # 3 cached blocks are reused (they leave the evictable pool) + 1 new block for the last 4 tokens
    assert kv.admission_blocks(twin, 4) == 3 + 1
    before = kv.num_free_blocks
    run_prefill(kv, twin)
    assert before - kv.num_free_blocks == 4


def test_swap_out_and_in():
    kv = BlockManager(8, 4, num_host_blocks=4)
    a = state(1, 12)
    run_prefill(kv, a)
    assert kv.swap_out(a) == 3 and a.blocks == [] and a.swapped_blocks == 3
    assert kv.num_free_blocks == 8 and kv.num_free_host_blocks == 1
    b = state(2, 8)
    kv.allocate(b, 8)  # holds 2 blocks; the host has 1 free: swap must fail and change nothing
    with pytest.raises(KVCapacityError):
        kv.swap_out(b)
    assert len(b.blocks) == 2 and kv.num_free_host_blocks == 1
    assert kv.swap_in(a) == 3 and len(a.blocks) == 3 and kv.num_free_host_blocks == 4
    kv.check_invariants([a, b])


def test_constructor_rejects_bad_arguments():
    for args, key in (((0, 4), "num_blocks"), ((4, 0), "block_size"), ((4, 4, True, -1), "num_host_blocks")):
        with pytest.raises(ValueError, match=key):
            BlockManager(*args)


# --- property tests -----------------------------------------------------------------------

ops = st.lists(
    st.tuples(st.sampled_from(["admit", "grow", "free", "swap_out", "swap_in"]),
              st.integers(0, 7), st.integers(1, 90), st.lists(st.integers(0, 3), min_size=0, max_size=4)),
    min_size=1, max_size=60)


@settings(max_examples=150, deadline=None)
@given(num_blocks=st.integers(4, 64), block_size=st.integers(1, 32), host=st.integers(0, 16),
       prefix=st.booleans(), ops=ops)
def test_no_block_leaked_or_double_owned(num_blocks, block_size, host, prefix, ops):
    kv = BlockManager(num_blocks, block_size, prefix, host)
    states: dict[int, RequestState] = {}
    rid = 0
    for op, slot, tokens, hashes in ops:
        s = states.get(slot)
        if op == "admit" and s is None:
            rid += 1
            s = state(rid, tokens, hashes=hashes, block_tokens=8)
            hit = kv.acquire_prefix(s)
            assert hit == 0 or hit < s.req.prompt_len
            s.num_computed = hit
            n = s.req.prompt_len - hit
            if kv.can_allocate(kv.blocks_needed(s, n)):
                kv.allocate(s, n)
                s.num_computed += n
                kv.register(s, s.num_computed)
                states[slot] = s
            else:
                free_before = kv.num_free_blocks
                with pytest.raises(KVCapacityError):
                    kv.allocate(s, n)
                assert kv.num_free_blocks == free_before
                kv.free(s)
        elif op == "grow" and s is not None and s.blocks:
            n = tokens % 9 + 1
            if kv.can_allocate(kv.blocks_needed(s, n)):
                kv.allocate(s, n)
                s.num_computed += n
                kv.register(s, s.num_computed)
        elif op == "free" and s is not None:
            kv.free(s) if s.blocks else None
            if s.swapped_blocks:
                s.blocks = []
                kv.swap_in(s) if kv.can_allocate(s.swapped_blocks) else None
                if s.blocks:
                    kv.free(s)
                else:
                    continue
            del states[slot]
        elif op == "swap_out" and s is not None and s.blocks:
            if len(s.blocks) <= kv.num_free_host_blocks:
                kv.swap_out(s)
        elif op == "swap_in" and s is not None and s.swapped_blocks:
            if kv.can_allocate(s.swapped_blocks):
                kv.swap_in(s)
        kv.check_invariants(states.values())
        held = len({b for st_ in states.values() for b in st_.blocks})  # what the requests hold, as they list it
        assert held + kv.num_free_blocks == num_blocks
    for s in list(states.values()):
        if s.blocks:
            kv.free(s)
    kv.check_invariants([s for s in states.values() if s.swapped_blocks])
    assert kv.num_free_blocks == num_blocks


sglang_ops = st.lists(
    st.tuples(st.sampled_from(["admit", "grow", "free", "finish", "look_up"]),
              st.integers(0, 7), st.integers(1, 60), st.lists(st.integers(0, 3), min_size=0, max_size=4)),
    min_size=1, max_size=60)


@settings(max_examples=150, deadline=None)
@given(num_blocks=st.integers(4, 64), block_size=st.integers(1, 8), ops=sglang_ops)
def test_sglang_mode_keeps_its_radix_tree_whole(num_blocks, block_size, ops):
    # SGLang's mode (radix tree, eviction by access time): admissions (looked up, then locked, then
    # allocated, evicting), decodes, retractions, finishes and lookups of requests that are not
    # admitted; after each, the tree's shape, stamps, heap and free counts agree (RadixLRU.check)
    kv = BlockManager(num_blocks, block_size, True, 0, "finished")
    states: dict[int, RequestState] = {}
    rid = 0
    for op, slot, tokens, hashes in ops:
        s = states.get(slot)
        if op in ("admit", "look_up") and s is None:
            rid += 1
            s = state(rid, tokens, hashes=hashes, block_tokens=8)
            kv.touch(s, s.known_len - (op == "admit"))
            if op == "admit":
                s.num_computed = kv.acquire_prefix(s)
                n = s.req.prompt_len - s.num_computed
                if kv.can_allocate(kv.blocks_needed(s, n)):
                    kv.allocate(s, n)
                    s.num_computed += n
                    kv.register(s, s.num_computed)
                    states[slot] = s
                else:
                    kv.free(s)
        elif op == "grow" and s is not None:
            n = tokens % 5 + 1
            if kv.can_allocate(kv.blocks_needed(s, n)):
                kv.allocate(s, n)
                s.num_computed += n
                s.num_generated += n
        elif op in ("free", "finish") and s is not None:
            kv.free(s, finished=op == "finish")
            del states[slot]
        kv.check_invariants(states.values())
    for s in states.values():
        kv.free(s, finished=True)
    kv.check_invariants([])
    assert kv.num_free_blocks == num_blocks
    kv.evict_to_free(num_blocks)
    kv.check_invariants([])
    assert not kv._cached and all(r < 0 for r in kv._own_rid)


@pytest.mark.parametrize("looked_up", [True, False])
def test_sglang_mode_evicts_the_least_recently_accessed_radix_leaf_whole(looked_up):
    # A then B (4 cached prompt tokens each, their own trace prefix) finish; 2 of 10 blocks stay
    # uncached. D then needs 4: 2 more. SGLang's radix tree (kv.cache_decode_tokens=finished)
    # evicts the leaf accessed least recently, whole (radix_cache.py evict L552-580: the heap of
    # leaves by last_access_time): A, released first, unless a lookup of A's prefix (a waiting
    # request matched by the scheduler: _match_prefix_helper L651-675) re-stamped it after B's
    # release; then B goes, all 4 blocks although 2 were needed. vLLM's mode evicts free blocks in
    # release order, block by block, lookups or not: A's last two.
    for mode in ("finished", "scheduled"):
        kv = BlockManager(10, 1, True, 0, mode)
        a, b = state(0, 4, (1,), block_tokens=4), state(1, 4, (2,), block_tokens=4)
        for s in (a, b):
            run_prefill(kv, s)
            kv.free(s, finished=True)
        c_a, c_b = state(2, 5, (1,), block_tokens=4), state(3, 5, (2,), block_tokens=4)
        if looked_up:
            kv.touch(c_a, c_a.known_len)
        d = state(4, 4)
        kv.allocate(d, 4)
        kv.check_invariants([d])
        hits = (kv.match_prefix(c_a), kv.match_prefix(c_b))
        if mode == "scheduled":
            assert hits == (2, 4)
        else:
            assert hits == ((4, 0) if looked_up else (0, 4))
            assert kv.num_free_blocks == 6
            kv.evict_to_free(6)  # every free block uncached: the other leaf goes as well
            assert kv.match_prefix(c_a) == kv.match_prefix(c_b) == 0
            kv.check_invariants([d])
