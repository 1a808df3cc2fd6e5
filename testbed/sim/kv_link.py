"""The link a prefill replica sends a prompt's KV cache over to a decode replica.

A transfer takes latency + bytes / (bandwidth x efficiency). Each GPU of the prefill replica sends
its own shard (its KV heads, its layers) to its peer on the decode side, all pairs at once, as
vLLM's NIXL connector reads every remote block shard by shard (vllm/distributed/kv_transfer/
kv_connector/v1/nixl/tp_mapping.py maps prefill TP ranks to decode TP ranks), so the time is that of
one GPU pair: the bytes per token of the side whose GPUs hold the larger share (`ModelSpec.
kv_bytes_per_token_per_gpu`). The whole prompt is sent (decode-side prefix hits are not subtracted).

Presets, per GPU and one direction (nominal; `efficiency` scales them, 0.8 by default: large RDMA
and NVLink copies reach 80-90% of line rate, an assumption, not a measurement):
- nvlink: NVLink 4 on an H100 SXM, 18 links x 25 GB/s = 450 GB/s each way (NVIDIA H100 datasheet:
  900 GB/s bidirectional); 10 us a transfer (aiconfigurator-core systems/h100_sxm.yaml p2p_latency,
  as testbed/conf/hardware/h100.yaml). Prefill and decode GPUs in one NVLink domain (one node).
- infiniband: one ConnectX-7 NDR port per GPU (DGX H100: 8 x 400 Gb/s for the compute fabric),
  400 Gb/s = 50 GB/s; 5 us (assumed: an RDMA read plus its completion notice).
- roce: 400 GbE RoCEv2 on the same NICs, 50 GB/s; 20 us (assumed: Ethernet switching and
  congestion control add latency over InfiniBand).
"""
from __future__ import annotations

from dataclasses import dataclass

from testbed.core.specs import ModelSpec, ParallelSpec

# name -> (bandwidth per GPU one way in bytes/s, latency per transfer in s)
LINK_PRESETS: dict[str, tuple[float, float]] = {
    "nvlink": (450e9, 10e-6),
    "infiniband": (50e9, 5e-6),
    "roce": (50e9, 20e-6),
}


@dataclass(frozen=True)
class KVLink:
    name: str
    bandwidth: float  # bytes/s per GPU pair, nominal
    latency_s: float
    efficiency: float
    serialize: bool  # transfers into one decode replica run one at a time

    @classmethod
    def from_config(cls, node) -> "KVLink":
        """From the `disagg.link` node: its preset, with `bandwidth_GBps` / `latency_us` overriding it."""
        if node.name not in LINK_PRESETS:
            raise ValueError(f"disagg.link.name={node.name!r}: expected one of {', '.join(LINK_PRESETS)} "
                             "(or set disagg.link.bandwidth_GBps and latency_us to override a preset)")
        bandwidth, latency = LINK_PRESETS[node.name]
        if node.bandwidth_GBps is not None:
            bandwidth = node.bandwidth_GBps * 1e9
        if node.latency_us is not None:
            latency = node.latency_us * 1e-6
        return cls(node.name, bandwidth, latency, node.efficiency, node.serialize)

    def transfer_s(self, prompt_tokens: int, bytes_per_token_per_gpu: int) -> float:
        return self.latency_s + prompt_tokens * bytes_per_token_per_gpu / (self.bandwidth * self.efficiency)


def transfer_bytes_per_token(model: ModelSpec, prefill: ParallelSpec, decode: ParallelSpec) -> int:
    """KV bytes per prompt token one GPU pair carries: the larger per-GPU share of the two pools."""
    return max(model.kv_bytes_per_token_per_gpu(prefill), model.kv_bytes_per_token_per_gpu(decode))
