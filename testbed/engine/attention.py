"""Paged attention as a transformers attention function.

transformers (>= 4.48, and 5.x) looks every layer's attention up by name in
`AttentionInterface`: `LlamaAttention.forward` projects q/k/v, applies RoPE, then calls
`ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, ...)(module, query,
key, value, attention_mask, scaling=..., dropout=..., **kwargs)`. Registering a function
under "paged" and switching the model to it (`model.set_attn_implementation("paged")`)
puts the testbed's KV blocks under an unmodified model: no forked modeling code, and the
same hook serves Llama, Qwen2 and Mistral. Because "paged" has no mask function
registered in `AttentionMaskInterface`, the model skips building a causal mask
(`masking_utils._preprocess_mask_arguments` exits early): masking is ours.

The runner flattens a whole batch into one row of T tokens (prefill chunks at any
offset and decode tokens mixed) and publishes a `StepContext` for the forward; the
function reads it, writes the new K/V at their slots and attends each sequence's queries
over its cached context plus its new tokens. Index tensors are built once per step, not
once per layer.

This is the reference path: plain torch, any device. Decode rows (one query each) are
batched into one SDPA call over padded, masked contexts; each multi-token chunk gets its
own SDPA call with a causal mask offset by its context length. A fused paged kernel
(FlashAttention's block-table varlen, FlashInfer) would read the same context fields.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import chain

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from testbed.engine.kv_cache import PagedKVCache

ATTN_IMPLEMENTATION = "paged"


@dataclass(slots=True, eq=False)
class Chunk:
    """A sequence with more than one query token this step (a prefill chunk or a recompute)."""

    start: int  # first query row in the flattened batch
    end: int  # one past its last query row
    context_len: int  # tokens already in the cache before this step
    kv_slots: torch.Tensor | None  # cache slots of positions [0, context_len + q_len), None when context_len == 0
    masks: dict = field(default_factory=dict)  # sliding window (or None) -> bool mask [q_len, context_len + q_len]

    def mask(self, window: int | None, device: torch.device) -> torch.Tensor | None:
        """Causal mask offset by the context, cut to a sliding window; None means plain is_causal."""
        if self.context_len == 0 and (window is None or self.end - self.start <= window):
            return None
        m = self.masks.get(window)
        if m is None:
            q = torch.arange(self.end - self.start, device=device)[:, None] + self.context_len
            k = torch.arange(self.context_len + self.end - self.start, device=device)[None, :]
            m = k <= q
            if window is not None:
                m &= k > q - window
            self.masks[window] = m
        return m


@dataclass(slots=True, eq=False)
class StepContext:
    """What one forward needs to know about the paged layout, built once per step by `build_context`.

    Per sequence i (in batch order): its query rows [cu_seqlens_q[i], cu_seqlens_q[i+1]),
    its context length before the step, and its block table (row i of `block_tables`,
    padded with 0). `slot_mapping[t]` is where row t's K/V go: block * block_size + offset.
    `positions[t]` is row t's absolute position (the model's position_ids).
    """

    cache: PagedKVCache
    cu_seqlens_q: torch.Tensor  # [B + 1]
    context_lens: torch.Tensor  # [B]
    seq_lens: torch.Tensor  # [B] context + new tokens
    block_tables: torch.Tensor  # [B, max_blocks]
    slot_mapping: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    max_seqlen_q: int
    max_seqlen_k: int
    # reference path: decode rows batched, chunks one by one
    decode_rows: torch.Tensor | slice | None = None  # [Bd] query rows of the one-token sequences (a slice: all)
    decode_slots: torch.Tensor | None = None  # [Bd, Lmax] cache slots of their whole contexts (padded)
    decode_lens: torch.Tensor | None = None  # [Bd] their sequence lengths
    chunks: list[Chunk] = field(default_factory=list)
    _decode_masks: dict = field(default_factory=dict)

    def decode_mask(self, window: int | None) -> torch.Tensor:
        """[Bd, 1, 1, Lmax]: the valid (and in-window) keys of each decode row."""
        m = self._decode_masks.get(window)
        if m is None:
            k = torch.arange(self.decode_slots.shape[1], device=self.decode_slots.device)[None, :]
            lens = self.decode_lens[:, None]
            m = k < lens
            if window is not None:
                m &= k >= lens - window
            m = self._decode_masks[window] = m[:, None, None, :]
        return m


def build_context(cache: PagedKVCache, query_lens: list[int], context_lens: list[int],
                  block_tables: list[list[int]], device: torch.device | str | None = None) -> StepContext:
    """Every index tensor of one step from three Python lists (one entry per sequence).

    Host work is O(sequences + blocks) list handling and a handful of tensor ops; every
    per-token index (positions, slots) is computed by torch, on `device`.
    """
    device = torch.device(device) if device is not None else cache.device
    bs = cache.block_size
    B = len(query_lens)
    as_long = dict(dtype=torch.long)
    # one host->device copy for the per-sequence ints, one for the flat block list
    meta = torch.tensor([query_lens, context_lens, [len(b) for b in block_tables]], **as_long).to(device, non_blocking=True)
    flat_blocks = torch.tensor(list(chain.from_iterable(block_tables)), **as_long).to(device, non_blocking=True)
    q_lens, ctx_lens, n_blocks = meta[0], meta[1], meta[2]
    seq_lens = q_lens + ctx_lens
    cu_q = torch.zeros(B + 1, device=device, **as_long)
    torch.cumsum(q_lens, 0, out=cu_q[1:])
    max_blocks = max(len(b) for b in block_tables)
    have = torch.arange(max_blocks, device=device)[None, :] < n_blocks[:, None]
    tables = torch.zeros(B, max_blocks, device=device, **as_long)
    tables[have] = flat_blocks  # row-major fill == concatenation order

    T = sum(query_lens)
    seq_of_row = torch.repeat_interleave(torch.arange(B, device=device), q_lens, output_size=T)
    positions = ctx_lens[seq_of_row] + torch.arange(T, device=device) - cu_q[:-1][seq_of_row]
    slot_mapping = tables[seq_of_row, positions // bs] * bs + positions % bs

    max_k = max(q + c for q, c in zip(query_lens, context_lens))
    ctx = StepContext(cache, cu_q, ctx_lens, seq_lens, tables, slot_mapping, positions,
                      max(query_lens), max_k)

    decode = [i for i, q in enumerate(query_lens) if q == 1]
    if decode:
        sel = torch.tensor(decode, **as_long).to(device, non_blocking=True) if len(decode) < B else None
        lmax = max(context_lens[i] + 1 for i in decode)
        k = torch.arange(lmax, device=device)
        d_tables = tables if sel is None else tables[sel]
        ctx.decode_rows = cu_q[:-1] if sel is None else cu_q[sel]
        ctx.decode_slots = d_tables[:, k // bs] * bs + k % bs
        ctx.decode_lens = seq_lens if sel is None else seq_lens[sel]
    start = 0
    for i, (q, c) in enumerate(zip(query_lens, context_lens)):
        if q > 1:
            slots = None
            if c:
                k = torch.arange(c + q, device=device)
                slots = tables[i, k // bs] * bs + k % bs
            ctx.chunks.append(Chunk(start, start + q, c, slots))
        start += q
    return ctx


_CONTEXT: StepContext | None = None


@contextmanager
def step_context(ctx: StepContext):
    """Publish `ctx` to the attention function for the duration of one forward."""
    global _CONTEXT
    prev, _CONTEXT = _CONTEXT, ctx
    try:
        yield ctx
    finally:
        _CONTEXT = prev


def get_context() -> StepContext | None:
    return _CONTEXT


def paged_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                            sliding_window: int | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """query [1, Hq, T, D], key/value [1, Hkv, T, D] (RoPE applied) -> ([1, T, Hq, D], None)."""
    ctx = _CONTEXT
    if ctx is None:
        raise RuntimeError("paged attention called outside a runner step: no StepContext is set "
                           "(switch the model back with model.set_attn_implementation('sdpa') to run it plainly)")
    if query.shape[0] != 1:
        raise ValueError(f"paged attention expects the batch flattened into one row, got batch {query.shape[0]}")
    layer = module.layer_idx
    k_cache, v_cache = ctx.cache.k_slots[layer], ctx.cache.v_slots[layer]
    q = query[0].transpose(0, 1)  # [T, Hq, D]
    k_new = key[0].transpose(0, 1)  # [T, Hkv, D]
    v_new = value[0].transpose(0, 1)
    k_cache.index_copy_(0, ctx.slot_mapping, k_new.to(k_cache.dtype))
    v_cache.index_copy_(0, ctx.slot_mapping, v_new.to(v_cache.dtype))

    T, Hq, D = q.shape
    Hkv = k_new.shape[1]
    group = Hq // Hkv
    out = q.new_empty(T, Hq, v_new.shape[-1])

    if ctx.decode_rows is not None:
        # One query per sequence: fold the query heads sharing a KV head into the "query length"
        # axis ([Bd, Hkv, group, D]), so GQA needs no repeated K/V.
        qd = q[ctx.decode_rows].reshape(-1, Hkv, group, D)
        kd = k_cache[ctx.decode_slots].transpose(1, 2).to(q.dtype)  # [Bd, Hkv, Lmax, D]
        vd = v_cache[ctx.decode_slots].transpose(1, 2).to(q.dtype)
        od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=ctx.decode_mask(sliding_window), scale=scaling)
        out[ctx.decode_rows] = od.reshape(-1, Hq, od.shape[-1])

    for ch in ctx.chunks:
        qs = q[ch.start:ch.end].transpose(0, 1)[None]  # [1, Hq, n, D]
        if ch.kv_slots is None:  # nothing cached before: attend over the new rows directly
            ks, vs = k_new[ch.start:ch.end], v_new[ch.start:ch.end]
        else:
            ks, vs = k_cache[ch.kv_slots].to(q.dtype), v_cache[ch.kv_slots].to(q.dtype)
        ks, vs = ks.transpose(0, 1)[None], vs.transpose(0, 1)[None]  # [1, Hkv, L, D]
        mask = ch.mask(sliding_window, q.device)
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, is_causal=mask is None, scale=scaling,
                                           enable_gqa=group > 1)
        out[ch.start:ch.end] = o[0].transpose(0, 1)
    return out[None], None


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
