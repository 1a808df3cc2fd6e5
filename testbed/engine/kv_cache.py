"""The KV tensors behind the `BlockManager`'s block ids.

The block manager decides which block a token's K and V live in; this module only holds
the memory. Block `b` of every layer is row `b` of that layer's K and V tensors, so the
ids the shared step loop hands out index the cache directly and no translation table
can drift from the bookkeeping. One allocation holds everything ([2, layers, blocks,
block_size, kv_heads, head_dim]), so a swap moves a request's blocks of every layer in
one gather and one scatter.

With `scratch_block=True` one more block is allocated past the last id the block manager
hands out: the fixed-shape decode path (`testbed.engine.decode_graphs`) pads its batches with
rows that write there, so padding can never touch a request's KV.
"""
from __future__ import annotations

import torch


class PagedKVCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu", scratch_block: bool = False):
        for key, v in (("num_layers", num_layers), ("num_blocks", num_blocks), ("block_size", block_size),
                       ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
            if v < 1:
                raise ValueError(f"PagedKVCache: {key}={v}, must be >= 1")
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.num_kv_heads, self.head_dim, self.dtype = num_kv_heads, head_dim, dtype
        self.device = torch.device(device)
        self.scratch_block = num_blocks if scratch_block else None
        rows = num_blocks + scratch_block
        # Zeros, not empty: padded decode rows gather slot 0 under a mask, and 0 * NaN would leak.
        self.data = torch.zeros(2, num_layers, rows, block_size, num_kv_heads, head_dim,
                                dtype=dtype, device=self.device)
        # Per-layer views [rows, block_size, kv_heads, head_dim] (rows: num_blocks, + 1 scratch), and the same memory
        # flattened to slots [rows * block_size, kv_heads, head_dim] (slot = block * block_size + offset).
        self.k = list(self.data[0].unbind(0))
        self.v = list(self.data[1].unbind(0))
        self.k_slots = [t.view(rows * block_size, num_kv_heads, head_dim) for t in self.k]
        self.v_slots = [t.view(rows * block_size, num_kv_heads, head_dim) for t in self.v]

    @classmethod
    def for_model(cls, config, num_blocks: int, block_size: int, dtype: torch.dtype | None = None,
                  device: str | torch.device = "cpu", scratch_block: bool = False) -> "PagedKVCache":
        """A cache shaped for a transformers config (layers, KV heads, head dim); dtype defaults to the config's."""
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        if dtype is None:
            dtype = config.dtype if isinstance(getattr(config, "dtype", None), torch.dtype) else torch.bfloat16
        return cls(config.num_hidden_layers, num_blocks, block_size, kv_heads, head_dim, dtype, device, scratch_block)

    @staticmethod
    def block_bytes(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes of one block: K and V of every layer for `block_size` tokens."""
        return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def bytes_needed(self, num_blocks: int) -> int:
        """Bytes a cache of this shape needs for `num_blocks` blocks."""
        return num_blocks * self.block_bytes(self.num_layers, self.block_size, self.num_kv_heads, self.head_dim,
                                             self.dtype)

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    # --- swap -------------------------------------------------------------------------------
    def _index(self, block_ids: list[int]) -> torch.Tensor:
        return torch.as_tensor(block_ids, dtype=torch.long).to(self.device, non_blocking=True)

    @torch.inference_mode()
    def copy_blocks_to_host(self, block_ids: list[int]) -> torch.Tensor:
        """A host copy of these blocks, all layers, shaped [2, layers, len(block_ids), block_size, kv_heads, head_dim]
        (pinned when the cache is on a GPU). Call it before the blocks can be written again."""
        src = self.data.index_select(2, self._index(block_ids))
        if self.device.type == "cpu":
            return src  # index_select already made a copy
        host = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
        host.copy_(src)  # synchronous: the blocks may be reused as soon as this returns
        return host

    @torch.inference_mode()
    def copy_blocks_from_host(self, host: torch.Tensor, block_ids: list[int]) -> None:
        """Write a `copy_blocks_to_host` result into (possibly different) blocks, in order."""
        if host.shape[2] != len(block_ids):
            raise ValueError(f"copy_blocks_from_host: {host.shape[2]} host blocks for {len(block_ids)} block ids")
        self.data.index_copy_(2, self._index(block_ids), host.to(self.device, non_blocking=True))
