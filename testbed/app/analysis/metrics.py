"""SLO metrics, computed identically for simulated and real runs.

Names follow vLLM's `benchmark_serving` (`mean_ttft_ms`, `p99_tpot_ms`,
`request_goodput`, ...) so figures compare directly with published vLLM numbers.
Definitions: TTFT = first token - arrival; TPOT = (E2E - TTFT) / (output - 1), only for
outputs longer than one token; ITL = every gap between consecutive tokens of a request;
E2EL = finish - arrival; queueing = first scheduled - arrival. The run's duration is
from the first arrival to the last finish, as vLLM times a benchmark. A request is
*good* when it finished and met every SLO threshold that is set; goodput is good
requests per second, SLO attainment is good requests over all requests of the trace
(rejected and unfinished ones count as misses, as in DistServe).

Every time without a prefix is the client's, measured from the request's arrival at the server,
as vLLM's `benchmark_serving` measures it: it includes the HTTP/API front end when one is
modelled (`testbed.app.assembly.frontend`), and the SLO checks use it. The `engine_` figures are the
engine's own, measured from the request's arrival in the engine's queue; with `frontend=none`
the two are equal.
"""
from __future__ import annotations

import math
from array import array
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from testbed.app.assembly.frontend import ClientClock
from testbed.core.loop import TOO_LONG
from testbed.core.request import Outcome, Request, RequestState, Status
from testbed.core.bounds import bounded, check_ranges

if TYPE_CHECKING:  # pandas is imported by the functions that build tables: the config schemas (SLO) need none
    import pandas as pd

PERCENTILES = (50, 90, 99)


@dataclass
class SLO:
    """Per-request thresholds (None = not checked) and the run-level percentile check."""

    name: str = "none"
    ttft_ms: float | None = bounded(None, gt=0)
    tpot_ms: float | None = bounded(None, gt=0)
    e2el_ms: float | None = bounded(None, gt=0)
    percentile: float = bounded(99.0, gt=0, le=100)  # MLPerf-style pass/fail: p<percentile> of each metric under its threshold
    attainment_target: float = bounded(0.9, gt=0, le=1)  # fraction of good requests a load level must reach (DistServe)

    def validate(self) -> None:
        check_ranges(self, "slo")


def outcome_of(s: RequestState) -> Outcome:
    if s.status is Status.FINISHED:
        return Outcome.FINISHED
    if s.status is Status.REJECTED:
        return Outcome.REJECTED
    return Outcome.UNFINISHED


def request_table(states: list[tuple[int, RequestState]], not_arrived: list[Request],
                  load_rejects: list[tuple[int, str, str]] = (),
                  not_arrived_reason: str = "arrives after the horizon",
                  clock: ClientClock | None = None, reasons: dict[int, str] | None = None) -> pd.DataFrame:
    """One row per trace row: served states (with their replica), never-arrived requests,
    and rows the loader rejected (id, source, reason).

    The states' requests carry their arrival in the engine's queue; `clock` gives each one's
    arrival at the server and the front end's delays after the engine (None: no front end).
    `ttft_ms`, `tpot_ms`, `e2el_ms` and `queue_ms` are the client's; the `engine_` columns the
    engine's; `first_scheduled_s`, `first_token_s`, `finish_s` and `token_times` are engine times.
    `reasons` gives a never-arrived request its own reason (a closed-loop turn whose parent never
    finished) instead of `not_arrived_reason`.
    """
    import pandas as pd

    served = [s for _, s in states]
    n = len(served) + len(not_arrived) + len(load_rejects)
    if n == 0:
        return pd.DataFrame.from_records([], columns=list(TABLE_COLUMNS))
    parts = [_served_columns([replica for replica, _ in states], served, clock)] if served else []
    if not_arrived:
        parts.append(_not_arrived_columns(not_arrived, not_arrived_reason, clock, reasons))
    if load_rejects:
        parts.append(_rejected_columns(load_rejects))
    # the rows in id order (a stable sort, as pandas' sort_values(kind="stable") orders them)
    columns = {name: _joined([p[name] for p in parts]) for name in TABLE_COLUMNS}
    order = np.argsort(columns["id"], kind="stable")
    if (order[1:] < order[:-1]).any():
        columns = {name: values[order] for name, values in columns.items()}
    token_times = [s.token_times for s in served]
    if any(t is not None for t in token_times):
        cells = np.empty(n, dtype=object)  # filled one by one: lists must stay cells, not a second axis
        for i, t in enumerate(token_times):
            cells[i] = t
        columns["token_times"] = cells[order]
    return pd.DataFrame(columns)


TABLE_COLUMNS = ("id", "source", "replica", "arrival_s", "prompt_len", "output_len", "tenant", "priority",
                 "outcome", "reason", "generated", "preemptions", "prefix_hit_tokens", "first_scheduled_s",
                 "first_token_s", "finish_s", "queue_ms", "ttft_ms", "tpot_ms", "e2el_ms", "engine_arrival_s",
                 "frontend_delay_ms", "engine_queue_ms", "engine_ttft_ms", "engine_tpot_ms", "engine_e2el_ms")


def _joined(parts: list[np.ndarray]) -> np.ndarray:
    """One column from its parts. Each part is typed as pandas would type its values (ints: int64,
    any float: float64, strings: object), so joining types the column as pandas typed the rows."""
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def _strings(values: list) -> np.ndarray:
    out = np.empty(len(values), dtype=object)
    out[:] = values
    return out


def _served_columns(replicas: list[int], served: list[RequestState], clock: ClientClock | None) -> dict:
    """The rows of requests that reached a loop, column by column (numpy's float arithmetic is
    Python's, operation for operation, so each cell is what a per-row loop computes)."""
    reqs = [s.req for s in served]
    engine_arrival = np.array([r.arrival for r in reqs])
    arrival = np.array([clock.arrival_s[r.id] for r in reqs]) if clock is not None else engine_arrival
    token_s, tail_s = (clock.output_token_s, clock.tail_s) if clock is not None else (0.0, 0.0)
    finished = np.array([s.status is Status.FINISHED for s in served], dtype=bool)
    output_len = np.array([r.output_len for r in reqs])
    first_scheduled = np.array([s.first_scheduled for s in served], dtype=float)
    first_token = np.array([s.first_token_time for s in served], dtype=float)
    finish = np.array([s.finish_time for s in served], dtype=float)
    cols = {
        "id": np.array([r.id for r in reqs]), "source": _strings([r.source for r in reqs]),
        "replica": np.array(replicas), "arrival_s": arrival, "prompt_len": np.array([r.prompt_len for r in reqs]),
        "output_len": output_len, "tenant": _strings([r.tenant for r in reqs]),
        "priority": np.array([r.priority for r in reqs]),
        "outcome": _strings([outcome_of(s).value for s in served]),
        "reason": _strings([s.reject_reason for s in served]),
        "generated": np.array([s.num_generated for s in served]),
        "preemptions": np.array([s.num_preemptions for s in served]),
        "prefix_hit_tokens": np.array([s.prefix_hit_tokens for s in served]),
        "first_scheduled_s": np.where(first_scheduled >= 0, first_scheduled, math.nan),
        "first_token_s": np.where(first_token >= 0, first_token, math.nan),
        "finish_s": np.where(finished & (finish >= 0), finish, math.nan),
        "engine_arrival_s": engine_arrival, "frontend_delay_ms": (engine_arrival - arrival) * 1e3}
    times = (first_scheduled, first_token, finish, finished, output_len)
    for prefix, since, token, tail in (("", arrival, token_s, tail_s), ("engine_", engine_arrival, 0.0, 0.0)):
        for key, values in zip(("queue_ms", "ttft_ms", "tpot_ms", "e2el_ms"), _latency_columns(*times, since, token, tail)):
            cols[prefix + key] = values
    return cols


def _latency_columns(first_scheduled: np.ndarray, first_token: np.ndarray, finish: np.ndarray, finished: np.ndarray,
                     output_len: np.ndarray, arrival: np.ndarray, token_s: float, tail_s: float
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(queue, TTFT, TPOT, E2EL) in ms from `arrival`, each token delivered `token_s` after the engine
    made it and the response ended `tail_s` after the engine finished (both 0: the engine's own)."""
    with np.errstate(invalid="ignore", divide="ignore"):  # the rows np.where leaves NaN
        queue = np.where(first_scheduled >= 0, (first_scheduled - arrival) * 1e3, math.nan)
        ttft = np.where(first_token >= 0, (first_token - arrival + token_s) * 1e3, math.nan)
        e2el = np.where(finished, (finish - arrival + tail_s) * 1e3, math.nan)
        tpot = np.where(finished & (output_len > 1), (e2el - ttft) / (output_len - 1), math.nan)
    return queue, ttft, tpot, e2el


def _not_arrived_columns(not_arrived: list[Request], reason: str, clock: ClientClock | None,
                         reasons: dict[int, str] | None) -> dict:
    n = len(not_arrived)
    engine_arrival = np.array([r.arrival for r in not_arrived])
    arrival = np.array([clock.arrival_s[r.id] for r in not_arrived]) if clock is not None else engine_arrival
    nan, zero = np.full(n, math.nan), np.zeros(n, dtype=np.int64)
    return {"id": np.array([r.id for r in not_arrived]), "source": _strings([r.source for r in not_arrived]),
            "replica": np.full(n, -1), "arrival_s": arrival,
            "prompt_len": np.array([r.prompt_len for r in not_arrived]),
            "output_len": np.array([r.output_len for r in not_arrived]),
            "tenant": _strings([r.tenant for r in not_arrived]),
            "priority": np.array([r.priority for r in not_arrived]),
            "outcome": _strings([Outcome.UNFINISHED.value] * n),
            "reason": _strings([reasons.get(r.id, reason) for r in not_arrived] if reasons else [reason] * n),
            "generated": zero, "preemptions": zero, "prefix_hit_tokens": zero,
            "first_scheduled_s": nan, "first_token_s": nan, "finish_s": nan,
            "queue_ms": nan, "ttft_ms": nan, "tpot_ms": nan, "e2el_ms": nan,
            "engine_arrival_s": engine_arrival, "frontend_delay_ms": (engine_arrival - arrival) * 1e3,
            "engine_queue_ms": nan, "engine_ttft_ms": nan, "engine_tpot_ms": nan, "engine_e2el_ms": nan}


def _rejected_columns(load_rejects: list[tuple[int, str, str]]) -> dict:
    n = len(load_rejects)
    nan, zero, minus_one = np.full(n, math.nan), np.zeros(n, dtype=np.int64), np.full(n, -1)
    cols = dict.fromkeys(TABLE_COLUMNS, nan)
    cols.update(id=np.array([rid for rid, _, _ in load_rejects]), source=_strings([src for _, src, _ in load_rejects]),
                replica=minus_one, prompt_len=minus_one, output_len=minus_one, tenant=_strings([""] * n),
                priority=zero, outcome=_strings([Outcome.REJECTED.value] * n),
                reason=_strings([why for _, _, why in load_rejects]), generated=zero, preemptions=zero,
                prefix_hit_tokens=zero)
    return cols


def _stats(prefix: str, values: np.ndarray, out: dict, key_prefix: str = "", scratch: bool = False) -> None:
    """Mean, median, std and PERCENTILES of the non-NaN `values`. `scratch`: the inter-token gaps, the
    caller's own array (millions of values, read by nobody afterwards): without NaNs it is sorted in
    place instead of copied, and its figures are taken over the sorted gaps. The order in which a run
    records gaps is not a result (a fast-forwarded run appends each request's gaps of several steps
    together, step-by-step planning one step's at a time, and event cutting chooses which), but a
    float sum depends on its order: summed in ascending order, the mean and std depend only on the
    gaps themselves. (Decided once, in issue 15; it moved the last digit of some runs' ITL mean/std.)"""
    in_place = scratch and _no_nan(values)
    if not in_place:
        values = values[~np.isnan(values)]
    if scratch:
        values.sort()
    if values.size == 0:
        for k in ("mean", "median", "std", *(f"p{p}" for p in PERCENTILES)):
            out[f"{key_prefix}{k}_{prefix}_ms"] = None
        return
    mean, std = float(values.mean()), float(_std(values))
    out[f"{key_prefix}mean_{prefix}_ms"] = mean
    out[f"{key_prefix}median_{prefix}_ms"] = float(np.median(values, overwrite_input=in_place))
    out[f"{key_prefix}std_{prefix}_ms"] = std
    for p, v in zip(PERCENTILES, np.percentile(values, PERCENTILES, overwrite_input=in_place)):
        out[f"{key_prefix}p{p}_{prefix}_ms"] = float(v)


_STD_LEAF = 1 << 16  # values squared at a time by _std: 512 KiB of scratch


def _std(values: np.ndarray) -> float:
    """`values.std()` (a 1-D float64 array) without numpy's temporary as large as `values`: the squared
    deviations are summed in numpy's own pairwise order, one slice at a time. numpy sums a contiguous
    float64 array pairwise over its whole length, splitting it in halves rounded down to a multiple of
    8 (numpy/_core/src/umath/loops_utils.h.src, `pairwise_sum`); following the same splits down to
    slices of at most _STD_LEAF values, and summing each slice with numpy, adds the same numbers in
    the same order, so the result is numpy's to the bit (tests/test_results_building.py checks it)."""
    n = values.size
    if n <= _STD_LEAF:
        return values.std()
    mean = np.add.reduce(values) / n  # numpy's _var: the sum, then divided by the count

    def squared_deviations(lo: int, count: int) -> float:
        if count <= _STD_LEAF:
            d = np.subtract(values[lo:lo + count], mean)
            return np.add.reduce(np.square(d, out=d))
        half = count // 2
        half -= half % 8
        return squared_deviations(lo, half) + squared_deviations(lo + half, count - half)

    return np.sqrt(squared_deviations(0, n) / n)


def _no_nan(values: np.ndarray) -> bool:
    """No NaN in `values`, found without a mask as large as they are: a NaN anywhere makes the sum NaN."""
    return not math.isnan(np.add.reduce(values))


def gaps_ms(itl_s) -> np.ndarray:
    """Every inter-token gap in ms, in one new array: `itl_s` is one array of gaps in seconds, or a list
    of them (one per loop: `array('d')`, lists or arrays), multiplied into place without joining them first."""
    parts = [itl_s] if isinstance(itl_s, (np.ndarray, array)) else list(itl_s)
    return _joined_ms(parts)


def take_itl_ms(loops: list) -> np.ndarray:
    """Every inter-token gap of `loops` in ms, taken from them when they are done (each is left an
    empty `itl`): a loop's own `array('d')` is scaled where it lies, so one loop's gaps are never
    copied, and several are joined into one array, each part freed once copied."""
    parts = []
    for loop in loops:
        parts.append(loop.itl)
        loop.itl = array("d") if isinstance(loop.itl, array) else []
    if len(parts) == 1 and isinstance(parts[0], array):
        ms = np.frombuffer(parts.pop(), dtype=float)
        return np.multiply(ms, 1e3, out=ms)
    return _joined_ms(parts, release=True)


def _joined_ms(parts: list, release: bool = False) -> np.ndarray:
    """The parts' seconds times 1e3, one after another in one array; `release`: each part is dropped
    from `parts` once copied, so that no more than one is held beside the result."""
    ms = np.empty(sum(len(p) for p in parts))
    start = 0
    for i, part in enumerate(parts):
        if release:
            parts[i] = None
        part = np.asarray(part, dtype=float)
        np.multiply(part, 1e3, out=ms[start:start + len(part)])
        start += len(part)
    return ms


def good_mask(df: pd.DataFrame, slo: SLO) -> np.ndarray:
    good = (df["outcome"] == Outcome.FINISHED.value).to_numpy().copy()
    if slo.ttft_ms is not None:
        good &= (df["ttft_ms"] <= slo.ttft_ms).to_numpy()
    if slo.tpot_ms is not None:  # a one-token output has no TPOT and cannot miss it
        tpot = df["tpot_ms"].to_numpy()
        good &= np.isnan(tpot) | (tpot <= slo.tpot_ms)
    if slo.e2el_ms is not None:
        good &= (df["e2el_ms"] <= slo.e2el_ms).to_numpy()
    return good


def summarize(df: pd.DataFrame, itl_s, slo: SLO, prefix_cache: tuple[int, int] | None = None,
              response_tail_s: float = 0.0, itl_ms: np.ndarray | None = None) -> dict:
    """The run's summary, keyed by vLLM's benchmark names (the client's figures), with the engine's
    own latencies beside them as `engine_<name>`.

    `itl_s`: every inter-token gap in seconds, one array or one per loop (see `gaps_ms`); or None and
    `itl_ms` the gaps in ms, an array the summary may reorder (`take_itl_ms`: no copy of millions of gaps).
    `prefix_cache` is (hit tokens, queried tokens) over every admission, re-admissions after
    preemption included: vLLM's prefix cache hit rate. Without it, hits over prompt tokens.
    `response_tail_s` is how long after the engine's finish the client sees the response end
    (`ClientClock.tail_s`): the run's duration ends there, as the client times it.
    """
    done = df[df["outcome"] == Outcome.FINISHED.value]
    counts = df["outcome"].value_counts()
    out: dict = {
        "num_requests": int(len(df)),
        "completed": int(counts.get(Outcome.FINISHED.value, 0)),
        "rejected": int(counts.get(Outcome.REJECTED.value, 0)),
        "unfinished": int(counts.get(Outcome.UNFINISHED.value, 0)),
        "reject_reasons": dict(sorted(Counter(_reason_kind(r) for r in df.loc[df["outcome"] == "rejected", "reason"]).items())),
        "num_preemptions": int(df["preemptions"].sum()),
    }
    duration = float(done["finish_s"].max() + response_tail_s - df["arrival_s"].min()) if len(done) else 0.0
    out["duration_s"] = duration
    arrivals = df["arrival_s"].dropna()
    span = float(arrivals.max() - arrivals.min()) if len(arrivals) > 1 else 0.0
    out["offered_request_rate"] = (len(arrivals) - 1) / span if span > 0 else 0.0  # the load: arrivals per second
    out["total_input_tokens"] = int(done["prompt_len"].sum())
    out["total_output_tokens"] = int(done["output_len"].sum())
    hits, queried = prefix_cache or (df["prefix_hit_tokens"].sum(), df.loc[df["prompt_len"] > 0, "prompt_len"].sum())
    out["prefix_cache_hit_rate"] = float(hits / queried) if queried else 0.0
    rate = (lambda x: x / duration) if duration > 0 else (lambda x: 0.0)
    out["request_throughput"] = rate(out["completed"])
    out["output_throughput"] = rate(out["total_output_tokens"])
    out["total_token_throughput"] = rate(out["total_input_tokens"] + out["total_output_tokens"])
    _stats("ttft", done["ttft_ms"].to_numpy(float), out)
    _stats("tpot", done["tpot_ms"].to_numpy(float), out)
    _stats("itl", gaps_ms(itl_s) if itl_ms is None else itl_ms, out, scratch=True)
    _stats("e2el", done["e2el_ms"].to_numpy(float), out)
    _stats("queue", done["queue_ms"].to_numpy(float), out)
    for key in ("ttft", "tpot", "e2el", "queue"):  # ITL: every token is delayed alike, so the gaps are the client's
        _stats(key, done[f"engine_{key}_ms"].to_numpy(float), out, key_prefix="engine_")
    out["mean_frontend_delay_ms"] = float(done["frontend_delay_ms"].mean()) if len(done) else None
    good = good_mask(df, slo)
    out["slo"] = slo.name
    out["slo_percentile"] = slo.percentile
    out["good_requests"] = int(good.sum())
    out["request_goodput"] = rate(int(good.sum()))
    out["slo_attainment"] = float(good.mean()) if len(df) else 0.0
    out["slo_attainment_met"] = bool(out["slo_attainment"] >= slo.attainment_target)
    checks = {}
    for key in ("ttft", "tpot", "e2el"):
        limit = getattr(slo, f"{key}_ms")
        if limit is not None:
            col = done[f"{key}_ms"].to_numpy(float)
            col = col[~np.isnan(col)]
            value = float(np.percentile(col, slo.percentile)) if col.size else math.inf
            checks[f"p{slo.percentile:g}_{key}_ms<={limit:g}"] = bool(value <= limit)
    if checks:  # a request longer than the context could never be served: vLLM refuses it too (HTTP 400), not counted
        checks["every_request_completed"] = out["completed"] == len(df) - out["reject_reasons"].get(TOO_LONG, 0)
    out["slo_checks"] = checks
    out["slo_pass"] = bool(checks) and all(checks.values())
    return out


def _reason_kind(reason: str) -> str:
    return reason.split(":", 1)[0] if reason else "unknown"
