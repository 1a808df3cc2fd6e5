"""A scheduler research testbed for LLM serving: one step loop, a simulator and an engine.

The names a policy author writes are re-exported here from the core (`testbed.core`), the
contract every backend shares; importing this package loads nothing else:

    from testbed import BasePolicy, Plan, PolicyKnobs, bounded, register
"""
from testbed.core.bounds import bounded
from testbed.core.cost import BatchShape, CostModel
from testbed.core.plan import PREEMPT_MODES, RECOMPUTE, SWAP, Plan, PlanError
from testbed.core.policy import BasePolicy, Policy, PolicyKnobs, register
from testbed.core.request import Outcome, Request, RequestState, Status
from testbed.core.view import SchedulerView

__all__ = ["BatchShape", "CostModel", "PREEMPT_MODES", "RECOMPUTE", "SWAP", "Plan", "PlanError", "BasePolicy",
           "Policy", "PolicyKnobs", "bounded", "register", "Outcome", "Request", "RequestState", "Status", "SchedulerView"]
