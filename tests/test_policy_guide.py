"""The policy in policies/README.md is real code: it registers, runs, and finishes a trace."""
from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import pytest

from conftest import FixedCost, make_loop, make_requests
from testbed.policies import make_policy, registered
from testbed.sim.simulation import Simulation

README = Path(__file__).resolve().parent.parent / "testbed" / "policies" / "README.md"


def test_readme_policy_runs():
    code = re.search(r"```python\n(.*?)```", README.read_text(), re.S).group(1)
    module = types.ModuleType("readme_policy")
    sys.modules["readme_policy"] = module  # dataclasses look their module up
    exec(compile(code, str(README), "exec"), module.__dict__)
    try:
        assert "shortest_prompt" in registered()
        reqs = make_requests([(0, 50, 3), (0.001, 5, 3), (0.002, 20, 3)])
        cost = FixedCost(0.01)
        out = Simulation(reqs, lambda: make_loop(make_policy("shortest_prompt", max_batch=1), cost=cost), cost).run()
        done = sorted(out.loops[0].states, key=lambda s: s.finish_time)
        assert [s.req.id for s in done] == [0, 1, 2]  # 0 runs alone first (max_batch=1), then shortest first
        assert all(s.status.value == "finished" for s in done)
        with pytest.raises(ValueError, match=r"policy.max_batch=0: must be >= 1"):  # its knob's declared range
            make_policy("shortest_prompt", max_batch=0)
    finally:
        import testbed.core.policy as P
        P._POLICIES._table.pop("shortest_prompt", None)
        sys.modules.pop("readme_policy", None)
