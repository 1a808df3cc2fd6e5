"""cost_model=kernels' step times on a few familiar shapes, and what one step_time call costs.

Prints the kernel sum (the overhead keys at 0) for Llama-2-7B and Llama-3-8B on h100_sxm / vllm next
to the roofline's, and the time per step_time call of both models over 100k realistic batch shapes.
Needs aiconfigurator-core (pip install 'llm-sched-testbed[kernels]').

    python experiments/benchmarks/kernel_check.py
"""
from __future__ import annotations

import time

import numpy as np

from testbed.core.cost import BatchShape, add_work
from testbed.core.specs import HardwareSpec, ModelSpec, ParallelSpec
from testbed.sim.kernel_cost import KernelCostModel
from testbed.sim.kernel_db import KernelDB
from testbed.sim.roofline import RooflineCostModel

LLAMA2_7B = ModelSpec(name="llama2-7b", hidden_size=4096, intermediate_size=11008, num_layers=32, num_heads=32,
                      num_kv_heads=32, head_dim=128, vocab_size=32000)
LLAMA3_8B = ModelSpec()  # the default spec: Llama-3-8B


def shape(work) -> BatchShape:
    s = BatchShape()
    add_work(s, work)
    return s


CASES = {
    "llama2-7b": [("decode, batch 1, context 600", [(599, 1, True)]),
                  ("decode, batch 10, context 700", [(699, 1, True)] * 10),
                  ("decode, batch 64, context 800", [(799, 1, True)] * 64),
                  ("prefill, 2048 tokens", [(0, 2048, False)])],
    "llama3-8b": [("decode, batch 1, context 1024", [(1023, 1, True)]),
                  ("decode, batch 128, context 512", [(511, 1, True)] * 128),
                  ("decode, batch 128, context 1024", [(1023, 1, True)] * 128),
                  ("prefill, 1024 tokens", [(0, 1024, False)])],
}


def main() -> None:
    hw = HardwareSpec(kernel_db_gpu="h100_sxm")
    db = KernelDB("h100_sxm", "vllm")
    models = {}
    for spec in (LLAMA2_7B, LLAMA3_8B):
        kern, roof = KernelCostModel(spec, hw, ParallelSpec(), db), RooflineCostModel(spec, hw)
        models[spec.name] = (kern, roof)
        print(f"{spec.name} on h100_sxm (vllm tables {db.versions})")
        for label, work in CASES[spec.name]:
            s = shape(work)
            print(f"  {label:34s} kernels {kern.step_time(s) * 1e3:7.2f} ms   roofline {roof.step_time(s) * 1e3:7.2f} ms")
    rng = np.random.default_rng(0)
    shapes = []
    for _ in range(2000):
        b = int(rng.integers(1, 128))
        work = [(int(rng.integers(50, 3000)), 1, True) for _ in range(b)]
        if rng.random() < 0.3:
            work.append((int(rng.integers(0, 2000)), int(rng.integers(16, 2048 - b)), False))
        shapes.append(shape(work))
    shapes *= 50
    kern, roof = models["llama2-7b"]
    per_call = {}
    for m in (kern, roof):
        t0 = time.perf_counter()
        for s in shapes:
            m.step_time(s)
        per_call[m.name] = (time.perf_counter() - t0) / len(shapes)
    print(f"step_time over {len(shapes)} shapes: kernels {per_call['kernels'] * 1e6:.2f} us/call, roofline "
          f"{per_call['roofline'] * 1e6:.2f} us/call, ratio {per_call['kernels'] / per_call['roofline']:.2f}")


if __name__ == "__main__":
    main()
