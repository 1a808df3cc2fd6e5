"""The roofline cost model's step times for the shapes measured on an H100 (README table).

Usage: python experiments/benchmarks/roofline_check.py
"""
from __future__ import annotations

from testbed.core.cost import BatchShape
from testbed.sim.roofline import RooflineCostModel
from testbed.core.specs import HardwareSpec, ModelSpec

MEASURED = {  # Llama-3-8B, bf16, H100, plain torch with CUDA graphs (issue 4's table)
    "decode, batch 1, context 1024": ("6.5-6.7 ms", BatchShape(num_decode_seqs=1, decode_kv_tokens=1024)),
    "decode, batch 128, context 512": ("10.1 ms", BatchShape(num_decode_seqs=128, decode_kv_tokens=128 * 512)),
    "decode, batch 128, context 1024": ("14.3 ms", BatchShape(num_decode_seqs=128, decode_kv_tokens=128 * 1024)),
    "prefill, 1024 tokens": ("29 ms", BatchShape(num_prefill_tokens=1024, num_prefill_seqs=1,
                                                 prefill_attn_pairs=1024 * 1025 / 2, prefill_kv_tokens=1024)),
}


def main() -> None:
    model = RooflineCostModel(ModelSpec(), HardwareSpec())
    print(f"{'Llama-3-8B, bf16, H100':<34} {'measured':>12} {'roofline':>10}")
    for name, (measured, shape) in MEASURED.items():
        print(f"{name:<34} {measured:>12} {model.step_time(shape) * 1e3:>7.1f} ms")


if __name__ == "__main__":
    main()
