"""Learning-to-rank scheduling: serve requests in predicted-length rank order, with
starvation prevention.

Source: Fu et al., "Efficient LLM Scheduling by Learning to Rank", NeurIPS 2024
(vllm-ltr, `vllm/core/scheduler.py`: `_get_opt_ordered_requests` and the idle/priority
bookkeeping at the end of `_general_schedule`). The paper's ranker scores the prompt
with a small fine-tuned OPT model trained with ListMLE; here the rank score is a
predicted output length from `policies/_predictors.py` (shorter = higher rank; oracle by
default, an upper bound; a ranker only needs the order, which `bucket` and
`noisy_oracle` degrade in controlled ways). The score is of the prompt, so it is fixed
for a request's lifetime: unlike srpt it does not shrink as tokens are generated.

Rule, per step:
1. Starvation prevention (the paper's, as in vllm-ltr): each request counts the steps in
   a row it was not scheduled. At the start of a step, a request whose count has reached
   `starvation_threshold` is promoted for `priority_quantum` scheduled steps (its count
   restarts); a promoted request whose quantum is used up is demoted. Promoted requests
   rank ahead of all others.
2. Re-rank every request by (promoted first, predicted length, arrival, id).
3. `preemptive=false` (default), vLLM's admission in rank order: running requests first,
   in rank order, each its prefill chunk or one decode token; if its KV does not fit,
   the worst-ranked running request is preempted (recompute), finally itself; then, only
   if nothing was preempted, waiting requests in rank order until the first that does
   not fit. `preemptive=true`, vllm-ltr's own loop: running and waiting requests in one
   ranked list, filled in order (a displaced running request keeps its KV), KV made by
   preempting the worst-ranked running requests (vllm-ltr swaps them out; here recompute).
4. After the step: a scheduled request's count restarts and, if promoted, its quantum
   drops by one if the step samples a token for it (the quantum is read off the tokens
   generated since promotion); every other request's count grows by one.

Choices: the paper gives no values for the threshold and quantum; the defaults (256
and 64 steps) are ours. The quantum counts steps that sample a token for the request, so
it is read off the tokens generated since promotion: vllm-ltr swaps preempted requests
out, so each of their scheduled steps is progress, whereas here preemption is by
recompute, and a quantum spent recomputing KV (chunked prefill steps) could run out
before the request produced anything, letting promoted requests evict one another
forever (a livelock the property test found with a small threshold and quantum in
preemptive mode). Reading it off the tokens also keeps it exact when the simulator
merges steady decode steps. Unscheduled counts are in planned steps that schedule
something. To stay O(batch) per step with thousands waiting, a count is kept as the step
of last service, and due promotions come off a FIFO of (step, request) service records;
waiting requests sit in a heap re-filed only when their promotion changes. Under heavy
KV pressure (mooncake) the quantum's rotation is costly with recompute: a request
demoted mid-decode is the worst-ranked running one and the first preempted.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from operator import attrgetter

from testbed.policies._predictors import PredictorKnobs
from testbed.policies.srpt import WaitingQueue, _first, fill_ranked
from testbed.core.bounds import bounded
from testbed.core.plan import Plan
from testbed.core.policy import BasePolicy, register
from testbed.core.request import Status

_WAITING, _SWAPPED, _FINISHED = Status.WAITING, Status.SWAPPED, Status.FINISHED


@dataclass
class LTRKnobs(PredictorKnobs):
    name: str = "ltr"
    starvation_threshold: int = bounded(256, ge=0)  # steps in a row unscheduled before promotion; 0 = never promote
    priority_quantum: int = bounded(64, ge=1)  # tokens (token-sampling steps) a promoted request keeps its priority
    preemptive: bool = False  # true: one ranked list over running and waiting (vllm-ltr's loop)


@register
class LTRPolicy(BasePolicy):
    name = "ltr"
    Knobs = LTRKnobs

    def __init__(self, knobs=None):
        super().__init__(knobs)
        k = self.knobs
        self.predictor = k.make()
        self.score: dict[int, float] = {}  # request id -> predicted length (the rank score)
        self.queue = WaitingQueue()
        self.step = 0  # steps planned so far (that scheduled something)
        # request id -> the last step it was served (or arrived before), for requests not in the
        # last plan (one in it was served at the last step, whatever this says)
        self.last: dict[int, int] = {}
        self.served: deque = deque()  # (step, state) records of `last`, in step order
        self._promoted: dict[int, tuple] = {}  # promoted request id -> (state, tokens generated at promotion)
        self._last_set: set = set()  # the requests of the last plan that scheduled something
        self._requeue: list = []

    def key(self, s):
        rid = s.req.id
        score = self.score.get(rid)
        if score is None:
            score = self.score[rid] = self.predictor.predict(s.req)
        return (0 if rid in self._promoted else 1, score, s.req.arrival, rid)

    def on_arrival(self, s, view) -> None:
        rid = s.req.id
        self.last[rid] = self.step - 1  # unscheduled from the next step on
        self.served.append((self.step - 1, s))
        self.queue.push(self.key(s), s)

    def on_finish(self, s, view) -> None:
        rid = s.req.id
        self.score.pop(rid, None)
        self.last.pop(rid, None)
        self._promoted.pop(rid, None)

    def is_steady(self, view) -> bool:
        """Nobody waiting and every running request in the batch: each step serves everyone
        (counts stay 0; quanta are read off tokens generated, so merged steps spend them
        exactly), and promotions only reorder a batch that holds everyone."""
        return not view.waiting

    def _refile(self, s) -> None:
        if s.status is _WAITING or s.status is _SWAPPED:
            self.queue.push(self.key(s), s)

    def _starvation(self) -> None:
        """Step 1: demote spent quanta, promote requests unserved for the threshold."""
        k = self.knobs
        q, promoted = k.priority_quantum, self._promoted
        if promoted:  # only requests in the last batch can have spent quantum since
            last_set = self._last_set
            for rid, (s, generated) in list(promoted.items()):
                if s.num_generated - generated >= q and s in last_set:
                    del promoted[rid]
                    self._refile(s)
        if not k.starvation_threshold:
            return
        due = self.step - 1 - k.starvation_threshold  # served at or before this: count >= threshold
        served, last, last_set = self.served, self.last, self._last_set
        while served and served[0][0] <= due:
            st, s = served.popleft()
            rid = s.req.id
            if last.get(rid) != st or s in last_set or s.status is _FINISHED:
                continue  # served again since, or gone
            self._promoted[rid] = (s, s.num_generated)  # the quantum restarts too
            last[rid] = self.step - 1  # the count restarts
            served.append((self.step - 1, s))
            self._refile(s)

    def schedule(self, view) -> Plan:
        for v in self._requeue:
            self._refile(v)
        self._requeue = []
        self._starvation()
        running = sorted(((self.key(s), s) for s in view.running), key=_first)
        plan, victims = fill_ranked(view, running, self.queue, preemptive=self.knobs.preemptive)
        self._requeue = victims
        if plan.items:
            # Bookkeeping per request that leaves the batch, not per request per step: one served
            # at the last step and not now was last served then (by id, for a fixed record order).
            current = set(map(_first, plan.items))
            step = self.step
            left = self._last_set - current
            if left:
                last, served = self.last, self.served
                for s in sorted(left, key=_id):
                    if s.status is _FINISHED:
                        continue
                    last[s.req.id] = step - 1
                    served.append((step - 1, s))
            self._last_set = current
            self.step = step + 1
        return plan


_id = attrgetter("req.id")
