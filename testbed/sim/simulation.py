"""The simulator backend: SimPy processes around the shared step loop.

An arrival process hands each trace request to a replica at its arrival time; one
server process per replica repeats plan -> `yield env.timeout(step_time)` -> complete.
The simulator contributes only the clock and the cost model's step time: one SimPy event
per engine step (and one per arrival), never one per token.

`async_scheduling` is vLLM's (on by default since vLLM 0.14: `VllmConfig`'s check of
`scheduler_config.async_scheduling is None`, vllm/config/vllm.py L1585-1644 of 0.32): the
engine core schedules step N+1 as soon as step N is launched, before its outputs are back
(`EngineCore.step_with_batch_queue`, vllm/v1/engine/core.py L698), so a request that arrives
while step N runs is first seen by the schedule of step N+2: one more step of TTFT. Here an
arrival during a step is held back until the next step has been planned. The other effects are the
step loop's (`async_scheduling`, for a policy that models vLLM's scheduler): a request that finished in
step N is still running in the schedule of step N+1, skipped but holding its seat and KV blocks, and is
freed after it (vLLM 0.32 scheduler.py L664-676); a block completed by step N's token is cached only
after that schedule (`StepLoop.in_flight`). `policy=vllm_native` takes every one of them from vLLM's own
AsyncScheduler instead (testbed/vllm_backend/native_sim.py).

Under async scheduling the step after a decode run stopped by an arrival is planned with that arrival
still held back: the same plan again. With one replica (open loop, fast_forward, a policy with no arrival
hook) that step is folded into the run, its KV calls made
in the order its plan makes them and the held arrivals delivered as at its start; the results are
bit-identical to planning it (`fold_held_arrivals=False`, tests/test_held_arrival_runs.py).

With several replicas (open loop, fast_forward), a replica's fast-forwarded decode run is cut only by
the arrivals the router sends to it (testbed/sim/decode_runs.py): an arrival sent elsewhere no longer
ends every replica's run, and the results are bit-identical to cutting them all (the KV a mid-run
replica shows the router and the cut points are replayed from the old rule). Not with async scheduling
or a policy that has an arrival hook; closed-loop sessions have their own (below).

`run(stop)` ends early, cleanly, once `stop()` turns true (a signal raised it): the
processes look at it only between steps and before an arrival, so every request's state is
consistent; finished requests keep their results and the rest are marked interrupted.

Closed-loop sessions (`sessions`, testbed/sim/sessions.py): the arrival process walks only the
turns that arrive at their timestamps; a turn whose parent is in the run is held until the parent
finishes (checked after each completed step) and then released by a SimPy timeout of its think
time. A replica's decode run ends at its own first finish; with several replicas the old planner also
ended it by the end of every other replica's step in flight (a finish there may release a turn to it),
planning and completing it again each time. Now (fast_forward, no arrival hook) a run is planned and
completed once and cut only by an arrival routed to its replica (`WindowedRun`,
testbed/sim/decode_runs.py): what is left of each old window is a timeout at its end, scheduled when
the old one was (so ties fall as before), where the next window's bound is read and its KV blocks
taken. The results are bit-identical to the old structure (`per_replica_runs=False`).
"""
from __future__ import annotations

import heapq
from dataclasses import replace
from functools import partial
from typing import Callable, Sequence

import simpy

from testbed.core.cost import CostModel, decode_run_ends
from testbed.core.event_run import Stopped, run_until
from testbed.core.loop import ReplayOutcome, StepLoop
from testbed.core.policy import BasePolicy
from testbed.core.request import Request, RequestState, Status
from testbed.core.router import ReplicaView, Router
from testbed.sim.decode_runs import CHUNK, DeferredRun, DeliveryLog, WindowedRun, deferrable, moved_timeout, widened
from testbed.sim.sessions import ClosedLoopSessions

_INF = float("inf")


class Simulation:
    def __init__(self, requests: Sequence[Request], make_loop: Callable[[], StepLoop], cost_model: CostModel,
                 replicas: int = 1, router: Router | None = None, horizon_s: float | None = None,
                 fast_forward: bool = True, progress: Callable[[float, int], None] | None = None,
                 async_scheduling: bool = False, sessions: ClosedLoopSessions | None = None,
                 per_replica_runs: bool = True, fold_held_arrivals: bool = True):
        if replicas < 1:
            raise ValueError(f"sim.replicas={replicas}: must be >= 1")
        if router is None and replicas > 1:
            raise ValueError(f"backend.replicas={replicas}: several replicas need a router (testbed.app.assembly.run_setup.build_router)")
        if horizon_s is not None and horizon_s <= 0:
            raise ValueError(f"sim.horizon_s={horizon_s}: must be > 0 (or null for no horizon)")
        self.requests = requests
        self.cost_model = cost_model
        self.loops = [make_loop() for _ in range(replicas)]
        self.router = router
        self.views = [ReplicaView(i, loop) for i, loop in enumerate(self.loops)]
        self.horizon_s = horizon_s
        self.fast_forward = fast_forward
        self.async_scheduling = async_scheduling
        for loop in self.loops:  # a finished request holds its seat and blocks through the next schedule
            loop.async_scheduling = async_scheduling
        self._in_step = [False] * replicas
        self._held: list[list[Request]] = [[] for _ in range(replicas)]  # arrived during the step in flight
        self.progress = progress  # called with (simulated time, requests delivered) now and then
        self.env = simpy.Environment()
        self._idle: list[simpy.Event | None] = [None] * replicas
        self._delivered = 0
        self._arrivals_done = False
        self.stalled = False
        self._stop: Callable[[], bool] = _never
        self.sessions = sessions  # closed-loop turns (None: every request arrives at its timestamp)
        self._releases: list[float] = []  # closed loop: heap of the times of turns released, not yet arrived
        self._released: dict[int, Request] = {}  # ... those turns, with their release times as arrivals
        self._step_end = [0.0] * replicas  # closed loop: when each replica's step (or run) in flight ends
        if sessions is not None:
            self.requests = sessions.roots
        self._think_floor = 0.5 * sessions.min_think if sessions is not None else 0.0
        # several replicas, open loop: a replica's decode run is cut only by the arrivals routed to it
        # (testbed/sim/decode_runs.py); a policy's arrival hook would see the run's progress, so not then,
        # nor with async scheduling (an arrival held back past a run's cut is not replayed yet)
        # (`per_replica_runs=False`: every arrival cuts every run, the reference the tests compare with)
        deferred = (per_replica_runs and fast_forward and replicas > 1
                    and not any(_has_arrival_hook(loop.policy) for loop in self.loops))
        self._per_replica = deferred and sessions is None and not async_scheduling
        # closed loop: a run whose old windows (cut at every other replica's step end) are replayed as it
        # goes; async scheduling too (an arrival held back past the cut arrives after the next real plan).
        # Open loop under async scheduling takes the same path, its windows cut at every arrival: one plan
        # and one completion per run instead of one per window (16 replicas at 16x: 3.3x fewer plans)
        self._windowed_runs = deferred and (sessions is not None or async_scheduling)
        self._log = DeliveryLog()
        self._chain = 0  # the delivery whose timeout brought the arrivals being delivered
        self._runs: list[DeferredRun | None] = [None] * replicas
        self._run_end: list[simpy.Timeout | None] = [None] * replicas
        self._run_end_at: list[float] = [_INF] * replicas  # when that timeout fires
        if self._per_replica:
            for i, view in enumerate(self.views):
                view.settle = partial(self._settle, i)
        # async scheduling, one replica, open loop: a run stopped by an arrival takes the step after it too,
        # planned without the arrival held back (`_one_past`); not for a policy that sees arrivals or steps. Planned
        # on its own that step is a plain step whatever the policy's steadiness (no run starts from a plan an
        # arrival was held back from: `_server`), so folding it changes nothing. `fold_held_arrivals=False`:
        # that step planned on its own, the reference the tests compare with
        self._fold = (fold_held_arrivals and async_scheduling and fast_forward and replicas == 1 and sessions is None
                      and not _has_arrival_hook(self.loops[0].policy))
        self._fold_held = 0  # the held arrivals the folded step's plan would have delivered after it

    def run(self, stop: Callable[[], bool] | None = None) -> ReplayOutcome:
        env = self.env
        self._stop = stop or _never
        env.process(self._arrivals())
        for i in range(len(self.loops)):
            env.process(self._server(i))
        interrupted = run_until(env, self.horizon_s)
        reason = "interrupted" if interrupted else "stalled" if self.stalled else "unfinished at the horizon"
        for i in range(len(self.loops)):
            self._release(i)  # held back at the end: delivered, so counted with their replica
        for loop in self.loops:
            if loop.has_work:
                loop.abandon(reason)
        not_arrived = list(self.requests[self._delivered:])
        reasons = {}
        if self.sessions is not None:
            not_arrived += self._released.values()
            for pid, turns in self.sessions.children.items():  # parents that never finished
                for t in turns:
                    not_arrived.append(t)
                    reasons[t.id] = f"parent-unfinished: its parent request {pid} never finished ({reason})"
        return ReplayOutcome(self.loops, not_arrived, env.now, self.stalled, interrupted, reasons)

    # --- processes ----------------------------------------------------------------------
    def _arrivals(self):
        env = self.env
        for req in self.requests:
            if req.arrival > env.now:
                if self._per_replica:
                    self._extend_runs(env.now + (req.arrival - env.now))
                timeout = env.timeout(req.arrival - env.now)
                if self._per_replica:
                    self._order_run_ends(req.arrival, env.now + (req.arrival - env.now))
                yield timeout
                self._chain = self._delivered
            if self._stop():
                raise Stopped
            self._deliver(req)
            self._delivered += 1
            if self.progress is not None and not self._delivered & 1023:
                self.progress(env.now, self._delivered)
        self._arrivals_done = True
        for i in range(len(self.loops)):
            self._wake(i)

    def _server(self, i: int):
        env, loop, step_time = self.env, self.loops[i], self.cost_model.step_time
        while True:
            if self._stop():
                raise Stopped
            batch = loop.plan(env.now) if loop.has_work else None
            held = bool(self._held[i])
            if held:  # seen by the plan after this one
                self._release(i)
                if batch is None:
                    continue
            if batch is None:
                if self._no_more_arrivals(i):
                    if loop.has_work:  # work left, nothing scheduled, nothing will ever arrive
                        self.stalled = True
                        loop.abandon(f"stalled: policy {loop.policy_name!r} scheduled nothing and no arrivals were left")
                    if self.sessions is not None:  # the others may have waited on this one's turns
                        for j in range(len(self.loops)):
                            self._wake(j)
                    return
                self._idle[i] = env.event()
                yield self._idle[i]
                continue
            self._in_step[i] = True
            if self._per_replica and self._defer_run(i, batch):
                run = self._runs[i]
                while True:  # to its last step's end, or (cut) that of the old window in flight
                    yield self._run_end[i]
                    if not run.complete and run.ends[-1] <= env.now:
                        run.extend(env.now)  # the steps summed so far are done: sum more
                    if run.complete and run.ends[-1] == env.now:
                        break
                    self._run_end[i] = env.timeout(run.ends[-1] - env.now)
                    self._run_end_at[i] = run.ends[-1]
                run.finish(self._next_arrival())
                self._runs[i] = self._run_end[i] = None
                self._in_step[i] = False
                loop.complete(batch, env.now)
                continue
            next_arrival, clear_until = (self._next_arrival(), -_INF) if self.sessions is None else self._turn_bounds(i)
            # (not after an arrival held back: the plan was steady without it, the next one may not be)
            if self._windowed_runs and not held and self._defer_windowed_run(i, batch, next_arrival, clear_until):
                run = self._runs[i]
                step_end, timeout, stop = self._step_end, env.timeout, self._stop
                bounds = (lambda: (self._next_arrival(), -_INF)) if self.sessions is None else partial(self._turn_bounds, i)
                while True:  # one timeout per old window, where the old planner's window ended (the hottest loop
                    # of a closed-loop run: one pass per step of every replica)
                    step_end[i] = end = run.ends[run.hi]
                    yield timeout(end - env.now)
                    if stop():  # the old loop stopped after this window
                        run.cut()
                    if run.hi >= run.k - 1:
                        if run.complete:
                            break
                        run.extend(end)  # the steps summed so far are done: sum more
                        if run.hi >= run.k - 1:
                            break
                    run.plan_window(*bounds())
                self._runs[i] = None
                self._in_step[i] = False
                loop.complete(batch, env.now)
                if self.sessions is not None and self.sessions.children:
                    self._release_turns(batch)
                continue
            self._fold_held = 0
            if clear_until > next_arrival and self.fast_forward and not held:
                next_arrival = self._widened(loop, batch, next_arrival, clear_until)
            # (nor after an arrival held back, for the same reason: a policy whose steadiness ignores its
            # queue, such as orca's, would run on past the plan that admits it)
            if self.fast_forward and not held and loop.extend_decode_run(batch, step_time, next_arrival, self._horizon,
                                                            one_past=self._one_past if self._fold else None):
                self._step_end[i] = batch.ends[-1]
                yield env.timeout(batch.ends[-1] - env.now)
                if self._fold_held:  # as the folded step's plan at its start delivered them
                    # (not `held`: that local is a bool, and the mypyc build checks its type)
                    held_reqs, start = self._held[i], batch.ends[-2]
                    for req in held_reqs[:self._fold_held]:
                        loop.arrive(req, start)
                    del held_reqs[:self._fold_held]
            else:
                self._step_end[i] = env.now + step_time(batch.shape)
                yield env.timeout(self._step_end[i] - env.now)
            self._in_step[i] = False
            loop.complete(batch, env.now)
            if self.sessions is not None and self.sessions.children:
                self._release_turns(batch)

    def _widened(self, loop: StepLoop, batch, next_arrival: float, clear_until: float) -> float:
        """Closed loop, a run planned whole: `widened` over its steps, as `WindowedRun.plan_window` widens a
        window. The run's steps are summed once to find it, and summed again by the caller."""
        if not loop.extend_decode_run(batch, self.cost_model.step_time, clear_until, self._horizon, allocate=False):
            return next_arrival
        ends = batch.ends
        batch.ends = None  # (as `_sum_run` undoes a trial run)
        loop.series.steps[-1] = 1
        return widened(ends, next_arrival, clear_until)

    def _one_past(self, start: float, end: float) -> bool:
        """May a run stopped by an arrival take the step from `start` to `end` (`StepLoop.extend_decode_run`)?
        Yes where every arrival up to `end` lands clear of both (a tie's order would decide which plan sees
        it): those before `start` were held back during the run, and its plan would have delivered them
        after it (`_fold_held`); those during it are held to the next plan either way. A clock time
        lands within a few ulps of its arrival (timeouts of arrival - now), far inside the margin."""
        reqs, j = self.requests, self._delivered
        margin = 1e-9 * end
        early = 0
        while j < len(reqs):
            a = reqs[j].arrival
            if a > end + margin:
                break
            if abs(a - start) <= margin or abs(a - end) <= margin:
                return False
            if a < start:
                early += 1
            j += 1
        self._fold_held = early
        return True

    @property
    def _horizon(self) -> float:
        return self.horizon_s if self.horizon_s is not None else float("inf")

    def _next_arrival(self) -> float:
        t = self.requests[self._delivered].arrival if self._delivered < len(self.requests) else float("inf")
        return min(t, self._releases[0]) if self._releases else t

    def _turn_bounds(self, i: int) -> tuple[float, float]:
        """Closed loop: the earliest time a request may be released to replica i, and the earliest it may
        arrive there. Besides the known arrivals, a turn is released no earlier than its parent's finish,
        which on another replica happens at the end of its step in flight, or (one with work about to plan)
        from now on; it arrives after its think time, no sooner than half the least think time of the turns
        held (half: a clock time an ulp short of a step's end cannot bring it before the bound). A run's
        steps that end before the second need no window of their own (`WindowedRun.plan_window`): other
        replicas' step ends used to cut one at each."""
        t = self.requests[self._delivered].arrival if self._delivered < len(self.requests) else _INF
        if self._releases and self._releases[0] < t:  # `_next_arrival`, inlined: this runs at every window
            t = self._releases[0]
        if self.sessions.children:
            in_step, step_end, released = self._in_step, self._step_end, t
            for j, loop in enumerate(self.loops):
                if j != i:
                    if in_step[j]:
                        if step_end[j] < released:
                            released = step_end[j]
                    elif loop.live:  # has_work
                        released = self.env.now
                        break
            if released < t:
                return released, min(t, released + self._think_floor)
        return t, t

    def _no_more_arrivals(self, i: int) -> bool:
        """Nothing can arrive any more: the trace is delivered and (closed loop) no turn is on its way
        and no other replica has work whose finish could release one."""
        if not self._arrivals_done or self.sessions is None:
            return self._arrivals_done
        return not self._releases and not any(loop.has_work for j, loop in enumerate(self.loops) if j != i)

    def _deliver(self, req: Request) -> None:
        if self._windowed_runs:
            i = self._route(req)
            run = self._runs[i]
            if run is not None:  # the run ends with the old window in flight, as the old one did
                run.cut()
        elif self._per_replica:
            d = self._log.add(req.arrival, self.env.now, self._chain)
            i = self._route(req)
            run = self._runs[i]
            if run is not None:
                run.catch_up_logged(d)
                if run.cut():
                    self._move_run_end(i, run.ends[-1])
            for j, run in enumerate(self._runs):  # the router's reads may have summed a run to its end
                if run is not None:
                    self._fix_run_end(j)
        else:
            i = self._route(req)
        if self._in_step[i] and self.async_scheduling:
            self._held[i].append(req)
        else:
            self._arrive(i, req)
            self._wake(i)

    def _arrive(self, i: int, req: Request) -> None:
        s = self.loops[i].arrive(req, self.env.now)
        if self.sessions is not None and s.status is Status.REJECTED and req.id in self.sessions.children:
            self._reject_turns(i, req.id, s.reject_reason)

    def _release(self, i: int) -> None:
        held = self._held[i]
        if self.sessions is None:
            for req in held:
                self.loops[i].arrive(req, self.env.now)
        else:
            for req in held:
                self._arrive(i, req)
        held.clear()

    # --- per-replica decode runs (testbed/sim/decode_runs.py) ----------------------------------
    def _defer_run(self, i: int, batch) -> bool:
        """Start a decode run cut only by arrivals routed to replica i, when there is one to defer:
        summed to about one more arrival per replica ahead, the rest when reached, when a bound on its
        step times shows every end within twice its start; else summed to its first finish now."""
        loop = self.loops[i]
        ahead = self._delivered + len(self.loops) - 1  # summed first: to about one more arrival per replica
        lookahead = self.requests[ahead].arrival if ahead < len(self.requests) else _INF
        ok, more = self._sum_run(loop, batch, lookahead)
        if not ok:
            return False
        run = self._runs[i] = DeferredRun(loop, batch, self._log, self._next_arrival(), more)
        self._run_end[i] = self.env.timeout(run.ends[-1] - self.env.now)
        self._run_end_at[i] = run.ends[-1]
        return True

    def _defer_windowed_run(self, i: int, batch, next_arrival: float, clear_until: float) -> bool:
        """Closed loop, or async scheduling: start a decode run that other replicas' step ends or arrivals no
        longer cut (one plan and one completion), its old windows replayed as they are reached
        (`WindowedRun`): the first one's steps start before `next_arrival` (or end before `clear_until`), each
        next one's before the next (closed loop: possible) arrival at its start.
        Only where the run as a whole is one (steady, its KV growth to its first finish fits) and
        deferrable; else the old window is planned as before."""
        loop = self.loops[i]
        lookahead = batch.start + CHUNK * self.cost_model.step_time(batch.shape)  # summed first: about CHUNK steps
        ok, more = self._sum_run(loop, batch, lookahead)
        if not ok:
            return False
        self._runs[i] = WindowedRun(loop, batch, self._log, next_arrival, more, clear_until)
        return True

    def _sum_run(self, loop, batch, lookahead: float) -> tuple[bool, tuple | None]:
        """A decode run's steps summed to `lookahead` (or to its first finish at once, where nothing is to
        be summed later), and what is left to sum past them (`_lazy_rest`, None where nothing); (False, None)
        where the batch is no deferrable run, left as a one-step batch."""
        step_time, horizon = self.cost_model.step_time, self._horizon
        if not loop.extend_decode_run(batch, step_time, lookahead, horizon, allocate=False):
            return False, None
        more = self._lazy_rest(loop, batch, lookahead)
        if more is None:  # summed to the first finish at once
            batch.ends = None
            loop.series.steps[-1] = 1
            if not loop.extend_decode_run(batch, step_time, _INF, horizon, allocate=False):
                return False, None
        if not deferrable(batch):
            batch.ends = None
            loop.series.steps[-1] = 1
            return False, None
        return True, more or None

    def _lazy_rest(self, loop, batch, lookahead: float):
        """(the cost model's `decode_run_ends`, k_max, horizon) to sum a run's steps past its first ones later, False when
        those are the whole run, None when the rest must be summed now: its KV growth to the first
        finish would not fit, or twice the last step's time over the steps left exceeds the start."""
        ends = batch.ends
        k_max = min(s.req.output_len - s.num_generated for s, _ in batch.items)
        if len(ends) >= k_max or ends[-1] < lookahead:  # the first finish, or the horizon, came first
            return False
        kv, bs = loop.kv, loop.kv.block_size
        if sum(max(0, -(-(s.num_computed + k_max) // bs) - len(s.blocks)) for s, _ in batch.items) > kv.num_free_blocks:
            return None
        shape = batch.shape
        ctx0 = shape.decode_kv_tokens
        shape.decode_kv_tokens = ctx0 + (k_max - 1) * shape.num_decode_seqs
        last = self.cost_model.step_time(shape)
        shape.decode_kv_tokens = ctx0
        if 2 * k_max * last > batch.start:
            return None
        run_ends = getattr(self.cost_model, "decode_run_ends", None) or partial(decode_run_ends, self.cost_model.step_time)
        return (run_ends, k_max, self._horizon)

    def _extend_runs(self, at: float) -> None:
        """Before an arrival's timeout for `at` is scheduled: every run summed past it, so that one
        ending then has its end scheduled first, as the old one had (`_order_run_ends` then moves it
        where the old order put it after)."""
        for i, run in enumerate(self._runs):
            if run is not None and not run.complete and run.ends[-1] < at:
                run.extend(at)
                self._fix_run_end(i)

    def _fix_run_end(self, i: int) -> None:
        """A run summed to its end (or cut) ends at its last step: its timeout says so."""
        run = self._runs[i]
        if run.complete and self._run_end_at[i] != run.ends[-1]:
            self._move_run_end(i, run.ends[-1])

    def _settle(self, i: int) -> None:
        """Before the router reads replica i's KV cache: take the blocks its run held at this arrival."""
        run = self._runs[i]
        if run is not None:
            run.catch_up_logged(len(self._log) - 1)

    def _move_run_end(self, i: int, at: float) -> None:
        """Replica i's run now ends at `at`, and after the events scheduled so far for that time."""
        self._run_end[i] = moved_timeout(self.env, self._run_end[i], at)
        self._run_end_at[i] = at

    def _order_run_ends(self, arrival: float, at: float) -> None:
        """The next arrival's timeout was just scheduled for `at`: a run ending then whose old last
        window was planned after the previous arrival ended after this arrival in the old order."""
        d = self._delivered
        for i, run in enumerate(self._runs):
            if run is not None and run.complete and run.ends[-1] == at:
                run.catch_up(d, arrival, at, d)
                if run.planned_at == d:
                    self._move_run_end(i, at)

    # --- closed-loop sessions -----------------------------------------------------------------
    def _release_turns(self, batch) -> None:
        """Release the turns of the batch's requests that just finished, after their think time."""
        sessions, env = self.sessions, self.env
        for s, _ in batch.items:
            if s.status is Status.FINISHED and s.req.id in sessions.children:
                for turn in sessions.take(s.req.id):
                    at = s.finish_time + sessions.think(turn)
                    if at <= env.now:
                        self._deliver(replace(turn, arrival=env.now))
                        continue
                    self._released[turn.id] = replace(turn, arrival=at)
                    heapq.heappush(self._releases, at)
                    env.timeout(at - env.now).callbacks.append(lambda _, rid=turn.id: self._turn_arrives(rid))

    def _turn_arrives(self, rid: int) -> None:
        heapq.heappop(self._releases)  # the earliest: timeouts fire in time order
        turn = self._released.pop(rid)
        if self._stop():
            self._released[rid] = turn  # not arrived, as an interrupted arrival process leaves it
            raise Stopped
        self._deliver(replace(turn, arrival=self.env.now))

    def _reject_turns(self, i: int, pid: int, reason: str) -> None:
        """A parent rejected at arrival: its turns (and theirs) can never come; rejected on its replica."""
        loop, now = self.loops[i], self.env.now
        for turn in self.sessions.take(pid):
            s = RequestState(turn)
            s.status, s.finish_time = Status.REJECTED, now
            s.reject_reason = f"parent-rejected: its parent request {pid} was rejected ({reason})"
            loop.states.append(s)
            self._reject_turns(i, turn.id, s.reject_reason)

    def _wake(self, i: int) -> None:
        ev = self._idle[i]
        if ev is not None:
            self._idle[i] = None
            ev.succeed()

    def _route(self, req: Request) -> int:
        if len(self.loops) == 1:
            return 0
        i = self.router.route(req, self.views, self.env.now)
        if not (type(i) is int and 0 <= i < len(self.loops)):
            raise ValueError(f"router {self.router.name!r} returned {i!r} for request {req.id}: expected a replica "
                             f"index in 0..{len(self.loops) - 1}")
        return i


def _never() -> bool:
    return False


def _has_arrival_hook(policy) -> bool:
    """An arrival hook (it would see a deferred run's progress), or `steady_steps` (a run's length
    depends on where it starts): no deferred runs for such a policy."""
    hook = getattr(type(policy), "on_arrival", None)
    return (hook is not None and hook is not BasePolicy.on_arrival) or hasattr(policy, "steady_steps")
