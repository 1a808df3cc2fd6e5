"""How long one engine step takes, the only thing the simulator asks of the hardware.

A step's cost is decided by a few features of its batch, not by which requests are in
it; `BatchShape` carries exactly those features, summed by the step loop in one pass.
Cost models are interchangeable behind `CostModel.step_time`: the analytic roofline
(`testbed.sim.roofline`) needs only a model config and a hardware spec; a model fitted
to a profile of the real engine (`testbed.sim.fitted_cost`) plugs into the same interface.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol



@dataclass(slots=True)
class BatchShape:
    num_prefill_tokens: int = 0
    num_prefill_seqs: int = 0
    prefill_attn_pairs: float = 0.0  # query-key pairs of all prefill chunks: sum c * (offset + (c + 1) / 2)
    prefill_kv_tokens: int = 0  # KV tokens the prefill chunks attend over: sum (offset + c)
    num_decode_seqs: int = 0
    decode_kv_tokens: int = 0  # KV tokens read by decode sequences: sum of their context lengths
    swap_blocks: int = 0  # KV blocks moved between host and device before this step

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_seqs

    @property
    def num_seqs(self) -> int:
        return self.num_prefill_seqs + self.num_decode_seqs


class CostModel(Protocol):
    name: str

    def step_time(self, shape: BatchShape) -> float:
        """Seconds for one engine iteration over a batch of this shape."""
