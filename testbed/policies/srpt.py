"""Shortest remaining predicted processing time first (SRPT), preemptive, with aging.

Source: SRPT (Schrage, Operations Research 1968), in its LLM-serving form: rank requests
by predicted remaining output, as the "srtf" ordering of vllm-ltr (Fu et al., NeurIPS
2024, `vllm/core/scheduler.py`) and FastServe's preemptive skip-join scheduling (Wu et
al., 2023) do; output lengths come from `policies/_predictors.py` (oracle by default: an
upper bound).

Rule, per step:
1. Rank every request, running and waiting, by predicted remaining output
   `max(prediction - generated, 1)` (ties by arrival, then id). Aging: a request older
   than `starvation_s` (now - arrival; for a request never started, exactly its wait)
   ranks ahead of every other, FCFS among such requests; 0 disables it.
2. Fill the batch in rank order under the token budget and the sequence cap: a running
   request takes the rest of its prefill chunk or one decode token, a waiting one a
   prefill chunk of what the budget leaves. A running request that does not make the
   batch is displaced: it keeps its KV and simply waits a step.
3. KV: when the next request in rank order needs more blocks than are free, the
   worst-ranked running requests not in the batch are preempted by recompute, worst
   first, but only if preempting all of them would make room (no preemption in vain).
   If no room can be made, a waiting request stops admission for the step (strict rank
   order); a running one is skipped and keeps its KV. Should nothing at all fit, the
   worst-ranked running request is preempted (the loop then plans again), so the policy
   always makes progress.

Choices: ranks use the remaining *output* only (prefill work is not counted; the prompt
is known, so a variant could add it). Displaced requests may leave more requests holding
KV than `max_num_seqs`, which caps the batch, not the set of requests with KV. Per step
the work is O(running log running) plus O(admitted) heap operations: waiting requests sit
in a heap keyed at arrival (their rank cannot change while they wait) and aged ones are
read from the head of the arrival-ordered waiting queue, so the waiting queue is never
sorted.

This module also holds the ranked-fill machinery the other ranking policies share
(`WaitingQueue`, `AgedFirst`, `fill_ranked`).
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from operator import itemgetter

from testbed.policies._predictors import PredictorKnobs
from testbed.core.bounds import bounded
from testbed.core.plan import RECOMPUTE, Plan
from testbed.core.policy import BasePolicy, register
from testbed.core.request import Status

_WAITING, _SWAPPED = Status.WAITING, Status.SWAPPED


class WaitingQueue:
    """Waiting requests in key order: a heap with lazy deletion.

    `push(key, s)` files `s` (replacing any earlier filing of it); `peek()` is the best
    `(key, s)` still waiting, dropping entries of requests admitted, finished or re-filed
    since; `consume()` removes that entry. Keys must be unique per request (end them with
    the request id) so that states are never compared. O(log n) per operation.
    """

    __slots__ = ("_heap", "_seq", "_live")

    def __init__(self):
        self._heap: list = []
        self._seq = 0
        self._live: dict[int, int] = {}  # request id -> seq of its valid entry

    def push(self, key, s) -> None:
        self._seq += 1
        self._live[s.req.id] = self._seq
        heapq.heappush(self._heap, (key, self._seq, s))

    def peek(self):
        heap, live = self._heap, self._live
        while heap:
            key, seq, s = heap[0]
            if live.get(s.req.id) == seq and (s.status is _WAITING or s.status is _SWAPPED):
                return key, s
            heapq.heappop(heap)
            if live.get(s.req.id) == seq:
                del live[s.req.id]
        return None

    def consume(self) -> None:
        _, seq, s = heapq.heappop(self._heap)
        if self._live.get(s.req.id) == seq:
            del self._live[s.req.id]

    def __len__(self) -> int:
        return len(self._live)


class AgedFirst:
    """A waiting source: requests that arrived before `cutoff` first, FCFS (read from the
    loop's arrival-ordered waiting list, keyed `(0, arrival, id)`), then `queue` in its
    order (keys must start with 1). Queue entries of aged requests are dropped for good:
    age only grows, so they are served from the list from now on."""

    __slots__ = ("w", "i", "cutoff", "q")

    def __init__(self, waiting: list, cutoff: float, queue: WaitingQueue):
        self.w, self.i, self.cutoff, self.q = waiting, 0, cutoff, queue

    def _aged(self):
        w, i = self.w, self.i
        if i < len(w) and w[i].req.arrival < self.cutoff:
            return w[i]
        return None

    def peek(self):
        s = self._aged()
        if s is not None:
            return (0, s.req.arrival, s.req.id), s
        q = self.q
        while True:
            top = q.peek()
            if top is None or top[1].req.arrival >= self.cutoff:
                return top
            q.consume()

    def consume(self) -> None:
        if self._aged() is not None:
            self.i += 1
        else:
            self.q.consume()


def _count_victims(view, running, lo: int, end: int, short: int):
    """How many of running[lo:end], taken from the end, free `short` blocks; None if all cannot."""
    got = 0
    for j in range(end - 1, lo - 1, -1):
        got += view.reclaimable_blocks(running[j][1])
        if got >= short:
            return end - j
    return None


def fill_ranked(view, running: list, source, preemptive: bool, resuming=None, may_evict=None):
    """Fill one step's batch in rank order; returns (plan, preempted requests).

    `running`: (key, state) pairs of the running requests, best first. `source`: the
    waiting requests, best first, through `peek() -> (key, state) | None` and `consume()`.
    `preemptive=True`: running and waiting requests are merged by key (a displaced running
    request keeps its KV); KV for the next request is made by preempting (recompute) the
    worst-ranked running requests not in the batch, only when that suffices. A waiting
    request that cannot get its KV ends admission for the step. `resuming(state)`, when
    given, marks waiting requests that must return gently: nothing is preempted for them,
    and they are admitted only once KV for their whole prefill (or recompute) is free, so
    that a resumed request cannot take a chunk's worth of KV and then, as it grows,
    preempt the request it is competing with (a ping-pong when ranks move, as deadlines do).
    `may_evict(state)`, when given, says which requests may have running requests
    preempted for them at all (default: all; preemptive mode only).
    `preemptive=False`: vLLM's rule in this order: every running request first, preempting
    from the worst end (finally itself) when its KV does not fit; then, only if nothing
    was preempted, waiting requests in order until the first that does not fit.

    KV accounting when one plan both preempts and admits: a preempted request's cached
    prefix blocks are counted as freed, yet a request admitted in the same plan may hit
    those very blocks (and take them off the free pool again), so `blocks_needed`'s exact
    count of a prefix hit can be short. Once the plan preempts, every admitted waiting
    request is therefore charged the no-hit bound ceil((hit + n) / block_size), including,
    retroactively, those admitted before the first preemption (`slack`).
    """
    plan = Plan()
    items = plan.items
    budget, free, limit = view.token_budget, view.free_blocks, view.max_num_seqs
    bs = view.block_size
    seqs = 0
    ri, end = 0, len(running)  # running[end:] are preempted
    victims: list = []
    admit = True
    preempting = False  # the plan preempts: waiting admissions are charged the no-hit bound
    slack = 0  # what that bound adds to the admissions made before the first preemption
    top = source.peek()
    while budget > 0 and seqs < limit:
        if ri < end and (not preemptive or not admit or top is None or running[ri][0] <= top[0]):
            s = running[ri][1]
            ri += 1
            # once per running request per step: `remaining` and view.blocks_needed of a running
            # request (kv.blocks_needed's arithmetic) inlined, as in _passes.run_running
            n = s.req.prompt_len + s.num_generated - s.num_computed
            if n > budget:
                n = budget
            need = -(-(s.num_computed + n) // bs) - len(s.blocks)
            if need < 0:
                need = 0
            if need > free:
                if preemptive:
                    k = None
                    if may_evict is None or may_evict(s):
                        k = _count_victims(view, running, ri, end, need - free + (0 if preempting else slack))
                    if k is None:
                        continue  # displaced: it keeps its KV and waits
                else:
                    k = end - ri
                if not preempting:
                    free -= slack
                    preempting = True
                for _ in range(k):
                    if need <= free:
                        break
                    end -= 1
                    v = running[end][1]
                    plan.preempt_request(v, RECOMPUTE)
                    victims.append(v)
                    free += view.reclaimable_blocks(v)
                if need > free:  # vLLM: nothing left to preempt but the request itself
                    plan.preempt_request(s, RECOMPUTE)
                    victims.append(s)
                    break
            items.append((s, n))  # plan.schedule(s, n)
            budget -= n
            free -= need
            seqs += 1
        elif admit and top is not None and (preemptive or not victims):
            s = top[1]
            n = min(view.num_new_tokens(s), budget)
            need = view.blocks_needed(s, n)
            hit = view.prefix_hit_tokens(s)
            bound = -(-(hit + n) // bs) if hit else need
            if preempting:
                need = bound
            gentle = resuming is not None and resuming(s)
            if gentle and n < view.num_new_tokens(s) and view.blocks_needed(s, view.num_new_tokens(s)) > free:
                admit = False  # its whole recompute does not fit yet
                continue
            if need > free:
                k = None
                if preemptive and not gentle and (may_evict is None or may_evict(s)):
                    k = _count_victims(view, running, ri, end, bound - free + (0 if preempting else slack))
                if k is None:
                    admit = False
                    continue
                if not preempting:
                    free -= slack
                    preempting = True
                need = bound
                for _ in range(k):
                    end -= 1
                    v = running[end][1]
                    plan.preempt_request(v, RECOMPUTE)
                    victims.append(v)
                    free += view.reclaimable_blocks(v)
            elif not preempting:
                slack += bound - need
            plan.schedule(s, n)
            source.consume()
            top = source.peek()
            budget -= n
            free -= need
            seqs += 1
        else:
            break
    if not plan.items and not plan.preempt and end > 0:
        # Nothing fits and no preemption was counted as enough (blocks shared between
        # running requests are undercounted): preempt the worst-ranked running request;
        # the loop plans again at once, and each round frees a request's KV.
        v = running[end - 1][1]
        plan.preempt_request(v, RECOMPUTE)
        victims.append(v)
    return plan, victims


@dataclass
class SRPTKnobs(PredictorKnobs):
    name: str = "srpt"
    starvation_s: float = bounded(10.0, ge=0)  # requests older than this rank first, FCFS; 0 = off


@register
class SRPTPolicy(BasePolicy):
    name = "srpt"
    Knobs = SRPTKnobs

    def __init__(self, knobs=None):
        super().__init__(knobs)
        k = self.knobs
        self.predictor = k.make()
        self.pred: dict[int, float] = {}
        self.queue = WaitingQueue()
        self._requeue: list = []

    def predicted_remaining(self, s) -> float:
        p = self.pred.get(s.req.id)
        if p is None:
            p = self.pred[s.req.id] = self.predictor.predict(s.req)
        return max(p - s.num_generated, 1)

    def _key(self, s):
        return (1, self.predicted_remaining(s), s.req.arrival, s.req.id)

    def on_arrival(self, s, view) -> None:
        self.queue.push(self._key(s), s)

    def on_finish(self, s, view) -> None:
        self.pred.pop(s.req.id, None)

    def is_steady(self, view) -> bool:
        """With no request waiting and every running request in the batch, the same set
        fits next step (the loop checks KV growth): only the order of decodes could change."""
        return not view.waiting

    def schedule(self, view) -> Plan:
        if self._requeue:
            for v in self._requeue:
                if v.status is _WAITING:
                    self.queue.push(self._key(v), v)
            self._requeue = []
        k = self.knobs
        cutoff = view.now - k.starvation_s if k.starvation_s > 0 else float("-inf")
        running = []
        for s in view.running:
            a = s.req.arrival
            running.append(((0, a, s.req.id) if a < cutoff else self._key(s), s))
        running.sort(key=_first)
        plan, victims = fill_ranked(view, running, AgedFirst(view.waiting, cutoff, self.queue), preemptive=True)
        self._requeue = victims
        return plan


_first = itemgetter(0)  # sort key of (key, state) pairs: the key (unique: it ends with the request id)
