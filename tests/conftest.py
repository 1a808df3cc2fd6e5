"""Shared helpers: tiny traces and loops built by hand, so tests state their inputs."""
from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import settings

from testbed.core.cost import BatchShape
from testbed.core.kv import BlockManager
from testbed.core.loop import SchedulerLimits, StepLoop
from testbed.core.request import Request

# Hypothesis fails an example that runs past a wall-clock deadline (200 ms unless a test says otherwise): on a
# busy machine that measures the neighbours, not the code, so no property test here has one
settings.register_profile("testbed", deadline=None)
settings.load_profile("testbed")


class FixedCost:
    """A cost model whose step times are easy to compute by hand: a + b per token."""

    name = "fixed"

    def __init__(self, base: float = 0.01, per_token: float = 0.0):
        self.base, self.per_token = base, per_token

    def step_time(self, shape: BatchShape) -> float:
        return self.base + self.per_token * shape.num_tokens


def make_requests(specs, block_tokens: int = 512) -> list[Request]:
    """specs: (arrival, prompt_len, output_len[, prefix_hashes]) tuples, in arrival order."""
    out = []
    for i, spec in enumerate(specs):
        arrival, p, o, *rest = spec
        out.append(Request(id=i, arrival=float(arrival), prompt_len=p, output_len=o,
                           prefix_hashes=tuple(rest[0]) if rest else (), prefix_block_tokens=block_tokens,
                           source=f"test:{i + 2}"))
    return out


def make_loop(policy, num_blocks=64, block_size=4, budget=64, max_seqs=8, max_len=10_000, host_blocks=0,
              prefix=True, cost=None, cache_decode_tokens="scheduled") -> StepLoop:
    kv = BlockManager(num_blocks, block_size, prefix, host_blocks, cache_decode_tokens)
    return StepLoop(policy, kv, SchedulerLimits(budget, max_seqs, max_len), cost or FixedCost())


@pytest.fixture
def fixed_cost():
    return FixedCost()


@pytest.fixture
def one_torch_thread():
    """Engine tests run torch on one thread: two threads on a loaded 2-core machine spin
    against each other and make a tiny model's step 100x slower."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


# `pytest -m quick`: a subset that runs in about a minute and touches every layer, for a change's first check
# (the whole suite is CI's). Whole modules, or module::test for one test of a module (every parametrisation).
QUICK = (
    "test_layers.py", "test_kv_blocks.py", "test_plan_validation.py", "test_engine_replay.py",  # the core's contract
    "test_policies_batch1.py", "test_policy_properties.py",  # policies
    "test_metrics_sim.py",  # the simulator and its metrics by hand
    # cost models: a profile's fit, the roofline, the kernel tables (a simulation on them)
    "test_fitted_cost_terms.py::test_the_terms_are_recovered_from_a_profile_that_exercises_them",
    "test_presets.py::test_kv_read_efficiency_and_per_sequence_overhead",
    "test_kernel_cost.py::test_measured_point_is_returned_and_off_grid_lies_between",
    "test_kernel_cost.py::test_overheads_and_pipeline_add_up", "test_kernel_cost.py::test_simulation_with_kernels_finishes",
    "test_traces.py",  # traces
    "test_results_building.py",  # metrics and result files
    "test_cli.py::test_console_script_from_another_directory",  # the app: testbed-sim end to end
)
_TESTS = Path(__file__).parent


def pytest_configure(config):
    for entry in QUICK:  # a renamed module or test would drop out of the subset unseen
        module, _, test = entry.partition("::")
        path = _TESTS / module
        if not path.exists() or (test and f"def {test}(" not in path.read_text()):
            raise pytest.UsageError(f"tests/conftest.py QUICK names {entry!r}, which is not in tests/")


def pytest_ignore_collect(collection_path, config):
    """With `-m quick` alone, the modules with no quick test are not even imported (a third of the subset's time)."""
    if config.getoption("markexpr", "") == "quick" and collection_path.suffix == ".py" and \
            collection_path.name.startswith("test_"):
        return collection_path.name not in {e.partition("::")[0] for e in QUICK} or None
    return None


def pytest_collection_modifyitems(config, items):
    for item in items:
        name = item.path.name
        if name in QUICK or f"{name}::{getattr(item, 'originalname', item.name)}" in QUICK:
            item.add_marker(pytest.mark.quick)
