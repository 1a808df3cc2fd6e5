"""The analytic roofline cost model: a step's time from the model's shapes and the hardware's
peak rates, with no measurement beyond those rates (the interface is `testbed.core.cost`)."""
from __future__ import annotations

from dataclasses import dataclass

from testbed.core.cost import BatchShape, decode_run_ends
from testbed.core.specs import HardwareSpec, ModelSpec, ParallelSpec


@dataclass(frozen=True)
class _Stage:
    """What one GPU of one pipeline stage computes and reads per step (tensor-parallel share)."""

    linear_flops_per_token: float  # 2 FLOPs per active weight (MoE: the token's top-k experts), at the bf16 rate
    lm_head_flops_per_seq: int  # last stage only
    attn_flops_per_pair: int
    dense_weight_bytes: int  # weights every step reads whole (MoE: all but the routed experts)
    expert_weight_bytes: int  # one routed expert's weights across the stage's layers (0: dense)
    kv_bytes_per_token: int
    num_allreduces: int  # two per layer under TP > 1 (after attention, after the MLP), else 0
    allreduce_bytes_per_token: int  # the hidden states those all-reduces carry


class RooflineCostModel:
    """Each part of the step runs at the slower of its compute and its memory traffic.

    Linear layers read every weight once per step and do 2 FLOPs per weight per token;
    attention reads each sequence's KV and does 4 FLOPs per query-key pair per head-dim
    element; a fixed overhead covers launch and sampling. Calibrated against figures
    measured on an H100 (see README): a Llama-3-8B batch-1 decode step gives 6.5 ms and
    a 1024-token prefill 29 ms.

    Parallelism (`ParallelSpec`): every GPU does its tensor-parallel share of the FLOPs and reads
    its share of the weights and KV; each layer adds two ring all-reduces of the step's hidden
    states (after attention and after the MLP, as vLLM's RowParallelLinear does), each
    2 (tp-1)/tp x bytes over the interconnect plus its latency. Pipeline stages: vLLM keeps one
    batch in flight per stage, so a step advances at the pace of the slowest stage, plus the
    (pp-1) hand-offs of the hidden states between stages.

    MoE: FLOPs follow the active parameters (top-k experts per token); the weights read are the
    attention, the shared expert and the router, plus the experts the step's tokens touch: under
    uniform routing T tokens hit E (1 - (1 - k/E)^T) distinct experts of E (a batch-1 decode
    reads only its top-k, a long prefill all E).

    Quantisation (`ModelSpec.weight_format`, `kv_dtype_bytes`): the linear layers' weights are read
    at the weight dtype (int4 with its group scales; embeddings, LM head, norms and router at the
    model's dtype), the KV at the KV-cache dtype. fp8 weights on a GPU with fp8 tensor cores
    (`HardwareSpec.fp8_flops`) are W8A8 GEMMs at the fp8 rate (vLLM's cutlass scaled_mm); elsewhere,
    and for int4, they are weight-only (Marlin dequantises to bf16) at the bf16 rate. Attention
    computes at the bf16 rate whatever the KV dtype.

    Speculative decoding's verify pass (`BatchShape.num_spec_tokens`): each draft token is one more token
    through the linear layers and the LM head, with its query-key pairs; the draft model's passes are priced
    by `testbed.sim.spec_cost`.
    """

    name = "roofline"

    def __init__(self, model: ModelSpec, hardware: HardwareSpec, block_size: int = 16,
                 parallel: ParallelSpec | None = None):
        hardware.validate()
        parallel = parallel or ParallelSpec()
        parallel.validate()
        model.check_parallel(parallel)
        self.model, self.hw, self.parallel = model, hardware, parallel
        m, tp, pp = model, parallel.tensor_parallel_size, parallel.pipeline_parallel_size
        # fp8 GEMMs at the fp8 peak: their FLOPs counted in bf16-rate units (1: no fp8 compute)
        fp8 = m.weight_format == "fp8" and hardware.fp8_flops is not None
        gemm_speedup = hardware.fp8_flops / hardware.matmul_flops if fp8 else 1
        self._stages = [self._stage(m, tp, layers, last=i == pp - 1, gemm_speedup=gemm_speedup)
                        for i, layers in enumerate(m.stage_layers(pp))]
        self._moe = (m.num_experts, m.num_experts_per_tok / m.num_experts) if m.is_moe else None
        self._tp_factor = 2 * (tp - 1) / tp if tp > 1 else 0.0
        self._handoff_bytes_per_token = m.hidden_size * m.dtype_bytes if pp > 1 else 0
        self._num_handoffs = pp - 1
        self._peak = hardware.matmul_flops * hardware.compute_efficiency
        self._peak_attn = hardware.matmul_flops * hardware.attention_efficiency
        self._bw = hardware.mem_bandwidth * hardware.memory_efficiency
        kv_eff = hardware.kv_read_efficiency
        self._kv_bw = self._bw if kv_eff is None else hardware.mem_bandwidth * kv_eff
        self._link_bw, self._link_latency = hardware.interconnect_bandwidth, hardware.interconnect_latency_s
        self._overhead = hardware.step_overhead_s
        self._per_decode_seq = hardware.decode_seq_overhead_s
        self._swap_bytes_per_block = (block_size * m.kv_bytes_per_token_per_gpu(parallel)
                                      / hardware.host_link_bandwidth)

    @staticmethod
    def _stage(m: ModelSpec, tp: int, layers: int, last: bool, gemm_speedup: float = 1) -> _Stage:
        final_norm = m.hidden_size if last else 0
        # the LM head is read (a tied one is the embedding, left out as the single-GPU model always did)
        lm_head = m.embedding_params_per_gpu(tp) if last and not m.tie_word_embeddings else 0
        active = layers * m.layer_params_per_gpu(tp, active=True) + final_norm
        whole = layers * m.layer_params_per_gpu(tp) + final_norm + lm_head
        expert = layers * m.expert_params_per_gpu(tp) if m.is_moe else 0
        # the dense weights split into the quantised linear layers and the rest (norms, router, LM head)
        unquantised = layers * m.layer_unquantised_params + final_norm + lm_head
        dense_linear = whole - m.num_experts * expert - unquantised
        return _Stage(
            linear_flops_per_token=2 * active if gemm_speedup == 1 else 2 * active / gemm_speedup,
            lm_head_flops_per_seq=2 * m.embedding_params_per_gpu(tp) if last else 0,
            attn_flops_per_pair=4 * layers * (m.num_heads // tp) * m.head_dim,
            dense_weight_bytes=m.linear_weight_bytes(dense_linear) + unquantised * m.dtype_bytes,
            expert_weight_bytes=m.linear_weight_bytes(expert),
            kv_bytes_per_token=2 * layers * m.kv_heads_per_gpu(tp) * m.head_dim * m.kv_dtype_bytes,
            num_allreduces=2 * layers if tp > 1 else 0,
            allreduce_bytes_per_token=2 * layers * m.hidden_size * m.dtype_bytes if tp > 1 else 0,
        )

    def _stage_time(self, st: _Stage, s: BatchShape, tokens: int, seqs: int) -> float:
        linear_flops = st.linear_flops_per_token * tokens + st.lm_head_flops_per_seq * seqs
        weight_bytes = float(st.dense_weight_bytes)  # the same value as the int (the bytes are < 2**53), typed as the MoE sum below is
        if self._moe is not None:
            experts, k_over_e = self._moe
            weight_bytes += experts * (1 - (1 - k_over_e) ** tokens) * st.expert_weight_bytes
        t_linear = max(linear_flops / self._peak, weight_bytes / self._bw)
        # a verify pass's draft queries add their query-key pairs; a sequence's 1 + k queries form one query
        # block of the attention kernel, so its KV is read once (the drafts' own KV is new)
        attn_flops = st.attn_flops_per_pair * (s.prefill_attn_pairs + s.decode_kv_tokens + s.spec_kv_tokens)
        kv_bytes = st.kv_bytes_per_token * (s.prefill_kv_tokens + s.decode_kv_tokens + s.num_spec_tokens)
        t = self._overhead + t_linear + max(attn_flops / self._peak_attn, kv_bytes / self._kv_bw)
        if st.num_allreduces:  # ring all-reduce: each GPU sends and receives 2 (tp-1)/tp of the message
            t += (self._tp_factor * st.allreduce_bytes_per_token * tokens / self._link_bw
                  + st.num_allreduces * self._link_latency)
        return t

    def step_time(self, s: BatchShape) -> float:
        tokens = s.num_prefill_tokens + s.num_decode_seqs + s.num_spec_tokens  # draft tokens go through every layer
        if tokens == 0:
            return self._overhead + (s.swap_blocks + s.load_blocks) * self._swap_bytes_per_block
        seqs = s.num_prefill_seqs + s.num_decode_seqs + s.num_spec_tokens  # LM head rows: a verify needs logits at every draft
        if len(self._stages) == 1:
            t = self._stage_time(self._stages[0], s, tokens, seqs)
        else:
            t = max(self._stage_time(st, s, tokens, seqs) for st in self._stages)
            t += self._num_handoffs * (self._handoff_bytes_per_token * tokens / self._link_bw + self._link_latency)
        t = t + (s.swap_blocks + s.load_blocks) * self._swap_bytes_per_block
        if self._per_decode_seq:
            t += s.num_decode_seqs * self._per_decode_seq
        return t

    def decode_run_ends(self, s: BatchShape, start: float, k_max: int, next_arrival: float,
                        horizon: float) -> list[float]:
        """`testbed.core.cost.decode_run_ends` in one call: only the decode contexts change from step to
        step, so what `step_time` computes from the rest is computed once, and each step's time is the
        same float expression, evaluated in the same order, as `step_time` gives for it."""
        tokens = s.num_prefill_tokens + s.num_decode_seqs + s.num_spec_tokens
        if tokens == 0 or len(self._stages) != 1:
            return decode_run_ends(self.step_time, s, start, k_max, next_arrival, horizon)
        seqs = s.num_prefill_seqs + s.num_decode_seqs + s.num_spec_tokens
        st = self._stages[0]
        # _stage_time's invariants: its linear part (with the overhead it is added to first), the
        # all-reduces; then step_time's swap traffic and per-sequence overhead
        linear_flops = st.linear_flops_per_token * tokens + st.lm_head_flops_per_seq * seqs
        weight_bytes = float(st.dense_weight_bytes)  # the same value as the int (the bytes are < 2**53), typed as the MoE sum below is
        if self._moe is not None:
            experts, k_over_e = self._moe
            weight_bytes += experts * (1 - (1 - k_over_e) ** tokens) * st.expert_weight_bytes
        base = self._overhead + max(linear_flops / self._peak, weight_bytes / self._bw)
        allreduce = (self._tp_factor * st.allreduce_bytes_per_token * tokens / self._link_bw
                     + st.num_allreduces * self._link_latency) if st.num_allreduces else None
        swap = (s.swap_blocks + s.load_blocks) * self._swap_bytes_per_block
        per_seq = s.num_decode_seqs * self._per_decode_seq if self._per_decode_seq else None
        attn_per_pair, kv_per_token = st.attn_flops_per_pair, st.kv_bytes_per_token
        peak_attn, kv_bw = self._peak_attn, self._kv_bw
        pairs, spec_kv, prefill_kv, spec = s.prefill_attn_pairs, s.spec_kv_tokens, s.prefill_kv_tokens, s.num_spec_tokens
        n, ctx = s.num_decode_seqs, s.decode_kv_tokens
        ends = []
        t = start
        for i in range(k_max):
            if i and t >= next_arrival:
                break
            attn = attn_per_pair * (pairs + ctx + spec_kv) / peak_attn
            kv = kv_per_token * (prefill_kv + ctx + spec) / kv_bw
            dt = base + (kv if kv > attn else attn)  # max(attn, kv)
            if allreduce is not None:
                dt += allreduce
            if swap:  # dt + 0.0 is dt (a step's time is positive)
                dt = dt + swap
            if per_seq is not None:
                dt += per_seq
            end = t + dt
            if end >= horizon:
                break
            ends.append(end)
            t = end
            ctx += n
        return ends
