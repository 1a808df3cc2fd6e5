"""A user's patched vLLM scheduler, named by `policy.scheduler_cls` in tests/test_vllm_native.py.

Imported only by vLLM (its `resolve_obj_by_qualname`), in the venv that has it.
"""
from vllm.v1.core.sched.scheduler import Scheduler


class SmallBudgetScheduler(Scheduler):
    """vLLM's scheduler with its per-step token budget patched to 64 tokens."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.max_num_scheduled_tokens = 64


class BrokenScheduler(Scheduler):
    """A patch with a bug: its schedule() fails at once."""

    def schedule(self, *args, **kwargs):
        raise KeyError("oops")
