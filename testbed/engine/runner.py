"""One planned batch -> one forward pass -> the greedy next tokens.

The step loop has already decided everything (which requests, how many tokens each,
which KV blocks they hold); the runner only executes. All items' new tokens are
flattened into one row ([1, T] input_ids and absolute position_ids), so prefill chunks
at any offset and decode tokens share a single forward, and the paged attention
function places every token by the step's `StepContext`. Logits are computed only for
the rows that sample a token (`logits_to_keep` with their indices), never for all T.

Decode-only steps go to `DecodeGraphs` when the runner has one (a GPU engine does): the
same forward on fixed, padded shapes, replayed as a CUDA graph; anything else (a prefill
chunk in the batch, a shape beyond the captured ones) takes the general path above.

Swaps follow the loop's `Batch.swap_out` / `Batch.swap_in` lists: a swapped-out
request's blocks are copied to host memory, keyed by request id, before any of this
step's writes can reuse them; a swapped-in request's copy lands in its new blocks.
"""
from __future__ import annotations

import time

import torch

from testbed.engine.attention import ATTN_IMPLEMENTATION, build_context, step_context
from testbed.engine.decode_graphs import DecodeGraphs
from testbed.engine.kv_cache import PagedKVCache


class ModelRunner:
    def __init__(self, model, kv_cache: PagedKVCache, block_size: int | None = None):
        if block_size is not None and block_size != kv_cache.block_size:
            raise ValueError(f"ModelRunner: block_size={block_size} but the KV cache has blocks of {kv_cache.block_size}")
        cfg = model.config
        heads = cfg.num_attention_heads
        shape = (cfg.num_hidden_layers, getattr(cfg, "num_key_value_heads", None) or heads,
                 getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
        if shape != (kv_cache.num_layers, kv_cache.num_kv_heads, kv_cache.head_dim):
            raise ValueError(f"ModelRunner: model needs (layers, kv_heads, head_dim)={shape}, the KV cache has "
                             f"{(kv_cache.num_layers, kv_cache.num_kv_heads, kv_cache.head_dim)}")
        if cfg._attn_implementation != ATTN_IMPLEMENTATION:
            model.set_attn_implementation(ATTN_IMPLEMENTATION)
        self.model = model.eval()
        self.kv_cache = kv_cache
        self.block_size = kv_cache.block_size
        self.device = next(model.parameters()).device
        self.host_copies: dict[int, torch.Tensor] = {}  # swapped-out KV by request id
        self.last_prepare_s = 0.0  # host-side input preparation of the last execute()
        self.last_forward_s = 0.0  # forward + greedy sampling, up to the token ids on the host
        self.decode_graphs: DecodeGraphs | None = None
        self.fixed_shape_steps = 0  # steps served by decode_graphs

    def enable_decode_graphs(self, max_batch: int, max_model_len: int, use_graphs: bool,
                             max_context_tokens: int = 262_144, capture: bool = True) -> DecodeGraphs:
        """Serve decode-only steps on fixed shapes (CUDA graphs when `use_graphs`); capture them now if asked."""
        self.decode_graphs = DecodeGraphs(self.model, self.kv_cache, max_batch, max_model_len, use_graphs,
                                          max_context_tokens)
        if capture:
            self.decode_graphs.capture()
        return self.decode_graphs

    @torch.inference_mode()
    def execute(self, items, token_ids: dict[int, list[int]]) -> dict[int, int]:
        """Run one forward over every item's new tokens; greedy next token of each item that
        reaches its known length (num_computed + num_tokens == len(token_ids[id])).

        items: (RequestState, num_tokens) pairs as in the loop's `Batch`: blocks already cover
        num_computed + num_tokens, and num_computed tokens are already in the cache.
        """
        t0 = time.perf_counter()
        if self.decode_graphs is not None and items and all(n == 1 for _, n in items):
            sampled = self._execute_fixed_shape(items, token_ids, t0)
            if sampled is not None:
                return sampled
        ids: list[int] = []
        q_lens, ctx_lens, tables, sample_rows, sample_ids = [], [], [], [], []
        row = 0
        for s, n in items:
            c = s.num_computed
            toks = token_ids[s.req.id]
            end = self._check_item(s, n, toks)
            ids += toks[c:end]
            q_lens.append(n)
            ctx_lens.append(c)
            tables.append(s.blocks)
            row += n
            if end == len(toks):
                sample_rows.append(row - 1)
                sample_ids.append(s.req.id)
        if not q_lens:
            return {}
        dev = self.device
        input_ids = torch.tensor(ids, dtype=torch.long).to(dev, non_blocking=True)[None]
        keep = torch.tensor(sample_rows, dtype=torch.long).to(dev, non_blocking=True)
        ctx = build_context(self.kv_cache, q_lens, ctx_lens, tables, dev)
        t1 = time.perf_counter()
        with step_context(ctx):
            out = self.model(input_ids=input_ids, position_ids=ctx.positions[None], use_cache=False,
                             logits_to_keep=keep)
        next_ids = out.logits[0].argmax(-1).tolist() if sample_rows else []  # .tolist() waits for the device
        self.last_prepare_s = t1 - t0
        self.last_forward_s = time.perf_counter() - t1
        return dict(zip(sample_ids, next_ids))

    def _check_item(self, s, n: int, toks: list[int]) -> int:
        """The end of an item's tokens (num_computed + n), once its tokens are known and its blocks hold them."""
        c = s.num_computed
        end = c + n
        if end > len(toks):
            raise ValueError(f"request {s.req.id}: {n} tokens from {c} run past its {len(toks)} known tokens")
        if end > len(s.blocks) * self.block_size:
            raise ValueError(f"request {s.req.id}: {end} tokens need {-(-end // self.block_size)} KV blocks, "
                             f"it holds {len(s.blocks)}")
        return end

    def _execute_fixed_shape(self, items, token_ids, t0: float) -> dict[int, int] | None:
        """A decode-only step through `decode_graphs`; None when its shape has no fixed form."""
        longest = max(self._check_item(s, 1, token_ids[s.req.id]) for s, _ in items)
        shape = self.decode_graphs.shape_for(len(items), longest)
        if shape is None:
            return None
        self.decode_graphs.stage(items, token_ids, shape)
        t1 = time.perf_counter()
        next_ids = self.decode_graphs.forward(len(items), shape)
        self.last_prepare_s = t1 - t0
        self.last_forward_s = time.perf_counter() - t1
        self.fixed_shape_steps += 1
        return {s.req.id: t for (s, _), t in zip(items, next_ids) if s.num_computed + 1 == len(token_ids[s.req.id])}

    # --- swap preemption ------------------------------------------------------------------
    def swap_out(self, state, blocks: list[int]) -> None:
        """Copy a preempted request's blocks (as held when it was swapped out) to host memory."""
        self.host_copies[state.req.id] = self.kv_cache.copy_blocks_to_host(blocks)

    def swap_in(self, state, blocks: list[int]) -> None:
        """Write the request's host copy into the blocks it now holds (same order, new ids)."""
        try:
            host = self.host_copies.pop(state.req.id)
        except KeyError:
            raise KeyError(f"request {state.req.id}: swap_in without a swapped-out copy") from None
        self.kv_cache.copy_blocks_from_host(host, blocks)

    def apply_swaps(self, swap_out=None, swap_in=None) -> None:
        """A `Batch`'s swap lists, in the only safe order: every copy out before any copy in."""
        for s, blocks in swap_out or ():
            self.swap_out(s, blocks)
        for s, blocks in swap_in or ():
            self.swap_in(s, blocks)
