"""The analytic roofline cost model: a step's time from the model's shapes and the hardware's
peak rates, with no measurement beyond those rates (the interface is `testbed.core.cost`)."""
from __future__ import annotations

from testbed.core.cost import BatchShape
from testbed.core.specs import HardwareSpec, ModelSpec


class RooflineCostModel:
    """Each part of the step runs at the slower of its compute and its memory traffic.

    Linear layers read every weight once per step and do 2 FLOPs per weight per token;
    attention reads each sequence's KV and does 4 FLOPs per query-key pair per head-dim
    element; a fixed overhead covers launch and sampling. Calibrated against figures
    measured on an H100 (see README): a Llama-3-8B batch-1 decode step gives 6.5 ms and
    a 1024-token prefill 29 ms.
    """

    name = "roofline"

    def __init__(self, model: ModelSpec, hardware: HardwareSpec, block_size: int = 16):
        hardware.validate()
        self.model, self.hw = model, hardware
        m = model
        self._linear_flops_per_token = 2 * (m.num_params - 2 * m.embedding_params if not m.tie_word_embeddings
                                            else m.num_params - m.embedding_params)
        self._lm_head_flops_per_seq = 2 * m.embedding_params
        self._attn_flops_per_pair = 4 * m.num_layers * m.num_heads * m.head_dim
        self._weight_bytes = m.weight_bytes - m.embedding_params * m.dtype_bytes  # embedding rows are gathered, not read
        self._kv_bytes_per_token = m.kv_bytes_per_token
        self._peak = hardware.matmul_flops * hardware.compute_efficiency
        self._peak_attn = hardware.matmul_flops * hardware.attention_efficiency
        self._bw = hardware.mem_bandwidth * hardware.memory_efficiency
        self._overhead = hardware.step_overhead_s
        self._swap_bytes_per_block = block_size * m.kv_bytes_per_token / hardware.host_link_bandwidth

    def step_time(self, s: BatchShape) -> float:
        tokens = s.num_prefill_tokens + s.num_decode_seqs
        if tokens == 0:
            return self._overhead + (s.swap_blocks + s.load_blocks) * self._swap_bytes_per_block
        seqs = s.num_prefill_seqs + s.num_decode_seqs
        linear_flops = self._linear_flops_per_token * tokens + self._lm_head_flops_per_seq * seqs
        t_linear = max(linear_flops / self._peak, self._weight_bytes / self._bw)
        attn_flops = self._attn_flops_per_pair * (s.prefill_attn_pairs + s.decode_kv_tokens)
        kv_bytes = self._kv_bytes_per_token * (s.prefill_kv_tokens + s.decode_kv_tokens)
        t_attn = max(attn_flops / self._peak_attn, kv_bytes / self._bw)
        return self._overhead + t_linear + t_attn + (s.swap_blocks + s.load_blocks) * self._swap_bytes_per_block
