"""A replica's decode run cut only by the arrivals routed to it, with the results of one cut by every arrival.

With several replicas the simulator used to end every replica's fast-forwarded decode run at the
next arrival, wherever the router sent it (the run covered the steps starting before it), and plan
again: a replica planned once per arrival to any replica, and sixteen replicas planned sixteen
times as often as one. A `DeferredRun` runs on across arrivals routed elsewhere and ends early only
when one is routed to its replica, at the end of the step in flight, as before.

Only the event structure may change: every result stays bit-identical to the old one. Two things
of the old structure are observable, and a `DeferredRun` reproduces each from the old planner's
rule, replayed over the arrivals delivered while it ran (`DeliveryLog`), without planning:
- its windows: at the end of each old run the old planner planned again and ran on to the next
  arrival. The KV blocks a window grows into were taken when it was planned (the plan's blocks for
  its first step, then the run's for the rest, request by request), so a router reading the cache
  mid-run (`ReplicaView.settle`) sees the same free blocks and cached prefixes, and the block
  manager sees the same calls in the same order (`catch_up`);
- where a cut ends the run: the end of the old window in flight at the arrival (`cut`).
Ties (a step ending exactly when an arrival comes) are ordered as SimPy ordered the old events:
by time, then by when each was scheduled. (The order in which the inter-token gaps are recorded
differs, which no result shows: the summary sums them sorted, testbed/app/analysis/metrics.py `_stats`.)

A run is deferred only where every step end lies within twice its start (Sterbenz: then the
difference of any two of its times is exact, so a clock moved from any time in the run to any later
step end lands on it exactly, as the old clock did); earlier in a trace the old bounded run is used.
"""
from __future__ import annotations

import heapq
from bisect import bisect_left

import simpy

from testbed.core.loop import Batch, StepLoop

_INF = float("inf")
CHUNK = 32  # steps summed at a time in a run not summed to its end yet


class DeliveryLog:
    """The arrivals delivered so far, in order: trace time, clock time, and the delivery whose
    timeout brought it (arrivals due at one time are delivered in one go after one timeout)."""

    __slots__ = ("arrival", "at", "chain")

    def __init__(self):
        self.arrival: list[float] = []
        self.at: list[float] = []
        self.chain: list[int] = []

    def add(self, arrival: float, at: float, chain: int) -> int:
        self.arrival.append(arrival)
        self.at.append(at)
        self.chain.append(chain)
        return len(self.arrival) - 1

    def __len__(self) -> int:
        return len(self.arrival)


def deferrable(batch: Batch) -> bool:
    """Every time of the run lies within twice its start (see the module docstring)."""
    start = batch.start
    return start > 0 and batch.ends[-1] <= 2 * start


def widened(ends: list[float], next_arrival: float, clear_until: float, first: int = 0) -> float:
    """Closed loop: `next_arrival` moved to the end of the last step from `first` on that ends before
    `clear_until` (the steps through it start before that), where that is later: no turn arrives before
    `clear_until`, so none can meet those steps, not even in a tie at their end."""
    m = bisect_left(ends, clear_until, first) - 1
    return ends[m] if m >= first and ends[m] > next_arrival else next_arrival


def moved_timeout(env: simpy.Environment, timeout: simpy.Timeout, at: float) -> simpy.Timeout:
    """A timeout for `at`, after every event scheduled so far for that time, that resumes what
    waited on `timeout` (which then fires with nobody waiting)."""
    now = env.now
    if now + (at - now) != at:  # cannot happen for a deferrable run
        raise AssertionError(f"the clock cannot land on {at!r} from {now!r}")
    new = env.timeout(at - now)
    new.callbacks, timeout.callbacks = timeout.callbacks, []
    return new


class DeferredRun:
    """One replica's fast-forwarded decode run (`StepLoop.extend_decode_run(allocate=False)`),
    its KV taken window by window of the old planner, as the arrivals in `log` are replayed."""

    __slots__ = ("loop", "batch", "ends", "k", "log", "hi", "planned_at", "consumed",
                 "_items", "_computed", "_heap", "_register", "complete", "_more", "_lag")

    def __init__(self, loop: StepLoop, batch: Batch, log: DeliveryLog, next_arrival: float,
                 more: tuple | None = None):
        """`more`: (step_time, k_max, horizon) when `batch.ends` holds only the run's first steps
        (`complete` False): the rest are summed when reached (`extend`), as the old runs summed
        them up to each arrival; a cut usually comes first."""
        self.loop, self.batch, self.log = loop, batch, log
        self.ends = batch.ends
        self.k = len(self.ends)  # steps the run covers so far (fewer after a cut)
        self.complete = more is None
        self._more = more
        self.hi = -1  # the last step of the windows planned so far
        self.planned_at = len(log)  # deliveries made when the window in flight was planned
        self.consumed = len(log)  # deliveries replayed so far
        kv = loop.kv
        self._items = [s for s, _ in batch.items]
        self._computed = [s.num_computed for s in self._items]  # until the run completes
        self._register = kv.cache_decode and kv.enable_prefix_caching
        # vLLM's async scheduling: a step's token is not back when the next step is scheduled, so the
        # blocks a window's plan (and its run) caches stop one token short (StepLoop._apply, `grow_decode_run`'s lag)
        self._lag = 1 if loop.async_scheduling and loop.models_async else 0
        self._heap = [(self._next_call(j), j) for j in range(len(self._items))]
        heapq.heapify(self._heap)
        self._plan(0, next_arrival, len(log), first_step_taken=True)

    # --- the old planner, replayed ----------------------------------------------------------
    def catch_up(self, delivery: int, arrival: float, at: float, chain: int) -> None:
        """Plan the windows the old planner planned before `delivery` (trace time `arrival`, due at
        clock time `at`, brought by delivery `chain`'s timeout), replaying the deliveries before it."""
        log = self.log
        while self.consumed < delivery:
            d = self.consumed
            self._windows_before(log.arrival[d], log.at[d], log.chain[d], d)
            self.consumed = d + 1
        self._windows_before(arrival, at, chain, delivery)

    def catch_up_logged(self, delivery: int) -> None:
        log = self.log
        self.catch_up(delivery, log.arrival[delivery], log.at[delivery], log.chain[delivery])

    def _windows_before(self, arrival: float, at: float, chain: int, delivery: int) -> None:
        """Plan windows while the one in flight ends before the delivery (on a tie: when it was
        planned before the delivery's timeout was scheduled, at delivery `chain` - 1)."""
        ends = self.ends
        while True:
            end = ends[self.hi]
            if not (end < at or (end == at and self.planned_at < chain)):
                return
            if self.hi >= self.k - 1:
                if self.complete:
                    return
                self.extend(end)
            self._plan(self.hi + 1, arrival, delivery)

    def extend(self, until: float) -> None:
        """Sum the next steps' ends, CHUNK at a time until past `until`, as `extend_decode_run` sums
        them (the batch's shape, contexts one token longer per step), to the first finish."""
        run_ends, k_max, horizon = self._more
        ends, shape = self.ends, self.batch.shape
        ctx0 = shape.decode_kv_tokens
        i = len(ends)
        try:
            while i < k_max:
                shape.decode_kv_tokens = ctx0 + i * shape.num_decode_seqs
                more = run_ends(shape, ends[-1], min(CHUNK, k_max - i), _INF, horizon)
                ends.extend(more)
                if len(more) < min(CHUNK, k_max - i):  # the horizon
                    k_max = len(ends)
                i = len(ends)
                if ends[-1] >= until:
                    break
        finally:
            shape.decode_kv_tokens = ctx0
        if ends[-1] > 2 * self.batch.start:  # `deferrable` was judged on a bound the step times broke
            raise AssertionError(f"a deferred decode run reached {ends[-1]!r}, past twice its start {self.batch.start!r}")
        self.k = i
        if i >= k_max:
            self.complete = True
            self.loop.series.steps[-1] = i

    def _plan(self, first: int, next_arrival: float, delivery: int, first_step_taken: bool = False) -> None:
        """The old planner at the start of step `first`: a run over the steps that start before the
        next arrival (`extend_decode_run`), or one plain step when that is one step or its clock
        would not land exactly on its end."""
        ends = self.ends
        if not self.complete and ends[-1] < next_arrival:
            self.extend(next_arrival)
        last = bisect_left(ends, next_arrival, first, self.k - 1)  # steps first+1..last start before it
        if last > first:
            start = ends[first - 1] if first else self.batch.start
            if start + (ends[last] - start) != ends[last]:
                last = first
        if not first_step_taken:
            self._take(first)  # the plan's blocks for its step
        if last > first:
            self._take(last)  # the run's, for the rest
        self.hi = last
        self.planned_at = delivery

    def finish(self, next_arrival: float) -> None:
        """At the run's end: plan the windows after the last delivery, to its last step."""
        self.catch_up(len(self.log), next_arrival, _INF, len(self.log))

    def cut(self) -> bool:
        """End the run with the window in flight (after `catch_up` to the arrival routed here);
        True when that ends it earlier or, the rest not summed yet, fixes its end."""
        if self.hi >= self.k - 1 and self.complete:
            return False
        self.k = self.hi + 1
        del self.ends[self.k:]
        self.complete = True
        self.loop.series.steps[-1] = self.k
        return True

    # --- KV: the old calls, only those that change something -----------------------------------
    def _next_call(self, j: int) -> int:
        """The first step whose KV call changes something for request j: its tokens through that
        step outgrow its blocks, or (decode tokens cached when scheduled) fill one more block."""
        s, bs, nc = self._items[j], self.loop.kv.block_size, self._computed[j]
        step = len(s.blocks) * bs - nc
        if self._register:
            step = min(step, (s.num_cached_blocks + 1) * bs - nc - 1 + self._lag)
        return step

    def _take(self, step: int) -> None:
        """Allocate (and register) every request's KV through `step`, in batch order, as one pass
        of the old `StepLoop._apply` or `extend_decode_run` did; calls that change nothing are skipped."""
        heap = self._heap
        if not heap or heap[0][0] > step:
            return
        due = []
        while heap and heap[0][0] <= step:
            due.append(heapq.heappop(heap)[1])
        due.sort()
        kv, items, computed = self.loop.kv, self._items, self._computed
        for j in due:
            s = items[j]
            kv.allocate(s, step + 1)  # num_computed is the run's start until it completes
            if self._register:
                kv.register(s, computed[j] + step + 1 - self._lag)
            heapq.heappush(heap, (self._next_call(j), j))


class WindowedRun(DeferredRun):
    """A decode run on several replicas whose old windows cannot be replayed from the deliveries alone:
    under closed-loop sessions the old planner ended a window at every other replica's step end (a finish
    there may release a turn here at once), but for the steps that end before any turn can arrive; under
    async scheduling an arrival held back past a window's cut reaches the loop after the next plan. So the simulator keeps one timeout per old window
    (each scheduled when and for where the old one was, so every tie falls as before) and plans the
    next window at each (`plan_window`), without planning the batch or completing its steps."""

    __slots__ = ("_clear_until",)

    def __init__(self, loop: StepLoop, batch: Batch, log: DeliveryLog, next_arrival: float,
                 more: tuple | None = None, clear_until: float = -_INF):
        self._clear_until = clear_until  # (read by the first window's plan, in the base __init__)
        super().__init__(loop, batch, log, next_arrival, more)

    def _plan(self, first: int, next_arrival: float, delivery: int, first_step_taken: bool = False) -> None:
        if first_step_taken and self._clear_until > next_arrival:  # the first window (`plan_window` widens the rest)
            next_arrival = self._widened(first, next_arrival, self._clear_until)
        super()._plan(first, next_arrival, delivery, first_step_taken)

    def _widened(self, first: int, next_arrival: float, clear_until: float) -> float:
        """`widened` over the run's steps, summed past `clear_until` first."""
        if not self.complete and self.ends[-1] < clear_until:
            self.extend(clear_until)
        return widened(self.ends, next_arrival, clear_until, first)

    def plan_window(self, next_arrival: float, clear_until: float = -_INF) -> None:
        """The old planner at the end of the window in flight: the next window's steps start before
        `next_arrival` (`_plan`; the caller has summed the run past the window in flight). Closed loop: no turn
        arrives before `clear_until`, so the steps that end before it join the window too; no arrival can meet
        them, not even in a tie at their end (whose order would depend on when each timeout was scheduled)."""
        first = self.hi + 1
        if clear_until > next_arrival:
            next_arrival = self._widened(first, next_arrival, clear_until)
        if self.ends[first] >= next_arrival:  # one step (most windows): `_plan`'s outcome, without its search
            heap = self._heap
            if heap and heap[0][0] <= first:  # `_take`'s own test, before the call: most windows take nothing
                self._take(first)
            self.hi = first
        else:
            self._plan(first, next_arrival, 0)


class StepwiseRun(DeferredRun):
    """A decode run on a replica that used to plan every step (a disaggregated decode replica):
    each step is a window of its own, its KV taken when reached.
    Events from outside (a transfer landing, a reservation, a router reading the cache) ask which
    steps had started, from the event's time and when it was scheduled (`started`)."""

    __slots__ = ("durations",)

    def __init__(self, loop: StepLoop, batch: Batch, durations: list[float]):
        self.loop, self.batch, self.log = loop, batch, None
        self.ends = batch.ends
        self.k = len(self.ends)
        self.durations = durations[:self.k]  # each step's time, in order (a pool's busy time sums them)
        self.complete, self._more = True, None
        self.hi = 0  # step 0's blocks came with the plan
        kv = loop.kv
        self._items = [s for s, _ in batch.items]
        self._computed = [s.num_computed for s in self._items]
        self._register = kv.cache_decode and kv.enable_prefix_caching
        self._lag = 0
        self._heap = [(self._next_call(j), j) for j in range(len(self._items))]
        heapq.heapify(self._heap)

    def started(self, at: float, scheduled: float) -> int:
        """The last step started before an event due at `at` that was scheduled at `scheduled`: a
        step end at that very time came first when its step was scheduled first."""
        ends, last = self.ends, self.k - 1
        m = bisect_left(ends, at, 0, last)  # steps 1..m start before `at`
        if m < last and ends[m] == at and (ends[m - 1] if m else self.batch.start) < scheduled:
            m += 1
        return m

    def settle(self, at: float, scheduled: float) -> None:
        """Take the blocks of the steps started before the event (see `started`)."""
        self._take_through(self.started(at, scheduled))

    def _take_through(self, step: int) -> None:
        for r in range(self.hi + 1, step + 1):
            self._take(r)
        self.hi = max(self.hi, step)

    def cut_at(self, at: float, scheduled: float) -> bool:
        """End the run with the step in flight at the event; True when that shortens it."""
        self.settle(at, scheduled)
        return self.cut()

    def ends_after(self, at: float, scheduled: float) -> bool:
        """The run ends at `at` and its last step was scheduled no earlier than an event scheduled at
        `scheduled` for that time: the old step end came after the event."""
        ends = self.ends
        return ends[-1] == at and (ends[-2] if len(ends) > 1 else self.batch.start) >= scheduled

    def finish(self, next_arrival: float = _INF) -> None:
        self._take_through(self.k - 1)
