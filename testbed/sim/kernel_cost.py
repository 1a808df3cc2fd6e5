"""A step's time composed from measured kernel latencies (`cost_model=kernels`).

The roofline prices every matmul at one efficiency; the real kernels are not that simple (small-m
GEMMs sit on a latency floor, attention kernels saturate with batch, all-reduce has a fixed cost).
Here each kernel a transformer layer launches is looked up in aiconfigurator-core's tables for the
GPU (`testbed.sim.kernel_db`) at the per-GPU shape it runs with under tensor parallelism, and the
step is their sum plus overhead terms fitted later on end-to-end runs.

Per layer, on one GPU of a TP group of t (vLLM's Megatron-style split,
vllm/model_executor/layers/linear.py: QKVParallelLinear, RowParallelLinear; a model with fewer KV
heads than t replicates them, one per GPU):
  QKV GEMM (m = step tokens, n = (H/t + 2 KV') d, k = hidden), O GEMM (n = hidden, k = H d / t),
  MLP gate_up (n = 2 I / t) and down (k = I / t) GEMMs, or for an MoE model the router GEMM and the
  fused-MoE kernel (routed tokens spread evenly) plus a shared expert's GEMMs if any,
  context attention for the prefill chunks, decode attention for the decode batch,
  two all-reduces of tokens x hidden bf16 elements at t > 1.
Once per step: the embedding's all-reduce (VocabParallelEmbedding) at t > 1 on the first stage and
the LM head GEMM over the sequences' last tokens (m = sequences, n = vocab / t) on the last.
Pipeline parallelism (p stages): the slowest stage, ceil(layers / p) layers, plus p - 1 hand-offs
of tokens x hidden activations over the interconnect.

Quantisation: the layers' GEMMs (not the router or the LM head, which vLLM leaves unquantised)
read the tables' fp8 rows for model.weight_dtype=fp8 on a GPU with fp8 tensor cores
(`HardwareSpec.fp8_flops`); int4, and fp8 without fp8 tensor cores, are weight-only (Marlin),
which the tables lack: the bf16 latency scaled by the roofline ratio of the bytes read
(`KernelDB.weight_only_gemm_over_m`). MoE experts read the tables' fp8 / int4_wo rows. An fp8
KV cache (kv.cache_dtype) reads the attention tables' fp8-KV rows. A table without the rows
fails at construction, naming the key, GPU, framework, op and dtype.

Attention from the batch's sums (BatchShape keeps no per-sequence lengths): the prefill chunks are
priced as num_prefill_seqs chunks of one length L, chosen so that their causal query-key pairs
b L (L + 1) / 2 equal the batch's (a chunk at an offset counts its pairs over the cached prefix
too), i.e. the table's FLOPs match; the decode batch at its mean context length.

Speculative decoding's verify pass (`BatchShape.num_spec_tokens`): the draft tokens are GEMM and LM-head
rows like any token; their attention is priced as decode attention with one row per query token at its
own context (`verify_as_decode_rows`). The tables hold one-query decode kernels and prefill kernels with
no cached prefix, and a verify (1 + k queries over a long cached context) is neither: the prefill table
would price a short chunk reading little KV, decode rows are exact in FLOPs and read each sequence's KV
once per query, an upper bound within (1 + k)x of the memory-bound cost, on a term that is small beside
the weights a low-batch decode step reads.
"""
from __future__ import annotations

import math

import numpy as np

from testbed.core.cost import BatchShape, decode_run_ends, verify_as_decode_rows
from testbed.core.specs import WEIGHT_DTYPES, HardwareSpec, ModelSpec, ParallelSpec
from testbed.sim.kernel_db import KernelDB, KernelDBError
from testbed.sim.sampler_cost import SamplerCost


class KernelCostModel:
    """step = kernel_scale x (kernels of the slowest pipeline stage) + pipeline hand-offs
    + step_overhead_s + layer_overhead_s x its layers + allreduce_overhead_s x its all-reduces
    + seq_overhead_s x sequences + the sampler (`sampler`, testbed/sim/sampler_cost.py) + swap: the GPU's
    time. vLLM's engine-core host work per step (scheduling, input preparation, output bookkeeping:
    host_step_s + host_seq_s x sequences, measured with vLLM 0.15.1's own code, experiments/host_overhead/)
    runs while the GPU executes the previous step under async scheduling (vllm/v1/engine/core.py
    `step_with_batch_queue`), so a step takes max(GPU, host); without it, GPU + host.

    Everything that depends on the token count alone (GEMMs, MoE, all-reduces) is tabulated at
    construction for 1..max_tokens tokens; attention look-ups are memoised on (batch, length), so a
    call is a few dictionary and list look-ups."""

    name = "kernels"

    def __init__(self, model: ModelSpec, hardware: HardwareSpec, parallel: ParallelSpec, db: KernelDB, *,
                 step_overhead_s: float = 0.0, layer_overhead_s: float = 0.0, seq_overhead_s: float = 0.0,
                 allreduce_overhead_s: float = 0.0, kernel_scale: float = 1.0, block_size: int = 16,
                 max_tokens: int = 16384, sampler: SamplerCost | None = None, host_step_s: float = 0.0,
                 host_seq_s: float = 0.0, async_scheduling: bool = True):
        hardware.validate()
        parallel.validate()
        for key, v in (("step_overhead_s", step_overhead_s), ("layer_overhead_s", layer_overhead_s),
                       ("seq_overhead_s", seq_overhead_s), ("allreduce_overhead_s", allreduce_overhead_s),
                       ("host_step_s", host_step_s), ("host_seq_s", host_seq_s)):
            if not v >= 0:
                raise ValueError(f"cost_model.{key}={v}: must be >= 0")
        if not kernel_scale > 0:
            raise ValueError(f"cost_model.kernel_scale={kernel_scale}: must be > 0")
        if model.dtype not in ("bfloat16", "float16"):
            raise KernelDBError(f"model.dtype={model.dtype!r}: the kernel tables used are bf16 only")
        self.model, self.hw, self.parallel, self.db = model, hardware, parallel, db
        t, p = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
        m = model
        m.check_parallel(parallel)
        self.heads, self.kv_heads = m.num_heads // t, m.kv_heads_per_gpu(t)
        self.layers_per_stage = max(m.stage_layers(p))
        self.kernel_scale = kernel_scale
        # a tensor-parallel all-reduce is also a barrier: in a real step each one waits for the slowest GPU
        # of the group, which a kernel timed alone never does (two per layer and the embedding's, at t > 1)
        allreduces = (2 * self.layers_per_stage + 1) if t > 1 else 0
        self.step_overhead = step_overhead_s + layer_overhead_s * self.layers_per_stage \
            + allreduce_overhead_s * allreduces
        self.seq_overhead = seq_overhead_s
        # the sampler runs after the LM head on the last stage, once per step over every sampled row
        self.sampler = sampler
        self.sampler_fixed = sampler.fixed_s if sampler is not None else 0.0
        self.sampler_per_row = sampler.per_row_s if sampler is not None else 0.0
        self.host_step, self.host_seq, self.async_scheduling = host_step_s, host_seq_s, async_scheduling
        self.max_tokens = max_tokens
        # a stage hands tokens x hidden activations to the next; each GPU of a stage moves its own share
        self.handoff_per_token = (p - 1) * m.hidden_size * m.dtype_bytes / hardware.interconnect_bandwidth
        self.handoff_fixed = (p - 1) * hardware.interconnect_latency_s
        self.swap_per_block = block_size * m.kv_bytes_per_token_per_gpu(parallel) / hardware.host_link_bandwidth
        self.kv_dtype = "fp8" if model.kv_dtype_bytes == 1 else "bfloat16"  # the tables' kv_cache_dtype
        self._weights = _weight_kernels(model, hardware)
        self._check_attention()
        ms = np.arange(1, max_tokens + 1, dtype=float)
        # index n: n tokens (index 0 unused)
        self._layer = [0.0] + self._layer_token_costs(ms).tolist()
        self._per_step = [0.0] + self._step_token_costs(ms).tolist()
        self._lm_head = [0.0] + self._lm_head_costs(ms).tolist()
        self._ctx_memo: dict[tuple[int, int], float] = {}
        self._gen_memo: dict[tuple[int, int], float] = {}
        self._big_memo: dict[int, tuple[float, float]] = {}
        # a plain decode step's time by (sequences, mean context): `decode_run_ends`' steps
        self._decode_memo: dict[int, dict[int, float]] = {}

    # ------------------------------------------------------------ tabulated parts
    def _gemm(self, n: int, k: int, ms: np.ndarray) -> np.ndarray:
        return self.db.gemm_over_m(n, k, ms)

    def _linear(self, n: int, k: int, ms: np.ndarray) -> np.ndarray:
        """A layer's GEMM at the weight dtype (`_gemm`: an unquantised one, the router and LM head)."""
        table, weight_only_bytes = self._weights
        if weight_only_bytes is not None:
            return self.db.weight_only_gemm_over_m(n, k, ms, weight_only_bytes, self.hw.matmul_flops,
                                                   self.hw.mem_bandwidth)
        if table == "bfloat16":
            return self._gemm(n, k, ms)
        try:
            return self.db.gemm_over_m(n, k, ms, table)
        except KernelDBError as e:
            raise KernelDBError(f"model.weight_dtype={self.model.weight_dtype}: {e}") from None

    def _allreduce(self, ms: np.ndarray) -> np.ndarray:
        t = self.parallel.tensor_parallel_size
        if t == 1:
            return np.zeros_like(ms)
        return self.db.allreduce_over_elements(ms * self.model.hidden_size, t)

    def _layer_token_costs(self, ms: np.ndarray) -> np.ndarray:
        """One layer's token-count-only kernels (all but attention) for each token count in `ms`."""
        m, t = self.model, self.parallel.tensor_parallel_size
        h, d = m.hidden_size, m.head_dim
        cost = self._linear((self.heads + 2 * self.kv_heads) * d, h, ms) + self._linear(h, self.heads * d, ms)
        if m.is_moe:
            inter = m.moe_intermediate_size or m.intermediate_size
            cost = cost + self._gemm(m.num_experts, h, ms)  # router (replicated on every GPU)
            cost = cost + self.db.moe_over_tokens(ms, h, inter, m.num_experts_per_tok, m.num_experts, t,
                                                  self.hw.matmul_flops, self.hw.mem_bandwidth, self._moe_dtype())
            if m.shared_expert_intermediate_size:
                si = -(-m.shared_expert_intermediate_size // t)
                cost = cost + self._linear(2 * si, h, ms) + self._linear(h, si, ms)
        else:
            inter = -(-m.intermediate_size // t)
            cost = cost + self._linear(2 * inter, h, ms) + self._linear(h, inter, ms)
        return cost + 2 * self._allreduce(ms)

    def _step_token_costs(self, ms: np.ndarray) -> np.ndarray:
        """Once-per-step token-count kernels: the embedding all-reduce (first stage)."""
        return self._allreduce(ms)

    def _lm_head_costs(self, seqs: np.ndarray) -> np.ndarray:
        t = self.parallel.tensor_parallel_size
        return self._gemm(-(-self.model.vocab_size // t), self.model.hidden_size, seqs)

    def _moe_dtype(self) -> str:
        """The MoE tables' moe_dtype for the weight dtype (the experts are quantised as the linear layers)."""
        table, weight_only_bytes = self._weights
        if weight_only_bytes is None:
            return table
        if self.model.weight_format == "int4":
            return "int4_wo"
        raise KernelDBError(f"model.weight_dtype={self.model.weight_dtype}: {self.hw.name} has no fp8 tensor cores "
                            f"(hardware.fp8_flops is null) and the kernel tables measure no weight-only fp8 MoE "
                            f"kernel; use cost_model=roofline")

    def _check_attention(self) -> None:
        """Fail at construction, not mid-run, on a head_dim (or KV dtype) the tables lack."""
        d = self.model.head_dim
        try:
            self.db.attention_grid("context", self.heads, self.kv_heads, d, self.kv_dtype)
            self.db.attention_grid("generation", self.heads, self.kv_heads, d, self.kv_dtype)
        except KernelDBError as e:
            if self.kv_dtype == "bfloat16":
                raise
            raise KernelDBError(f"kv.cache_dtype={self.model.kv_cache_dtype}: {e}") from None

    def _beyond(self, tokens: int) -> tuple[float, float]:
        hit = self._big_memo.get(tokens)
        if hit is None:
            arr = np.array([float(tokens)])
            hit = self._big_memo[tokens] = (float(self._layer_token_costs(arr)[0]),
                                            float(self._step_token_costs(arr)[0]))
        return hit

    # ------------------------------------------------------------ attention
    def context_attention(self, seqs: int, pairs: float) -> float:
        length = round((math.sqrt(1.0 + 8.0 * pairs / seqs) - 1.0) / 2.0)
        key = (seqs, max(1, length))
        hit = self._ctx_memo.get(key)
        if hit is None:
            hit = self._ctx_memo[key] = self.db.context_attention(seqs, key[1], self.heads, self.kv_heads,
                                                                  self.model.head_dim, self.kv_dtype)
        return hit

    def generation_attention(self, seqs: int, kv_tokens: int) -> float:
        key = (seqs, max(1, round(kv_tokens / seqs)))
        hit = self._gen_memo.get(key)
        if hit is None:
            hit = self._gen_memo[key] = self.db.generation_attention(seqs, key[1], self.heads, self.kv_heads,
                                                                     self.model.head_dim, self.kv_dtype)
        return hit

    # ------------------------------------------------------------ the step
    def step_time(self, s: BatchShape) -> float:
        tokens = s.num_prefill_tokens + s.num_decode_seqs + s.num_spec_tokens  # draft tokens: GEMM rows like any
        swap = (s.swap_blocks + s.load_blocks) * self.swap_per_block  # host->device: swap-ins and host-tier loads
        if tokens == 0:
            return self.step_overhead + swap
        seqs = s.num_prefill_seqs + s.num_decode_seqs
        if tokens <= self.max_tokens:
            layer, per_step = self._layer[tokens], self._per_step[tokens]
        else:
            layer, per_step = self._beyond(tokens)
        if s.num_prefill_seqs:
            layer += self.context_attention(s.num_prefill_seqs, s.prefill_attn_pairs)
        if s.num_decode_seqs:
            rows = verify_as_decode_rows(s) if s.num_spec_tokens else s
            layer += self.generation_attention(rows.num_decode_seqs, rows.decode_kv_tokens)
        heads = seqs + s.num_spec_tokens  # a verify needs logits at every draft position
        lm = self._lm_head[heads] if heads <= self.max_tokens else float(self._lm_head_costs(np.array([heads]))[0])
        sample = self.sampler_fixed + self.sampler_per_row * heads  # not a table kernel: kernel_scale leaves it
        if self.parallel.pipeline_parallel_size == 1:
            kernels = self.kernel_scale * (self.layers_per_stage * layer + (per_step + lm)) + sample
        else:  # the first stage's embedding all-reduce against the last stage's LM head and sampler
            kernels = self.kernel_scale * self.layers_per_stage * layer \
                + max(self.kernel_scale * per_step, self.kernel_scale * lm + sample)
        gpu = (kernels + self.handoff_per_token * tokens + self.handoff_fixed
               + self.step_overhead + self.seq_overhead * seqs + swap)
        host = self.host_step + self.host_seq * seqs
        return (gpu if gpu >= host else host) if self.async_scheduling else gpu + host


    def decode_run_ends(self, s: BatchShape, start: float, k_max: int, next_arrival: float,
                        horizon: float) -> list[float]:
        """`testbed.core.cost.decode_run_ends` in one call. A plain decode step (no prefill, drafts, swaps
        or loads) is priced from its sequence count and mean context alone, the key `generation_attention`
        memoises on, so each step's time is looked up by that key, computed by `step_time` the first time:
        the same floats, summed in the same order."""
        n = s.num_decode_seqs
        if not n or s.num_prefill_seqs or s.num_spec_tokens or s.swap_blocks or s.load_blocks:
            return decode_run_ends(self.step_time, s, start, k_max, next_arrival, horizon)
        times = self._decode_memo.get(n)
        if times is None:
            times = self._decode_memo[n] = {}
        ctx0 = s.decode_kv_tokens
        # generation_attention's key, round(ctx / n), in integers: ctx0 = q n + r, and each step adds n, so step
        # i's is q + i, one more where 2 r > n, and where 2 r == n (a tie, rounded to even) the even of q + i and
        # q + i + 1 (exact: ctx / n is never rounded across a half while ctx < 2**40)
        q, r = divmod(ctx0, n)
        exact = ctx0 + k_max * n < 1 << 40
        up = 1 if 2 * r > n else 0
        tie = 2 * r == n
        ends: list[float] = []
        t = start
        for i in range(k_max):
            if i and t >= next_arrival:
                break
            if not exact:
                length = round((ctx0 + i * n) / n)
            elif tie:
                length = q + i + ((q + i) & 1)
            else:
                length = q + i + up
            dt = times.get(length)
            if dt is None:
                s.decode_kv_tokens = ctx0 + i * n
                try:
                    dt = times[length] = self.step_time(s)
                finally:
                    s.decode_kv_tokens = ctx0
            end = t + dt
            if end >= horizon:
                break
            ends.append(end)
            t = end
        return ends


def _weight_kernels(model: ModelSpec, hardware: HardwareSpec) -> tuple[str, float | None]:
    """(the GEMM tables' gemm_dtype, None) for weights the tables measure: bf16, or fp8 (W8A8) on a GPU
    with fp8 tensor cores; ("bfloat16", bytes per weight) for weight-only ones (int4, fp8 without fp8
    tensor cores), priced from the bf16 rows."""
    fmt = model.weight_format
    if fmt in ("bfloat16", "float16"):
        return "bfloat16", None
    if fmt == "fp8" and hardware.fp8_flops is not None:
        return "fp8", None
    num, den = WEIGHT_DTYPES[fmt]
    return "bfloat16", num / den
