"""The host KV tier behind the prefix cache (kv.offload_gb): evicted prefix blocks are hit again
from host memory, loaded over the host link in the admitting step, and the tier stays within
its size, least recently used out first."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import FixedCost, make_requests
from test_policy_properties import CheckedLoop
from testbed.app.assembly.plugins import make_policy
from testbed.core.cost import BatchShape
from testbed.core.kv import BlockManager
from testbed.core.kv_offload import OffloadingBlockManager
from testbed.core.loop import SchedulerLimits, StepLoop
from testbed.core.request import Request, RequestState, Status
from testbed.policies import registered
from testbed.sim.simulation import Simulation
from testbed.core.specs import HardwareSpec, ModelSpec
from testbed.sim.roofline import RooflineCostModel

BS = 16


def drive(loop: StepLoop, reqs, until_id=None):
    """Replay `reqs` through the loop one at a time, each arriving after the previous finished;
    return the first batch that admits request `until_id` (not run), or None."""
    now = 0.0
    for r in reqs:
        loop.arrive(r, now)
        while loop.has_work:
            batch = loop.plan(now)
            if until_id is not None and any(s.req.id == until_id for s, _ in batch.items):
                return batch
            now += 0.01
            loop.complete(batch, now)
    return None


def offload_loop(offload_blocks: int, device_blocks: int = 80, policy: str = "vllm",
                 write_policy: str = "write_through") -> StepLoop:
    args = (device_blocks, BS, True, 0, "scheduled")
    kv = OffloadingBlockManager(*args, offload_blocks, write_policy) if offload_blocks else BlockManager(*args)
    return StepLoop(make_policy(policy), kv, SchedulerLimits(2048, 8, 10_000), FixedCost())


# A's prefix, then B's, which evicts most of A's cached blocks from an 80-block device, then A's again
PROMPT = 1000
SEQ = [(0, PROMPT, 4, (1, 2)), (0, PROMPT, 4, (3, 4)), (0, PROMPT, 4, (1, 2))]


@pytest.mark.parametrize("write_policy", ["write_through", "write_back"])
def test_an_evicted_prefix_is_loaded_from_host_and_the_step_pays_the_transfer(write_policy):
    loop = offload_loop(offload_blocks=200, write_policy=write_policy)
    reqs = make_requests(SEQ)
    drive(loop, reqs[:2])
    kv = loop.kv
    keys = kv.prefix_keys(RequestState(reqs[2]))
    on_device = next(i for i, k in enumerate(keys) if k not in kv._cached)
    in_host = sum(1 for k in keys[on_device:] if kv.in_host(k))
    assert in_host > 0 and on_device + in_host == len(keys)  # B evicted A's tail; the host kept it
    batch = drive(loop, reqs[2:], until_id=2)
    (s, n), = batch.items
    assert batch.shape.load_blocks == in_host
    assert s.num_computed == len(keys) * BS and n == PROMPT - len(keys) * BS  # nothing of the hit recomputed
    assert kv.offload_hit_tokens == in_host * BS and kv.hit_tokens == on_device * BS
    # the roofline charges the load at the host link, exactly as a swap of that many blocks
    m, hw = ModelSpec(), HardwareSpec()
    cost = RooflineCostModel(m, hw, block_size=BS)
    with_load = cost.step_time(batch.shape)
    batch.shape.load_blocks = 0
    assert with_load - cost.step_time(batch.shape) == pytest.approx(in_host * BS * m.kv_bytes_per_token / hw.host_link_bandwidth)
    kv.check_invariants(loop.states)


def test_without_offload_the_evicted_prefix_is_recomputed():
    loop = offload_loop(offload_blocks=0)
    reqs = make_requests(SEQ)
    drive(loop, reqs[:2])
    keys = loop.kv.prefix_keys(RequestState(reqs[2]))
    on_device = next(i for i, k in enumerate(keys) if k not in loop.kv._cached)
    batch = drive(loop, reqs[2:], until_id=2)
    (s, n), = batch.items
    assert batch.shape.load_blocks == 0
    assert s.num_computed == on_device * BS and n == PROMPT - on_device * BS


def one_block_request(rid: int, key: int) -> RequestState:
    """A 5-token prompt of 4-token blocks: one full block of shared prefix `key`, one partial."""
    return RequestState(Request(id=rid, arrival=0.0, prompt_len=5, output_len=1, prefix_hashes=(key,),
                                prefix_block_tokens=4))


def serve(kv: BlockManager, s: RequestState) -> None:
    s.num_computed = kv.acquire_prefix(s)
    kv.allocate(s, s.req.prompt_len - s.num_computed)
    s.num_computed = s.req.prompt_len
    kv.register(s, s.num_computed)
    kv.free(s, finished=True)


def host_tier_after_four(write_policy):
    """Requests with one-block prefixes 1, 2, 3, 4 in turn, each taking the whole 2-block device."""
    kv = OffloadingBlockManager(2, 4, num_offload_blocks=2, write_policy=write_policy)
    for rid, key in enumerate((1, 2, 3, 4)):
        serve(kv, one_block_request(rid, key))
        assert kv.num_host_cached_blocks <= 2
    return kv, {k: kv.prefix_keys(one_block_request(0, k))[0] for k in range(1, 6)}


def test_written_back_the_host_tier_keeps_the_last_evicted_least_recently_used_out():
    kv, key_of = host_tier_after_four("write_back")
    # 1, 2 and 3 were evicted in that order (4 is still on the device): 1 was dropped
    assert [kv.in_host(key_of[k]) for k in (1, 2, 3, 4)] == [False, True, True, False]
    assert kv.match_prefix(one_block_request(9, 1)) == 0  # recomputed
    again = one_block_request(10, 2)
    assert kv.match_prefix(again) == 4
    serve(kv, again)  # loading 2 refreshes it; evicting 4 then drops 3, now the oldest
    assert kv.loaded_blocks == 1
    assert [kv.in_host(key_of[k]) for k in (2, 3, 4)] == [True, False, True]
    kv.check_invariants([])


def test_written_through_the_host_tier_keeps_the_last_cached_least_recently_used_out():
    kv, key_of = host_tier_after_four("write_through")
    # stored as cached: 1, 2, 3, 4; the tier of 2 kept 3 and 4 (4 also still on the device)
    assert [kv.in_host(key_of[k]) for k in (1, 2, 3, 4)] == [False, False, True, True]
    assert kv.match_prefix(one_block_request(9, 2)) == 0  # evicted from both: recomputed
    again = one_block_request(10, 3)
    assert kv.match_prefix(again) == 4
    serve(kv, again)  # loads 3 (refreshed); evicting 4 from the device stores nothing
    assert kv.loaded_blocks == 1
    serve(kv, one_block_request(11, 5))  # storing 5 drops 4, the oldest
    assert [kv.in_host(key_of[k]) for k in (3, 4, 5)] == [True, False, True]
    kv.check_invariants([])


OPS = st.lists(st.tuples(st.sampled_from(["admit"] * 4 + ["finish"] * 3 + ["grow", "preempt", "evict"]),
                         st.integers(0, 7), st.integers(1, 36)), min_size=5, max_size=60)


@settings(max_examples=150, deadline=None)
@given(ops=OPS, device=st.integers(4, 16), host=st.integers(1, 12), finished_mode=st.booleans(),
       write_policy=st.sampled_from(["write_through", "write_back"]))
def test_random_traffic_never_loses_or_double_counts_a_block(ops, device, host, finished_mode, write_policy):
    kv = OffloadingBlockManager(device, 4, num_offload_blocks=host, write_policy=write_policy,
                                cache_decode_tokens="finished" if finished_mode else "scheduled")
    prefixes = [(1, 2, 3, 4, 5, 6), (1, 2, 3, 9, 9, 9), (5, 6, 7, 8), (1,), (7, 8, 9, 10, 11, 12, 13, 14)]
    states: list[RequestState] = []
    live: list[RequestState] = []
    for op, pick, tokens in ops:
        if op == "admit":
            s = RequestState(Request(id=len(states), arrival=0.0, prompt_len=tokens, output_len=4,
                                     prefix_hashes=prefixes[pick % len(prefixes)], prefix_block_tokens=4))
            states.append(s)
            n = s.known_len - kv.match_prefix(s)
            need = kv.admission_blocks(s, n)
            if need > kv.num_free_blocks:
                continue
            free = kv.num_free_blocks
            s.num_computed = kv.acquire_prefix(s)
            assert s.num_computed + n == s.known_len
            kv.allocate(s, n)
            assert free - kv.num_free_blocks == need  # the admission's count is exact, loads included
            kv.register(s, s.num_computed + n)
            s.num_computed += n
            live.append(s)
        elif op in ("grow", "finish", "preempt") and live:
            s = live[pick % len(live)]
            if op == "grow":
                if kv.blocks_needed(s, tokens) <= kv.num_free_blocks:
                    kv.allocate(s, tokens)
                    kv.register(s, s.num_computed + tokens)
                    s.num_computed += tokens
            else:
                kv.free(s, finished=op == "finish")
                s.num_computed = 0
                live.remove(s)
        elif op == "evict":
            kv.evict_to_free(tokens % (device + 1))
        assert kv.num_free_blocks + kv.num_used_blocks == kv.num_blocks
        assert kv.num_host_cached_blocks <= host
        kv.check_invariants(states)
    assert kv.offload_hit_tokens == kv.loaded_blocks * 4


# Mooncake's first 150 requests, prompts clipped to 4096 tokens (their leading blocks, the shared prefixes, kept)
# and outputs to 64, on a device cache of about two prompts (vLLM: 400 blocks of 16 tokens, SGLang: 8000
# one-token pages): evicted prefixes come back from the host (about 9k tokens hit there with either), in a
# few seconds (the whole prompts on caches of 48,000 pages took 26 s for SGLang alone)
@pytest.mark.parametrize("policy, write_policy", [("vllm", "write_through"), ("sglang", "write_back")])
def test_mooncake_with_a_small_device_cache_hits_more_with_offload(policy, write_policy):
    from hydra import compose, initialize_config_dir

    from testbed.app.entry.cli import CONF_DIR
    from testbed.app.assembly.run import simulate

    results, computed = {}, {}
    for gb in (0, 8):
        with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
            cfg = compose("config", overrides=[
                "trace=mooncake", "trace.max_requests=150", "trace.max_prompt_len=4096", "trace.max_output_len=64",
                f"policy={policy}", f"kv.num_blocks={400 if policy == 'vllm' else 8000}", f"kv.offload_gb={gb}",
                f"kv.offload_write_policy={write_policy}"])
        run = simulate(cfg)
        results[gb], computed[gb] = run.summary, int(run.steps["prefill_tokens"].sum())
    off, on = results[0], results[8]
    assert "offload_hit_tokens" not in off and on["completed"] == off["completed"] == 150
    assert on["offload_hit_tokens"] > 0 and on["external_prefix_cache_hit_rate"] > 0
    assert on["offload_write_policy"] == write_policy
    assert on["total_prefix_hit_rate"] > off["prefix_cache_hit_rate"]
    assert computed[8] < computed[0]


def compose_cfg(*overrides):
    from hydra import compose, initialize_config_dir

    from testbed.app.entry.cli import CONF_DIR

    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def test_a_profile_cost_model_charges_loads_at_the_host_link_only_with_offload_on():
    """The shipped profile predates `load_blocks` (no such column) and still loads."""
    from testbed.app.assembly.run_setup import _obj, build_cost_model

    cfg = compose_cfg("cost_model=profile", "model=tiny_llama", "hardware=cpu", "kv.offload_gb=1")
    model, hw = _obj(cfg.model, ModelSpec), _obj(cfg.hardware, HardwareSpec)
    cost = build_cost_model(cfg, model, hw)
    shape = BatchShape(num_prefill_tokens=64, num_prefill_seqs=1, prefill_attn_pairs=64 * 32.5, prefill_kv_tokens=64)
    loaded = BatchShape(**{**{f: getattr(shape, f) for f in BatchShape.__dataclass_fields__}, "load_blocks": 10})
    per_block = cfg.kv.block_size * model.kv_bytes_per_token / hw.host_link_bandwidth
    assert cost.step_time(loaded) - cost.step_time(shape) == pytest.approx(10 * per_block)
    plain = build_cost_model(compose_cfg("cost_model=profile", "model=tiny_llama", "hardware=cpu"), model, hw)
    assert plain.step_time(loaded) == plain.step_time(shape)  # off: nothing charged, the shared fit untouched


@pytest.mark.parametrize("backend", ["engine", "vllm"])
def test_the_real_backends_refuse_a_host_tier(backend):
    from testbed.app.assembly.validate import ConfigError, check_config

    with pytest.raises(ConfigError, match=r"kv.offload_gb=4.0: the simulator's only"):
        check_config(compose_cfg("kv.offload_gb=4"), backend=backend)
    check_config(compose_cfg("kv.offload_gb=4"), backend="sim")


def test_an_offload_size_below_one_block_is_refused():
    from testbed.app.assembly.run_setup import offload_kv_blocks

    cfg = compose_cfg("kv.offload_gb=1e-9")
    with pytest.raises(ValueError, match=r"kv.offload_gb=1e-09: holds no KV block"):
        offload_kv_blocks(cfg, _model(cfg))


def _model(cfg):
    from testbed.app.assembly.run_setup import _obj

    return _obj(cfg.model, ModelSpec)


@pytest.mark.parametrize("name", sorted(registered()))
@settings(max_examples=25, deadline=None)
@given(specs=st.lists(st.tuples(st.floats(0, 0.5), st.integers(1, 60), st.integers(1, 12), st.integers(0, 3)),
                      min_size=1, max_size=14),
       num_blocks=st.integers(6, 40), block_size=st.integers(1, 8), budget=st.integers(8, 128),
       max_seqs=st.integers(1, 8), offload=st.integers(1, 12),
       write_policy=st.sampled_from(["write_through", "write_back"]))
def test_every_policy_keeps_the_invariants_with_a_host_tier(name, specs, num_blocks, block_size, budget, max_seqs,
                                                           offload, write_policy):
    """test_policy_properties' run with a host tier: plans stay within KV capacity (a load takes a
    fresh block the plan counted), the books balance, every request that fits finishes."""
    prefixes = [(), (7, 8, 9, 10), (7, 8, 1, 2), (3, 4, 5)]
    arrivals = sorted(s[0] for s in specs)
    reqs = [Request(id=i, arrival=t, prompt_len=p, output_len=o, prefix_hashes=prefixes[k], prefix_block_tokens=8)
            for i, (t, (_, p, o, k)) in enumerate(zip(arrivals, specs))]
    cost = FixedCost(0.01, 0.0005)
    limits = SchedulerLimits(budget, max_seqs, 10_000)
    mode = "finished" if name == "sglang" else "scheduled"
    sim = Simulation(reqs, lambda: CheckedLoop(make_policy(name), OffloadingBlockManager(
        num_blocks, block_size, True, 16, mode, offload, write_policy), limits, cost), cost)
    out = sim.run()
    loop = out.loops[0]
    assert not out.stalled, f"policy {name!r} stalled with requests left"
    for s in loop.states:
        if -(-s.req.total_len // block_size) <= num_blocks:
            assert s.status is Status.FINISHED, f"request {s.req.id} ended {s.status.value}: {s.reject_reason}"
    assert loop.kv.num_free_blocks == num_blocks and loop.kv.num_host_cached_blocks <= offload


def test_an_unknown_write_policy_is_refused_even_with_offload_off():
    from testbed.app.assembly.run_setup import offload_kv_blocks

    cfg = compose_cfg("kv.offload_write_policy=write_around")
    with pytest.raises(ValueError, match=r"kv.offload_write_policy='write_around': expected one of write_through, write_back"):
        offload_kv_blocks(cfg, _model(cfg))


def test_a_predicted_shape_carries_the_loads_the_admission_will_make():
    loop = offload_loop(offload_blocks=200)
    reqs = make_requests(SEQ)
    drive(loop, reqs[:2])
    loop.arrive(reqs[2], 1.0)
    (s,) = loop.waiting
    predicted = loop.shape_of([(s, loop.view.num_new_tokens(s))])
    batch = loop.plan(1.0)
    assert predicted.load_blocks == batch.shape.load_blocks > 0
    assert predicted.num_prefill_tokens == batch.shape.num_prefill_tokens
