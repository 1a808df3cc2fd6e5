"""Disaggregated prefill/decode in the simulator: a prefill pool, a decode pool, a KV link between.

The flow is vLLM's disaggregated serving with a KV connector (the proxy of
examples/online_serving/disaggregated_serving/disagg_proxy_demo.py, the NIXL connector of
vllm/distributed/kv_transfer/kv_connector/v1/nixl/):
1. the proxy sends the request to a prefill replica with max_tokens=1 (`create_completion`); here the
   run's router picks it over the prefill pool's replicas, and the prefill replica's step loop
   serves a copy of the request with one output token;
2. when that token is sampled, the prefill replica keeps the prompt's KV (the connector's
   `request_finished` delays freeing the blocks until the decode side has read them:
   nixl/pull_scheduler.py `delay_free_blocks`) and the request goes to a decode replica (the router
   over the decode pool);
3. the decode replica takes blocks for the prompt before the KV comes (WAITING_FOR_REMOTE_KVS,
   vllm/v1/core/sched/scheduler.py L1321-1323): requests queue FIFO per decode replica until
   their blocks and a sequence slot are free (`StepLoop.reserve_remote_kv`);
4. the KV crosses the link (`testbed.sim.kv_link`: latency + bytes / bandwidth; transfers into one
   decode replica run one after another when `serialize`), then the prefill replica frees its copy
   and the request runs on the decode replica with all but the last prompt token computed
   (`StepLoop.receive_remote_kv`): its first step recomputes that token and samples token 1.

Where the client's first token comes from: the proxy's default (`D_first_token_generator`,
`generator_on_p_node=False`) drops the prefill instance's output and streams every token from the
decode instance, so TTFT = prefill + KV wait + transfer + the first decode step. (DistServe counts
TTFT at the prefill instance instead; the testbed follows the vLLM proxy.) The decode replica
generates all `output_len` tokens.

A decode replica's steady decode run is fast-forwarded (`StepwiseRun`, testbed/sim/decode_runs.py):
a transfer landing on it, or a reservation of its blocks, ends the run with the step in flight, and
every result is the one of planning each step (the prefill replicas' one-token requests never form
such a run). `async_scheduling` is not modelled here.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, replace
from functools import partial
from typing import Callable, Sequence

import simpy

from testbed.core.cost import CostModel
from testbed.core.loop import StepLoop, reject_reason
from testbed.core.request import Request, RequestState, Status
from testbed.core.router import ReplicaView, Router
from testbed.sim.decode_runs import StepwiseRun, deferrable, moved_timeout
from testbed.sim.kv_link import KVLink
from testbed.core.event_run import Stopped, run_until
from testbed.sim.simulation import _has_arrival_hook, _never

_INF = float("inf")


@dataclass
class Pool:
    """The replicas of one pool: a step loop and a cost model each (one per pool here), a router."""

    name: str
    loops: list[StepLoop]
    cost: CostModel
    router: Router

    def __post_init__(self):
        self.views = [ReplicaView(i, loop) for i, loop in enumerate(self.loops)]
        self.busy_s = [0.0] * len(self.loops)  # step time summed per replica

    def route(self, req: Request, now: float) -> int:
        if len(self.loops) == 1:
            return 0
        i = self.router.route(req, self.views, now)
        if not (type(i) is int and 0 <= i < len(self.loops)):
            raise ValueError(f"router {self.router.name!r} returned {i!r} for request {req.id} in the {self.name} "
                             f"pool: expected a replica index in 0..{len(self.loops) - 1}")
        return i


@dataclass
class Handoff:
    """One request's way through the pools; times are simulated seconds (-1: not reached)."""

    req: Request  # as the trace gave it (the prefill replica serves a one-token copy)
    prefill_replica: int = -1
    prefill: RequestState | None = None
    rejected: RequestState | None = None  # refused before any replica took it
    decode_replica: int = -1
    decode: RequestState | None = None
    prefilled_s: float = -1.0  # the prefill's token sampled: the KV is ready to send
    reserved_s: float = -1.0  # the decode replica took blocks for it
    sending_s: float = -1.0  # its transfer started (after the link's queue)
    landed_s: float = -1.0  # the KV is on the decode replica


@dataclass
class DisaggOutcome:
    prefill: Pool
    decode: Pool
    handoffs: list[Handoff]  # in arrival order, one per delivered request
    not_arrived: list[Request]
    end_time: float
    stalled: bool
    interrupted: bool
    end_reason: str


class DisaggSimulation:
    def __init__(self, requests: Sequence[Request], prefill: Pool, decode: Pool, link: KVLink,
                 kv_bytes_per_token: int, horizon_s: float | None = None,
                 progress: Callable[[float, int], None] | None = None, fast_forward: bool = True):
        if horizon_s is not None and horizon_s <= 0:
            raise ValueError(f"backend.horizon_s={horizon_s}: must be > 0 (or null for no horizon)")
        self.requests = requests
        self.prefill, self.decode = prefill, decode
        self.link = link
        self.kv_bytes_per_token = kv_bytes_per_token
        self.horizon_s = horizon_s
        self.progress = progress
        self.env = env = simpy.Environment()
        for loop in prefill.loops:
            loop.hold_finished_kv = True
        self.handoffs: list[Handoff] = []
        self._by_prefill: list[dict[int, Handoff]] = [{} for _ in prefill.loops]
        self._reserve_queue: list[deque[tuple[Handoff, simpy.Event]]] = [deque() for _ in decode.loops]
        self._links = [simpy.Resource(env, capacity=1) for _ in decode.loops]
        self._idle: dict[tuple[str, int], simpy.Event] = {}
        self._delivered = 0
        self._arrivals_done = False
        self._in_flight = 0  # prefilled, not yet landed on a decode replica
        self._holding = [0] * len(prefill.loops)  # per prefill replica: finished prompts whose KV it keeps
        self._decode_max_len = decode.loops[0].limits.max_model_len
        self.stalled = False
        self._stop: Callable[[], bool] = _never
        # decode replicas' fast-forwarded runs (a policy's arrival hook would see a run's progress: not then)
        self._fast_forward = fast_forward and not any(_has_arrival_hook(loop.policy) for loop in decode.loops)
        self._runs: list[StepwiseRun | None] = [None] * len(decode.loops)
        self._run_end: list[simpy.Timeout | None] = [None] * len(decode.loops)
        self._scheduled = 0.0  # when the event being handled was scheduled (a prefill step's start)
        if self._fast_forward:
            for j, view in enumerate(decode.views):
                view.settle = partial(self._settle, j)

    def run(self, stop: Callable[[], bool] | None = None) -> DisaggOutcome:
        env = self.env
        self._stop = stop or _never
        env.process(self._arrivals())
        for i in range(len(self.prefill.loops)):
            env.process(self._prefill_server(i))
        for j in range(len(self.decode.loops)):
            env.process(self._decode_server(j))
        interrupted = run_until(env, self.horizon_s)
        reason = "interrupted" if interrupted else "stalled" if self.stalled else "unfinished at the horizon"
        for loop in self.prefill.loops + self.decode.loops:
            if loop.has_work or loop.receiving:
                loop.abandon(reason)
        return DisaggOutcome(self.prefill, self.decode, self.handoffs, list(self.requests[self._delivered:]),
                             env.now, self.stalled, interrupted, reason)

    # --- processes ----------------------------------------------------------------------
    def _arrivals(self):
        env, pool = self.env, self.prefill
        for req in self.requests:
            if req.arrival > env.now:
                yield env.timeout(req.arrival - env.now)
            if self._stop():
                raise Stopped
            h = Handoff(req)
            self.handoffs.append(h)
            self._delivered += 1
            # the decode replica must hold the whole sequence: refuse at the door what it never could
            if reason := reject_reason(req, self._decode_max_len, self.decode.loops[0].kv):
                h.rejected = RequestState(req, status=Status.REJECTED, reject_reason=f"{reason} (decode pool)",
                                          finish_time=env.now)
            else:
                i = h.prefill_replica = pool.route(req, env.now)
                h.prefill = pool.loops[i].arrive(replace(req, output_len=1), env.now)
                self._by_prefill[i][req.id] = h
                self._wake("prefill", i)
            if self.progress is not None and not self._delivered & 1023:
                self.progress(env.now, self._delivered)
        self._arrivals_done = True
        for i in range(len(pool.loops)):
            self._wake("prefill", i)

    def _prefill_server(self, i: int):
        env, pool = self.env, self.prefill
        loop, step_time = pool.loops[i], pool.cost.step_time
        while True:
            if self._stop():
                raise Stopped
            batch = loop.plan(env.now) if loop.has_work else None
            if batch is None:
                if self._arrivals_done and not self._holding[i]:  # held KV frees when its transfer lands
                    if loop.has_work:
                        self.stalled = True
                        loop.abandon(f"stalled: policy {loop.policy_name!r} scheduled nothing on prefill replica "
                                     f"{i} and no arrivals were left")
                    self._wake_all_decode()  # nothing more will come from this replica
                    return
                yield self._wait_idle("prefill", i)
                continue
            dt = step_time(batch.shape)
            step = env.timeout(dt)
            if self._fast_forward:  # a hand-off at its end may reserve blocks on a decode replica
                self._order_run_ends(range(len(self.decode.loops)), env.now + dt)
            yield step
            pool.busy_s[i] += dt
            loop.complete(batch, env.now)
            for s, _ in batch.items:
                if s.status is Status.FINISHED:
                    h = self._by_prefill[i].pop(s.req.id)
                    h.prefilled_s = env.now
                    self._in_flight += 1
                    self._holding[i] += 1
                    env.process(self._hand_off(h, batch.start))

    def _hand_off(self, h: Handoff, scheduled: float):
        """`scheduled`: when the prefill step that sampled its token was scheduled."""
        env, pool = self.env, self.decode
        self._scheduled = scheduled
        j = h.decode_replica = pool.route(h.req, env.now)
        reserved = env.event()
        self._reserve_queue[j].append((h, reserved))
        self._reserve(j, scheduled)
        yield reserved
        link = self._links[j] if self.link.serialize else None
        if link is not None:
            slot = link.request()
            yield slot
        h.sending_s = env.now
        landing = env.timeout(self.link.transfer_s(h.req.prompt_len, self.kv_bytes_per_token))
        if self._fast_forward:
            self._order_run_ends((j,), env.now + self.link.transfer_s(h.req.prompt_len, self.kv_bytes_per_token))
        yield landing
        if link is not None:
            link.release(slot)
        h.landed_s = env.now
        self.prefill.loops[h.prefill_replica].release_kv(h.prefill)
        self._holding[h.prefill_replica] -= 1
        self._wake("prefill", h.prefill_replica)  # its freed blocks may admit a waiting prompt
        self._cut(j, h.sending_s)  # the request joins the running batch
        pool.loops[j].receive_remote_kv(h.decode, env.now)
        self._in_flight -= 1
        self._wake("decode", j)
        if self._upstream_done():  # the last transfer: idle decode replicas may now stop
            self._wake_all_decode()

    def _reserve(self, j: int, scheduled: float = _INF) -> None:
        """Give decode replica j's waiting transfers their blocks, first come first served
        (`scheduled`: when the event asking was scheduled, for a replica in a decode run)."""
        queue, loop = self._reserve_queue[j], self.decode.loops[j]
        run = self._runs[j]
        if run is not None and queue:
            run.settle(self.env.now, scheduled)
        while queue:
            h, reserved = queue[0]
            s = loop.reserve_remote_kv(h.req)
            if s is None:
                return
            queue.popleft()
            h.decode, h.reserved_s = s, self.env.now
            reserved.succeed()
            self._cut(j, scheduled)  # fewer free blocks: the run's plan may change

    def _decode_server(self, j: int):
        env, pool = self.env, self.decode
        loop, step_time = pool.loops[j], pool.cost.step_time
        while True:
            if self._stop():
                raise Stopped
            batch = loop.plan(env.now) if loop.has_work else None
            if batch is None:
                if self._upstream_done():
                    if loop.has_work:
                        self.stalled = True
                        loop.abandon(f"stalled: policy {loop.policy_name!r} scheduled nothing on decode replica "
                                     f"{j} and nothing more was to come")
                    return
                yield self._wait_idle("decode", j)
                continue
            if self._fast_forward and self._start_run(j, batch):
                run = self._runs[j]
                yield self._run_end[j]  # its last step's end, or (cut) the end of the step in flight
                run.finish()
                self._runs[j] = self._run_end[j] = None
                for dt in run.durations[:run.k]:
                    pool.busy_s[j] += dt
                loop.complete(batch, env.now)
            else:
                dt = step_time(batch.shape)
                yield env.timeout(dt)
                pool.busy_s[j] += dt
                loop.complete(batch, env.now)
            if self._reserve_queue[j]:
                self._reserve(j)  # finished requests (or preemptions) freed blocks

    # --- decode runs (testbed/sim/decode_runs.py) --------------------------------------------
    def _start_run(self, j: int, batch) -> bool:
        """Fast-forward decode replica j's steady decode batch, when it is one, up to its first finish."""
        loop, step_time = self.decode.loops[j], self.decode.cost.step_time
        durations = []

        def timed(shape) -> float:  # each step's time, for the pool's busy time
            dt = step_time(shape)
            durations.append(dt)
            return dt

        if not loop.extend_decode_run(batch, timed, _INF, self._horizon, allocate=False):
            return False
        if not deferrable(batch):
            batch.ends = None
            loop.series.steps[-1] = 1
            return False
        self._runs[j] = StepwiseRun(loop, batch, durations)
        self._run_end[j] = self.env.timeout(batch.ends[-1] - self.env.now)
        return True

    def _settle(self, j: int) -> None:
        """Before the router reads decode replica j's KV cache (in a hand-off)."""
        run = self._runs[j]
        if run is not None:
            run.settle(self.env.now, self._scheduled)

    def _cut(self, j: int, scheduled: float) -> None:
        run = self._runs[j]
        if run is not None and run.cut_at(self.env.now, scheduled):
            self._run_end[j] = moved_timeout(self.env, self._run_end[j], run.ends[-1])

    def _order_run_ends(self, replicas, at: float) -> None:
        """An event for time `at` was just scheduled: a decode run ending then whose last step was
        scheduled no earlier ended after it when each step was an event of its own."""
        now = self.env.now
        for j in replicas:
            run = self._runs[j]
            if run is not None and run.ends_after(at, now):
                self._run_end[j] = moved_timeout(self.env, self._run_end[j], at)

    @property
    def _horizon(self) -> float:
        return self.horizon_s if self.horizon_s is not None else _INF

    # --- helpers ------------------------------------------------------------------------
    def _upstream_done(self) -> bool:
        return (self._arrivals_done and self._in_flight == 0
                and not any(loop.has_work for loop in self.prefill.loops))

    def _wait_idle(self, pool: str, i: int) -> simpy.Event:
        ev = self._idle[(pool, i)] = self.env.event()
        return ev

    def _wake(self, pool: str, i: int) -> None:
        ev = self._idle.pop((pool, i), None)
        if ev is not None:
            ev.succeed()

    def _wake_all_decode(self) -> None:
        for j in range(len(self.decode.loops)):
            self._wake("decode", j)
