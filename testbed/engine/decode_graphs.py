"""Decode-only steps on fixed shapes, replayed as CUDA graphs on a GPU.

A decode step of a small model is mostly kernel launches: hundreds of them per layer
stack, each a few microseconds of host time, against a few milliseconds of GPU work.
Capturing the step once per shape and replaying it removes that host time (vLLM and
nano-vllm do the same for decode). A graph replays fixed shapes and fixed addresses, so
every input lives in a preallocated buffer (`meta`: one row per sequence holding its
token id, position, sequence length and block table), a step pads its batch up to the
next size of a ladder (padding rows write into the cache's scratch block and are never
read), and each sequence's context is gathered over a fixed number of blocks, the next
bucket above the longest one in the batch (masked beyond each sequence's length).

The same body runs eagerly (`use_graphs=False`, any device): that is what the CPU tests
check against the reference path token for token; on CUDA the captured graphs replay it.
Per step the host fills one pinned staging buffer and makes one host-to-device copy; the
greedy token ids are taken on the device and copied back once.

Shapes are bounded by `max_context_tokens` (batch x gathered context): the gather
holds that many tokens of K and V per layer, so bigger decode batches take the eager path.
"""
from __future__ import annotations

import bisect

import torch

from testbed.engine.attention import StepContext, step_context
from testbed.engine.kv_cache import PagedKVCache

# Batch sizes and context buckets (in blocks) graphs are kept for; a step pads up to the next.
BATCH_LADDER = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)
BLOCK_LADDER = (1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 128, 160, 192, 256, 320, 384, 512, 640, 768, 1024,
                1280, 1536, 2048, 2560, 3072, 4096, 5120, 6144, 8192)

ID, POS, LEN, TABLE = 0, 1, 2, 3  # columns of `meta`


def ladder(values: tuple[int, ...], top: int) -> list[int]:
    """The ladder's values below `top`, then `top` itself."""
    return [v for v in values if v < top] + [top]


class DecodeGraphs:
    def __init__(self, model, cache: PagedKVCache, max_batch: int, max_model_len: int, use_graphs: bool,
                 max_context_tokens: int = 262_144):
        if cache.scratch_block is None:
            raise ValueError("DecodeGraphs needs a PagedKVCache with a scratch block (padding rows write there)")
        self.model, self.cache, self.use_graphs = model, cache, use_graphs
        self.device = cache.device
        if use_graphs and self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, the KV cache is on {self.device}")
        bs = self.block_size = cache.block_size
        self.batch_sizes = ladder(BATCH_LADDER, max_batch)
        self.block_buckets = ladder(BLOCK_LADDER, -(-max_model_len // bs))
        self.max_context_tokens = max_context_tokens
        width = TABLE + self.block_buckets[-1]
        rows = self.batch_sizes[-1]
        self.meta = torch.zeros(rows, width, dtype=torch.long, device=self.device)
        self.staging = torch.zeros(rows, width, dtype=torch.long, pin_memory=self.device.type == "cuda")
        self.host = self.staging.numpy()
        self.out_ids = torch.zeros(rows, dtype=torch.long, device=self.device)
        self.key_index = torch.arange(self.block_buckets[-1] * bs, device=self.device)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.pool = None
        self._pad_rows(0, rows, width)
        self.meta.copy_(self.staging)

    # --- shapes ---------------------------------------------------------------------------
    def shape_for(self, batch: int, max_seq_len: int) -> tuple[int, int] | None:
        """(padded batch, context blocks) of a decode step, or None when it is too big for a fixed shape."""
        i = bisect.bisect_left(self.batch_sizes, batch)
        j = bisect.bisect_left(self.block_buckets, -(-max_seq_len // self.block_size))
        if i == len(self.batch_sizes) or j == len(self.block_buckets):
            return None
        shape = self.batch_sizes[i], self.block_buckets[j]
        return shape if shape[0] * shape[1] * self.block_size <= self.max_context_tokens else None

    def _pad_rows(self, start: int, stop: int, width: int) -> None:
        """Rows that decode token 0 at position 0 into the scratch block."""
        h = self.host
        h[start:stop, :width] = self.cache.scratch_block
        h[start:stop, ID] = 0
        h[start:stop, POS] = 0
        h[start:stop, LEN] = 1

    # --- one step ---------------------------------------------------------------------------
    def _body(self, batch: int, blocks: int) -> None:
        """The forward of a padded decode step, reading only `meta` and writing only `out_ids` (and the cache)."""
        bs = self.block_size
        meta = self.meta[:batch]
        ids, pos, lens = meta[:, ID], meta[:, POS], meta[:, LEN]
        tables = meta[:, TABLE:TABLE + blocks]
        k = self.key_index[:blocks * bs]
        slots = tables[:, k // bs] * bs + k % bs  # [batch, blocks * bs]: each row's whole context
        slot_mapping = tables.gather(1, (pos // bs)[:, None])[:, 0] * bs + pos % bs
        ctx = StepContext(self.cache, cu_seqlens_q=None, context_lens=pos, seq_lens=lens, block_tables=tables,
                          slot_mapping=slot_mapping, positions=pos, max_seqlen_q=1, max_seqlen_k=blocks * bs,
                          decode_rows=slice(None), decode_slots=slots, decode_lens=lens)
        with step_context(ctx):
            out = self.model(input_ids=ids[None], position_ids=pos[None], use_cache=False, logits_to_keep=0)
        self.out_ids[:batch].copy_(out.logits[0].argmax(-1))

    def _graph(self, shape: tuple[int, int]) -> torch.cuda.CUDAGraph:
        g = self.graphs.get(shape)
        if g is None:
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):  # warm-up outside the graph (lazy inits, allocator)
                self._body(*shape)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            g = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(g, pool=self.pool):
                    self._body(*shape)
            except RuntimeError as e:
                raise RuntimeError(f"CUDA graph capture of a decode step (batch {shape[0]}, {shape[1]} context "
                                   f"blocks) failed: {e}. backend.cuda_graphs=false runs decode steps eagerly") from e
            self.pool = g.pool()  # every graph shares one memory pool
            self.graphs[shape] = g
        return g

    @torch.inference_mode()
    def capture(self) -> int:
        """Capture every shape within the limits, largest first (so the shared pool is sized once)."""
        if not self.use_graphs:
            return 0
        shapes = [(b, n) for b in self.batch_sizes for n in self.block_buckets
                  if b * n * self.block_size <= self.max_context_tokens]
        for shape in sorted(shapes, key=lambda s: s[0] * s[1], reverse=True):
            self._graph(shape)
        torch.cuda.synchronize(self.device)
        return len(self.graphs)

    def stage(self, items, token_ids: dict[int, list[int]], shape: tuple[int, int]) -> None:
        """Host work of a step: fill the staging rows and start their one copy to the device.
        items: (state, 1) pairs whose token `num_computed` is known and whose blocks cover it."""
        batch, blocks = shape
        bs, h = self.block_size, self.host
        width = TABLE + blocks
        for i, (s, _) in enumerate(items):
            c = s.num_computed
            used = c // bs + 1
            h[i, ID] = token_ids[s.req.id][c]
            h[i, POS] = c
            h[i, LEN] = c + 1
            h[i, TABLE:TABLE + used] = s.blocks[:used]
            h[i, TABLE + used:width] = self.cache.scratch_block
        self._pad_rows(len(items), batch, width)
        self.meta[:batch].copy_(self.staging[:batch], non_blocking=True)

    @torch.inference_mode()
    def forward(self, num_items: int, shape: tuple[int, int]) -> list[int]:
        """The staged step's forward; its greedy token ids on the host."""
        if self.use_graphs:
            self._graph(shape).replay()
        else:
            self._body(*shape)
        return self.out_ids[:num_items].tolist()  # waits for the device
