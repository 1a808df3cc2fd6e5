"""A fast-forwarded decode run's step end times, asked of the cost model in one call, are bit for bit
those of one `step_time` call per step (the generic `testbed.core.cost.decode_run_ends`)."""
from __future__ import annotations

from copy import copy

import pytest
from hydra import compose, initialize_config_dir

from testbed.app.entry.cli import CONF_DIR
from testbed.app.assembly.run_setup import resolve_model_spec
from testbed.core.cost import BatchShape, decode_run_ends
from testbed.core.specs import HardwareSpec, ParallelSpec
from testbed.sim.kernel_cost import KernelCostModel
from testbed.sim.kernel_db import KernelDB
from testbed.sim.roofline import RooflineCostModel
from testbed.sim.spec_cost import SpecDecodeCostModel


def _cfg(*overrides):
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def _model(name):
    return resolve_model_spec(_cfg(f"model={name}").model, keep_name=True)


def _hw(name, **changes):
    return HardwareSpec(**{**_cfg(f"hardware={name}").hardware, **changes})


COSTS = {
    "llama3_8b": lambda: RooflineCostModel(_model("llama3_8b"), _hw("h100")),
    "per_seq_overhead": lambda: RooflineCostModel(_model("llama3_8b"), _hw("h100", decode_seq_overhead_s=3e-5)),
    "compute_bound_attention": lambda: RooflineCostModel(_model("llama3_8b"), _hw("h100", attention_efficiency=1e-4)),
    "tp2": lambda: RooflineCostModel(_model("llama3_1_70b"), _hw("h100"), parallel=ParallelSpec(2)),
    "pp2": lambda: RooflineCostModel(_model("llama3_1_70b"), _hw("h100"), parallel=ParallelSpec(2, 2)),
    "moe": lambda: RooflineCostModel(_model("mixtral_8x7b"), _hw("h100"), parallel=ParallelSpec(2)),
    # the measured kernels, with the overheads and host terms the default configuration fits (sync and async)
    "kernels": lambda: KernelCostModel(_model("llama3_8b"), _hw("h100"), ParallelSpec(), KernelDB("h100_sxm", "vllm"),
                                       step_overhead_s=1e-4, seq_overhead_s=2e-6, host_step_s=1e-3, host_seq_s=1e-5),
    "kernels_sync_tp2": lambda: KernelCostModel(_model("llama3_1_70b"), _hw("h100"), ParallelSpec(2),
                                                KernelDB("h100_sxm", "vllm"), kernel_scale=1.1, host_step_s=5e-4,
                                                async_scheduling=False),
}

SHAPES = [
    BatchShape(num_decode_seqs=1, decode_kv_tokens=17),
    BatchShape(num_decode_seqs=37, decode_kv_tokens=37 * 811 + 5),
    BatchShape(num_decode_seqs=256, decode_kv_tokens=256 * 3000, swap_blocks=12),
    BatchShape(num_decode_seqs=8, decode_kv_tokens=8 * 100, num_spec_tokens=24, spec_kv_tokens=8 * 3 * 101 + 8 * 6,
               num_spec_seqs=8),
]


@pytest.mark.parametrize("name", sorted(COSTS))
@pytest.mark.parametrize("cut", ["none", "arrival", "horizon"])
def test_a_runs_end_times_are_one_step_time_call_per_step(name, cut):
    cost = COSTS[name]()
    for shape in SHAPES:
        start = 1234.5678
        one = cost.step_time(shape)
        next_arrival = start + 7.5 * one if cut == "arrival" else float("inf")
        horizon = start + 11.5 * one if cut == "horizon" else float("inf")
        before = copy(shape)
        fast = cost.decode_run_ends(shape, start, 40, next_arrival, horizon)
        assert shape == before  # the run's first step is left as it was
        slow = decode_run_ends(cost.step_time, copy(shape), start, 40, next_arrival, horizon)
        assert fast == slow and len(fast) == {"none": 40, "arrival": 8, "horizon": 11}[cut]
        assert all(a < b for a, b in zip(fast, fast[1:]))
        again = cost.decode_run_ends(shape, start, 40, next_arrival, horizon)  # a memoised model: from its memo
        assert again == fast


def test_the_generic_run_leaves_the_shape_as_it_was():
    shape = BatchShape(num_decode_seqs=3, decode_kv_tokens=300)
    ends = decode_run_ends(COSTS["llama3_8b"]().step_time, shape, 0.0, 5, float("inf"), float("inf"))
    assert len(ends) == 5 and shape.decode_kv_tokens == 300


def test_speculative_decodings_wrapper_prices_its_drafting_in_a_run():
    target = COSTS["llama3_8b"]()
    spec = SpecDecodeCostModel(target, 3, host_s=0.002)
    shape = SHAPES[3]
    ends = spec.decode_run_ends(shape, 0.0, 4, float("inf"), float("inf"))
    assert ends == decode_run_ends(spec.step_time, copy(shape), 0.0, 4, float("inf"), float("inf"))
    assert ends != target.decode_run_ends(shape, 0.0, 4, float("inf"), float("inf"))  # not the target's alone
