"""The engine's paged runner produces exactly transformers' own greedy tokens.

A tiny random-weight model (CPU, float32) is driven step by step over a real testbed
`BlockManager`: prompts prefilled together, chunked prefill mixed with decodes, recompute
after preemption, prefix-shared blocks, swap out and back in, and finally the shared
step loop with the vLLM policy under a KV cache small enough to force preemptions.
Every request's tokens must equal `model.generate(..., do_sample=False)` run with
transformers' own (sdpa) attention: any error in slots, masks, offsets or block reuse
changes the argmax within a few tokens.
"""
from __future__ import annotations

import pytest
import torch

from testbed.engine.kv_cache import PagedKVCache
from testbed.engine.models import PRESETS, build_model, make_config, model_spec_of
from testbed.engine.runner import ModelRunner
from testbed.core.kv import BlockManager
from testbed.core.request import Request, RequestState
from testbed.core.specs import ModelSpec

BS = 8  # small blocks: every prompt crosses several block boundaries
N = 10  # new tokens per request
LENS = (5, 17, 32, 40)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matmuls: with more than one thread the hand-off costs more than the work."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# Weights 10x the usual init scale: attention then moves the residual stream enough that a
# wrong mask, slot or stale block flips the greedy token within a step or two.
INIT = {"initializer_range": 0.2}


@pytest.fixture(scope="module")
def model():
    return build_model(make_config("tiny_llama", **INIT), dtype=torch.float32, seed=0)


def random_prompts(lens=LENS, seed=1, vocab=512):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]


def reference(model, prompt, n=N):
    """transformers' greedy generation with its own sdpa attention (not the paged one)."""
    prev = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    try:
        out = model.generate(torch.tensor([prompt], device=model.device), max_new_tokens=n, do_sample=False)
    finally:
        model.set_attn_implementation(prev)
    assert out.shape[1] == len(prompt) + n
    return out[0, len(prompt):].tolist()


class Harness:
    """The loop's bookkeeping by hand: allocate before a step, advance and commit after."""

    def __init__(self, model, num_blocks=64, host_blocks=0, scratch_block=False):
        self.cache = PagedKVCache.for_model(model.config, num_blocks, BS, dtype=torch.float32, device=model.device,
                                            scratch_block=scratch_block)
        self.kv = BlockManager(num_blocks, BS, enable_prefix_caching=True, num_host_blocks=host_blocks)
        self.runner = ModelRunner(model, self.cache, BS)
        self.tokens: dict[int, list[int]] = {}
        self.states: list[RequestState] = []

    def add(self, prompt, prefix_hashes=(), prefix_block_tokens=2 * BS) -> RequestState:
        rid = len(self.states)
        s = RequestState(Request(rid, 0.0, len(prompt), N, tuple(prefix_hashes), prefix_block_tokens))
        self.states.append(s)
        self.tokens[rid] = list(prompt)
        return s

    def step(self, items):
        for s, n in items:
            self.kv.allocate(s, n)
        out = self.runner.execute(items, self.tokens)
        for s, n in items:
            s.num_computed += n
            self.kv.register(s, s.num_computed)
            if s.num_computed == len(self.tokens[s.id]):
                self.tokens[s.id].append(out.pop(s.id))
                s.num_generated += 1
                if s.num_generated == N:
                    self.kv.free(s)
        assert not out, f"tokens sampled for requests mid-prefill: {out}"

    def run(self, states, budget=10_000):
        """Decode-first chunked prefill under a token budget, until every state has N tokens."""
        while True:
            live = [s for s in states if s.num_generated < N]
            if not live:
                return
            items, left = [], budget
            for s in sorted(live, key=lambda s: s.remaining > 1):  # decodes first
                n = min(s.remaining, left)
                if n:
                    items.append((s, n))
                    left -= n
            self.step(items)

    def generated(self, s):
        return self.tokens[s.id][s.req.prompt_len:]


def decoding(states):
    return [(s, 1) for s in states if s.num_generated < N]


def test_model_presets_and_spec(tmp_path):
    for name in ("llama3_8b", "llama3_2_1b", "tiny_llama"):
        cfg = make_config(name)
        folder = tmp_path / cfg.name_or_path  # config.json has no name: from_hf_config takes the folder's
        cfg.save_pretrained(folder)
        got, want = model_spec_of(cfg), ModelSpec.from_hf_config(folder)
        for key in ("name", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                    "head_dim", "vocab_size", "tie_word_embeddings", "max_model_len"):
            assert getattr(got, key) == getattr(want, key), (name, key)
    spec = model_spec_of(make_config("llama3_8b"))
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.max_model_len) == (32, 8, 128, 8192)
    assert model_spec_of(make_config("llama3_2_1b")).tie_word_embeddings
    tiny = model_spec_of(make_config("tiny_llama"), dtype="float32")
    assert tiny.family == "llama" and tiny.rope_theta == 10000.0 and tiny.random_weights
    assert set(PRESETS) >= {"llama3_8b", "llama3_2_1b", "tiny_llama"}
    # a spec (conf/model/*.yaml) builds the same shapes; a local checkpoint loads without a download
    m = build_model(tiny, seed=0)
    assert m.dtype == torch.float32 and model_spec_of(m.config).num_params == tiny.num_params
    assert sum(p.numel() for p in m.parameters()) == tiny.num_params
    m.save_pretrained(tmp_path / "ckpt")
    m2 = build_model(str(tmp_path / "ckpt"), dtype=torch.float32)
    assert torch.equal(m2.lm_head.weight, m.lm_head.weight)
    with pytest.raises(ValueError, match="neither a checkpoint"):
        build_model("no-such-model")


def test_kv_cache_layout_and_host_copies():
    cache = PagedKVCache(num_layers=2, num_blocks=6, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float32)
    assert cache.bytes_needed(6) == cache.nbytes == 2 * 2 * 6 * 4 * 2 * 8 * 4
    assert cache.k[1].shape == (6, 4, 2, 8)
    cache.data.normal_()
    host = cache.copy_blocks_to_host([4, 1])
    assert host.shape == (2, 2, 2, 4, 2, 8) and host.device.type == "cpu"
    want = [cache.k[l][b].clone() for l in range(2) for b in (4, 1)]
    cache.data.zero_()
    cache.copy_blocks_from_host(host, [0, 5])
    assert all(torch.equal(cache.k[l][b], w) for (l, b), w in zip([(l, b) for l in range(2) for b in (0, 5)], want))
    assert cache.k[0][1].abs().sum() == 0
    # slot views alias the block tensors
    cache.k_slots[1][5 * 4 + 3].fill_(7.0)
    assert torch.all(cache.k[1][5, 3] == 7.0)


def test_prefill_together_then_decode(model):
    prompts = random_prompts()
    h = Harness(model)
    states = [h.add(p) for p in prompts]
    h.step([(s, s.req.prompt_len) for s in states])  # one forward, four prompts
    assert all(s.num_generated == 1 for s in states)
    while any(s.num_generated < N for s in states):
        h.step(decoding(states))
    for s, p in zip(states, prompts):
        assert h.generated(s) == reference(model, p)


def test_chunked_prefill_mixed_with_decode(model):
    prompts = random_prompts()
    h = Harness(model)
    c, b, d, a = (h.add(p) for p in prompts)  # lengths 5, 17, 32, 40
    h.step([(b, 17), (c, 5)])
    h.step([(a, 7), (b, 1), (c, 1)])  # a's chunk at offset 0 ends mid-block
    h.step([(b, 1), (a, 13), (c, 1), (d, 3)])  # offset 7, crosses two block boundaries
    h.step([(c, 1), (d, 29), (a, 19)])  # d completes; a stops one short of its prompt
    assert a.num_generated == 0 and d.num_generated == 1
    h.step([(a, 1), (b, 1), (c, 1), (d, 1)])  # a's last prompt token rides with the decodes
    assert a.num_generated == 1
    while any(s.num_generated < N for s in (a, b, c, d)):
        h.step(decoding([a, b, c, d]))
    for s, p in zip((c, b, d, a), prompts):
        assert h.generated(s) == reference(model, p)


@pytest.mark.parametrize("fixed_shape", [False, True], ids=["general", "fixed-shape-decode"])
@pytest.mark.parametrize("family,budget", [("tiny_llama", 11), ("tiny_qwen2", 6), ("tiny_mistral", 9)])
def test_budgeted_chunks_across_families(family, budget, fixed_shape):
    """A token budget chunks prompts at odd offsets; Qwen2 (q/k/v bias) and Mistral (a sliding
    window of 12, shorter than most prompts) go through the same attention hook. With
    `fixed_shape`, decode-only steps take the padded path CUDA graphs replay (batches of 1-4
    padded up the ladder, 3 -> 4; contexts gathered over a bucket of blocks)."""
    overrides = {"tie_word_embeddings": False, **INIT} if family == "tiny_qwen2" else INIT
    m = build_model(make_config(family, **overrides), dtype=torch.float32, seed=3)
    prompts = random_prompts(seed=2)
    refs = [reference(m, p) for p in prompts]
    h = FixedShapeHarness(m) if fixed_shape else Harness(m)
    states = [h.add(p) for p in prompts]
    h.run(states, budget=budget)
    assert [h.generated(s) for s in states] == refs
    assert h.runner.fixed_shape_steps >= (N - 1 if fixed_shape else 0)


def test_recompute_after_preemption(model):
    prompts = random_prompts()
    h = Harness(model, num_blocks=24)
    states = [h.add(p) for p in prompts]
    victim = states[3]  # the 40-token prompt
    h.step([(s, s.req.prompt_len) for s in states])
    for _ in range(3):
        h.step(decoding(states))
    freed = list(victim.blocks)
    h.kv.free(victim)
    victim.num_computed = 0
    h.cache.data[:, :, freed] = torch.randn_like(h.cache.data[:, :, freed])  # as if reused
    others = states[:3]
    for _ in range(2):
        h.step(decoding(others))
    # recompute prompt + the 4 generated tokens in two chunks, next to the others' decodes
    assert victim.remaining == 44
    h.step(decoding(others) + [(victim, 15)])
    h.step(decoding(others) + [(victim, 29)])
    assert victim.num_generated == 5
    h.run(states)
    for s, p in zip(states, prompts):
        assert h.generated(s) == reference(model, p)


def test_prefix_sharing(model):
    shared = random_prompts((4 * BS,), seed=5)[0]  # 2 trace blocks of 16 tokens = 4 of our blocks
    tails = random_prompts((9, 6, 3), seed=6)
    prompts = [shared + t for t in tails]
    hashes = (101, 202)
    h = Harness(model)
    a, b = h.add(prompts[0], hashes), h.add(prompts[1], hashes)
    assert h.kv.acquire_prefix(a) == 0
    h.step([(a, 20)])
    h.step([(a, 21)])  # a's prefix blocks are committed to the prefix cache
    b.num_computed = h.kv.acquire_prefix(b)
    prefix_blocks = a.blocks[:4]
    assert b.num_computed == 32 and b.blocks == prefix_blocks
    h.step([(a, 1), (b, 6)])  # b computes only its own 6 tokens over a's cached blocks
    assert b.num_generated == 1
    h.run([a, b])
    assert not a.blocks and not b.blocks  # both finished: the prefix blocks are evictable, still cached
    c = h.add(prompts[2], hashes)
    c.num_computed = h.kv.acquire_prefix(c)
    assert c.num_computed == 32 and c.blocks == prefix_blocks
    h.step([(c, 3)])
    h.run([c])
    for s, p in zip((a, b, c), prompts):
        assert h.generated(s) == reference(model, p)


def test_swap_out_and_in(model):
    prompts = random_prompts()
    h = Harness(model, num_blocks=28, host_blocks=16)
    states = [h.add(p) for p in prompts]
    victim = states[2]  # 32-token prompt
    h.step([(s, s.req.prompt_len) for s in states])
    for _ in range(3):
        h.step(decoding(states))
    old = list(victim.blocks)
    h.runner.apply_swaps(swap_out=[(victim, old)])  # before the block manager frees them
    h.kv.swap_out(victim)
    h.cache.data[:, :, old] = torch.randn_like(h.cache.data[:, :, old])  # as if reused
    others = [s for s in states if s is not victim]
    extra = h.add(random_prompts((30,), seed=9)[0])  # takes free blocks meanwhile
    h.step(decoding(others) + [(extra, 30)])
    h.step(decoding(others + [extra]))
    h.kv.swap_in(victim)
    assert len(victim.blocks) == len(old)
    h.runner.apply_swaps(swap_in=[(victim, list(victim.blocks))])
    assert not h.runner.host_copies
    h.run(states + [extra])
    for s, p in zip(states + [extra], prompts + [h.tokens[extra.id][:30]]):
        assert h.generated(s) == reference(model, p)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_step_loop_with_preemption(model, mode):
    """The shared step loop and the engine replay driver, with the vLLM policy preempting under
    a tight KV cache: the runner honours every Batch the loop hands it."""
    from testbed.engine.prompts import PromptTokens
    from testbed.engine.replay import EngineReplay
    from testbed.core.loop import SchedulerLimits, StepLoop
    from testbed.policies import make_policy

    reqs = [Request(i, 0.0, p, N, (7, 8) if i % 2 else (), 16) for i, p in enumerate((20, 37, 12, 33, 26))]
    kv = BlockManager(14, BS, True, 64)
    loop = StepLoop(make_policy("vllm", preemption_mode=mode, reserve_full_isl=False), kv, SchedulerLimits(24, 8, 512))
    cache = PagedKVCache.for_model(model.config, 14, BS, dtype=torch.float32)
    prompts = PromptTokens(512, seed=0)

    class CountingRunner(ModelRunner):
        swaps_in = 0

        def swap_in(self, state, blocks):
            self.swaps_in += 1
            super().swap_in(state, blocks)

    runner = CountingRunner(model, cache)
    replay = EngineReplay(reqs, loop, runner, prompts)
    out = replay.run()
    assert not out.stalled and len(replay.generated) == len(reqs)
    assert sum(s.num_preemptions for s in loop.states) > 0
    assert (runner.swaps_in > 0) == (mode == "swap") and not runner.host_copies
    for r in reqs:
        assert replay.generated[r.id] == reference(model, prompts(r)), r.id


# --- fixed-shape decode (the path CUDA graphs replay) ------------------------------------
class FixedShapeHarness(Harness):
    """The runner with decode-only steps on padded, fixed shapes, run eagerly (CPU)."""

    def __init__(self, model, num_blocks=64, max_batch=8, max_context_tokens=262_144, use_graphs=False):
        super().__init__(model, num_blocks, scratch_block=True)
        self.graphs = self.runner.enable_decode_graphs(max_batch, 128, use_graphs, max_context_tokens,
                                                       capture=use_graphs)


def test_fixed_shape_padding_writes_only_the_scratch_block(model):
    h = FixedShapeHarness(model)
    a, b, c = (h.add(p) for p in random_prompts(lens=(5, 17, 9)))
    h.step([(a, 5), (b, 17), (c, 9)])
    h.cache.data.normal_()
    before = h.cache.data.clone()
    h.step(decoding([a, b, c]))  # 3 rows, padded to 4
    assert h.runner.fixed_shape_steps == 1
    changed = (h.cache.data != before).flatten(4).any(-1)  # [2, layers, blocks, block_size]
    written = {(blk, off) for blk, off in changed.any(0).any(0).nonzero().tolist()}
    expected = {(s.blocks[(s.num_computed - 1) // BS], (s.num_computed - 1) % BS) for s in (a, b, c)}
    assert {w for w in written if w[0] != h.cache.scratch_block} == expected
    assert any(w[0] == h.cache.scratch_block for w in written)  # the padding row went there


def test_fixed_shape_limits_fall_back_to_the_general_path(model):
    """Past the batch ladder or the batch x context limit a decode step runs on the general path."""
    h = FixedShapeHarness(model, max_batch=2, max_context_tokens=8 * BS)
    g = h.graphs
    assert g.batch_sizes == [1, 2] and g.block_buckets[-1] == 128 // BS
    assert g.shape_for(2, 3 * BS + 1) == (2, 4) and g.shape_for(1, 5 * BS) == (1, 8)
    assert g.shape_for(3, 1) is None and g.shape_for(2, 4 * BS + 1) is None
    prompts = random_prompts(lens=(5, 28))
    states = [h.add(p) for p in prompts]
    h.run(states)  # decodes at sequence lengths 29..37: fixed shape up to 32, general path after
    assert [h.generated(s) for s in states] == [reference(model, p) for p in prompts]
    assert h.runner.fixed_shape_steps == 4  # seq lengths 29, 30, 31, 32 of the longer request
    h = FixedShapeHarness(model, max_batch=2)
    states = [h.add(p) for p in random_prompts(lens=(5, 6, 7))]
    h.run(states)  # three decodes: beyond the batch ladder
    assert h.runner.fixed_shape_steps == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: CUDA graph capture and replay")
def test_cuda_graph_decode_equals_generate():
    m = build_model(make_config("tiny_llama", **INIT), dtype=torch.float32, seed=0, device=torch.device("cuda"))
    prompts = random_prompts()
    refs = [reference(m, p) for p in prompts]
    h = FixedShapeHarness(m, use_graphs=True)
    assert len(h.graphs.graphs) > 0
    states = [h.add(p) for p in prompts]
    h.run(states, budget=11)
    assert [h.generated(s) for s in states] == refs
    assert h.runner.fixed_shape_steps >= N - 1
