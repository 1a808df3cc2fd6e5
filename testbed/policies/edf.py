"""Deadline-driven scheduling: earliest deadline first (`edf`) and least slack first
(`least_slack`), with per-token deadlines from the TTFT and TPOT SLOs.

Source: EDF and least-laxity-first (Liu & Layland, JACM 1973; Mok, 1983), in the
per-token-deadline form LLM serving uses them (a request owes its first token by arrival
+ TTFT, then keeps the TPOT pace; e.g. the deadline-aware schedulers of SLOs-Serve and
SOLA, 2024-25).

Deadline of a request's next token: arrival + `ttft_ms` while its first token is not out;
afterwards first_token_time + generated * `tpot_ms` (the pace: the k-th token after the
first is due k TPOTs after it). A recompute-preempted request keeps its pace deadline.

`edf`, per step: rank every request, running and waiting, by deadline (earliest first;
ties by arrival, then id) and fill the batch in that order under the token budget, the
sequence cap and KV (`policies/srpt.py:fill_ranked`): running decodes take one token,
prefills (new, chunked or recomputing) a chunk of what the budget leaves. A running
request that misses the batch keeps its KV and waits. When the next request needs more
KV blocks than are free, the latest-deadline running requests not in the batch are
preempted (recompute), latest first, if that makes room; otherwise a waiting request ends
admission for the step and a running one is skipped.

`least_slack`, per step: the same, ranked by slack = deadline - now - the predicted work
before the next token: the backend cost model's time (`view.predict_step_time`) for a
one-request plan of every token the request must compute before its next sample (the
rest of its prefill or recompute, priced as one step even past the budget, or one decode
token). `now` is common to a step's requests, so the rank is deadline - work. With no cost
model (an engine without one) the work is 0 and the rank is EDF's.

Choices (each guards against a failure found in testing):
- A waiting request that already has tokens (preempted after its first token) returns
  gently: nothing is preempted for it, and it is admitted only once KV for its whole
  recompute is free. Pace deadlines move with every token, so two paced requests that do
  not both fit would otherwise take turns: one resumes with a chunk of KV, outranks the
  other as it grows, preempts it, and so on (66 recompute preemptions each for two
  200-token decodes in a 64-block cache, against 1 now). Requests still owing their first
  token have fixed deadlines and may have running requests preempted for them.
- least_slack prices a request's work once, when it arrives, for as long as its first
  token is not out. Re-priced each step, a running prefill's work shrinks chunk by chunk,
  so its slack grows until a waiting request outranks it and preempts it, after which its
  full work makes it outrank that one: least-laxity's classic thrash, a livelock with
  recompute preemption. After the first token the work (one decode) is priced per step.
- Only a request that can still make its deadline (deadline >= now; for least_slack,
  slack >= 0) has running requests preempted for it, whether it waits or runs and needs
  to grow. A late request still ranks first but takes only free KV: preempting for it
  cannot save its deadline and costs the victim its KV. Under overload, where every
  queued request is late, late prefills otherwise preempt the decodes that keep pace
  (mooncake, 2000 requests, llama3.1-8b: 1641 preemptions and a mean E2E of 1033 s
  before this rule and the first, 48 and 399 s with them; vLLM: 404 and 357 s).
- Deadlines do not move when missed; there is no admission control or dropping of
  hopeless requests.

Cost: waiting requests sit in a heap keyed when they arrive or are preempted (neither a
waiting request's deadline nor its work changes while it waits), so per step the work is
O(running log running) plus O(admitted) heap operations. least_slack's cost-model call
takes about 3 us (roofline); priced every step for every running decode it made an
overloaded 20k-request run (256 running) 2.9x slower than vLLM, so a running decode's
one-token work is re-priced every `REPRICE` = 256 tokens (it grows only with the
context it reads: 13 us over 256 tokens for llama3-8b on an H100, on a 6.7 ms step).
That brought the overloaded run to 1.9x vLLM and the default trace to 1.25x. `ttft_ms` / `tpot_ms`
default to the run's `slo` group (conf/policy/edf.yaml); null, as under `slo=none`, means
2000 / 100 ms, the MLPerf llama3.1-8b server SLO.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from testbed.policies.srpt import WaitingQueue, _first, fill_ranked
from testbed.core.bounds import bounded
from testbed.core.plan import Plan
from testbed.core.policy import BasePolicy, PolicyKnobs, register
from testbed.core.request import Status

_WAITING, _SWAPPED, _RUNNING = Status.WAITING, Status.SWAPPED, Status.RUNNING
DEFAULT_TTFT_MS, DEFAULT_TPOT_MS = 2000.0, 100.0
REPRICE = 256  # least_slack: tokens between re-pricings of a running decode's step time


@dataclass
class EDFKnobs(PolicyKnobs):
    name: str = "edf"
    ttft_ms: Optional[float] = bounded(None, gt=0)  # first-token deadline after arrival; null = 2000
    tpot_ms: Optional[float] = bounded(None, gt=0)  # pace of later tokens; null = 100


@dataclass
class LeastSlackKnobs(PolicyKnobs):
    name: str = "least_slack"
    ttft_ms: Optional[float] = bounded(None, gt=0)  # first-token deadline after arrival; null = 2000
    tpot_ms: Optional[float] = bounded(None, gt=0)  # pace of later tokens; null = 100


@register
class EDFPolicy(BasePolicy):
    name = "edf"
    Knobs = EDFKnobs

    def __init__(self, knobs=None):
        super().__init__(knobs)
        k = self.knobs
        self.ttft = (k.ttft_ms if k.ttft_ms is not None else DEFAULT_TTFT_MS) / 1e3
        self.tpot = (k.tpot_ms if k.tpot_ms is not None else DEFAULT_TPOT_MS) / 1e3
        self.queue = WaitingQueue()
        self._requeue: list = []

    def deadline(self, s) -> float:
        """When the request's next token is due."""
        if s.first_token_time < 0:
            return s.req.arrival + self.ttft
        return s.first_token_time + s.num_generated * self.tpot

    def rank(self, s, view) -> float:
        return self.deadline(s)

    def on_arrival(self, s, view) -> None:
        self.queue.push((self.rank(s, view), s.req.arrival, s.req.id), s)

    def is_steady(self, view) -> bool:
        """With no request waiting and every running request in the batch, the same set
        fits next step (the loop checks KV growth): only the order of decodes could change."""
        return not view.waiting

    def schedule(self, view) -> Plan:
        for v in self._requeue:
            if v.status is _WAITING or v.status is _SWAPPED:
                self.queue.push((self.rank(v, view), v.req.arrival, v.req.id), v)
        self._requeue = []
        rank = self.rank
        running = [((rank(s, view), s.req.arrival, s.req.id), s) for s in view.running]  # every request every step
        running.sort(key=_first)
        now = view.now
        plan, victims = fill_ranked(view, running, self.queue, preemptive=True, resuming=_has_tokens,
                                    may_evict=lambda s: self.rank(s, view) >= now)  # not late yet
        self._requeue = victims
        return plan


@register
class LeastSlackPolicy(EDFPolicy):
    name = "least_slack"
    Knobs = LeastSlackKnobs

    def __init__(self, knobs=None):
        super().__init__(knobs)
        self._priced = True  # False once the loop turns out to have no cost model
        self._first_rank: dict[int, float] = {}  # request id -> its rank until the first token
        self._decode_work: dict[int, tuple] = {}  # request id -> (tokens generated when priced, seconds)

    def on_finish(self, s, view) -> None:
        self._first_rank.pop(s.req.id, None)
        self._decode_work.pop(s.req.id, None)

    def work(self, s, view) -> float:
        """Predicted seconds of computing what `s` needs before its next token, alone."""
        if not self._priced:
            return 0.0
        try:
            return view.predict_step_time(Plan([(s, view.num_new_tokens(s))]))
        except RuntimeError:  # no cost model on this loop
            self._priced = False
            return 0.0

    def rank(self, s, view) -> float:
        # slack = deadline - now - work; `now` is common to every request of a step, so the
        # rank drops it, which also keeps a waiting request's key valid while it waits.
        first = s.first_token_time
        if first >= 0 and s.status is _RUNNING:  # a decode priced within REPRICE tokens: once per running
            # request per step, so the path below's deadline(), `remaining` and dict pop are inlined or skipped
            # (that path popped its first rank when it priced the decode, and a first token is never undone)
            c = self._decode_work.get(s.req.id)
            g = s.num_generated
            if c is not None and g - c[0] < REPRICE and s.req.prompt_len + g - s.num_computed == 1:
                return first + g * self.tpot - c[1]
        if first < 0:  # priced once, when it arrives: see the module docstring
            r = self._first_rank.get(s.req.id)
            if r is None:
                r = self._first_rank[s.req.id] = self.deadline(s) - self.work(s, view)
            return r
        self._first_rank.pop(s.req.id, None)
        if s.status is _RUNNING and s.remaining == 1:  # a decode: re-priced every REPRICE tokens
            g = s.num_generated
            c = self._decode_work.get(s.req.id)
            if c is None or g - c[0] >= REPRICE:
                c = self._decode_work[s.req.id] = (g, self.work(s, view))
            return self.deadline(s) - c[1]
        return self.deadline(s) - self.work(s, view)


def _has_tokens(s) -> bool:
    return s.first_token_time >= 0
