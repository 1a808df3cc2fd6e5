"""Shared helpers: tiny traces and loops built by hand, so tests state their inputs."""
from __future__ import annotations

import pytest
from hypothesis import settings

# Hypothesis fails an example that runs past a wall-clock deadline (200 ms unless a test says otherwise): on a
# busy machine that measures the neighbours, not the code, so no property test here has one
settings.register_profile("testbed", deadline=None)
settings.load_profile("testbed")

from testbed.core.cost import BatchShape
from testbed.core.kv import BlockManager
from testbed.core.loop import SchedulerLimits, StepLoop
from testbed.core.request import Request


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
