"""Static batching, the baseline continuous batching was invented to beat.

Source: the request-level batching of FasterTransformer-era servers and of
`transformers`' `generate` on a padded batch, as described in Orca (Yu et al., OSDI'22).
Rule: when no batch is in flight, take waiting requests FCFS while the sequence cap
allows and the KV cache can hold each one's full prompt plus output (reserved up front,
so a batch never preempts). Run that batch until every member has finished: prefill the
prompts under the token budget (chunked when a prompt exceeds it), then decode all members
together. Nothing joins a batch in flight; finished members leave their slots idle.
"""
from __future__ import annotations

from dataclasses import dataclass

from testbed.core.bounds import bounded
from testbed.core.plan import Plan
from testbed.core.policy import BasePolicy, PolicyKnobs, register
from testbed.core.request import Status


@dataclass
class StaticKnobs(PolicyKnobs):
    name: str = "static"
    max_batch_size: int = bounded(0, ge=0)  # 0 = scheduler.max_num_seqs


@register
class StaticPolicy(BasePolicy):
    name = "static"
    Knobs = StaticKnobs

    def __init__(self, knobs=None):
        super().__init__(knobs)
        self.batch: list = []

    def is_steady(self, view) -> bool:
        """Nothing joins a batch in flight: once all members decode, the plan repeats until one finishes."""
        return True

    def schedule(self, view) -> Plan:
        self.batch = [s for s in self.batch if s.status is not Status.FINISHED]
        if not self.batch:
            self._form_batch(view)
        plan = Plan()
        budget = view.token_budget
        for s in self.batch:
            if budget <= 0:
                break
            n = min(view.num_new_tokens(s), budget)
            plan.schedule(s, n)
            budget -= n
        return plan

    def _form_batch(self, view) -> None:
        limit = min(self.knobs.max_batch_size or view.max_num_seqs, view.max_num_seqs)
        free = view.free_blocks
        for s in view.waiting:
            if len(self.batch) >= limit:
                break
            reserve = view.blocks_needed(s, s.req.prompt_len + s.req.output_len - view.prefix_hit_tokens(s))
            if reserve > free:
                break
            self.batch.append(s)
            free -= reserve
