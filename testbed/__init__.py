"""A scheduler research testbed for LLM serving: one step loop, a simulator and an engine.

The names a policy author writes are re-exported here from the core (`testbed.core`), the
contract every backend shares; importing this package loads nothing else:

    from testbed import BasePolicy, Plan, PolicyKnobs, bounded, register

The Python API (`testbed.api`: `simulate`, `sweep`, `load`, `Results`, `ConfigError`) is here too,
imported on first use, so that a policy author's import does not load Hydra, pandas or the simulator:

    import testbed
    res = testbed.simulate(["policy=sarathi", "trace.max_requests=300"])
"""
from testbed.core.bounds import bounded
from testbed.core.cost import BatchShape, CostModel
from testbed.core.plan import PREEMPT_MODES, RECOMPUTE, SWAP, Plan, PlanError
from testbed.core.policy import BasePolicy, Policy, PolicyKnobs, register
from testbed.core.request import Outcome, Request, RequestState, Status
from testbed.core.view import SchedulerView

_API = ("simulate", "sweep", "load", "Results", "ConfigError")


def __getattr__(name: str):
    """The API's names, from testbed.api on first use (PEP 562)."""
    if name in _API:
        from testbed import api

        return getattr(api, name)
    raise AttributeError(f"module 'testbed' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_API))


__all__ = [*_API, "BatchShape", "CostModel", "PREEMPT_MODES", "RECOMPUTE", "SWAP", "Plan", "PlanError", "BasePolicy",
           "Policy", "PolicyKnobs", "bounded", "register", "Outcome", "Request", "RequestState", "Status", "SchedulerView"]
