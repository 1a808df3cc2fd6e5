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
modelled (`testbed.app.frontend`), and the SLO checks use it. The `engine_` figures are the
engine's own, measured from the request's arrival in the engine's queue; with `frontend=none`
the two are equal.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import numpy as np
import pandas as pd

from testbed.app.frontend import ClientClock
from testbed.core.request import Outcome, Request, RequestState, Status
from testbed.core.bounds import bounded, check_ranges

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
    token_s, tail_s = (clock.output_token_s, clock.tail_s) if clock is not None else (0.0, 0.0)
    rows = []
    for replica, s in states:
        r = s.req
        arrival = clock.arrival_s[r.id] if clock is not None else r.arrival
        finished = s.status is Status.FINISHED
        engine = _latencies(s, r.arrival, finished, 0.0, 0.0)
        client = _latencies(s, arrival, finished, token_s, tail_s)
        rows.append((r.id, r.source, replica, arrival, r.prompt_len, r.output_len, r.tenant, r.priority,
                     outcome_of(s).value, s.reject_reason, s.num_generated, s.num_preemptions, s.prefix_hit_tokens,
                     _t(s.first_scheduled), _t(s.first_token_time), _t(s.finish_time if finished else -1.0),
                     *client, r.arrival, (r.arrival - arrival) * 1e3, *engine, s.token_times))
    nan4 = (math.nan,) * 4
    for r in not_arrived:
        arrival = clock.arrival_s[r.id] if clock is not None else r.arrival
        rows.append((r.id, r.source, -1, arrival, r.prompt_len, r.output_len, r.tenant, r.priority,
                     Outcome.UNFINISHED.value, reasons.get(r.id, not_arrived_reason) if reasons else not_arrived_reason,
                     0, 0, 0,
                     math.nan, math.nan, math.nan, *nan4, r.arrival, (r.arrival - arrival) * 1e3, *nan4, None))
    for rid, source, reason in load_rejects:
        rows.append((rid, source, -1, math.nan, -1, -1, "", 0, Outcome.REJECTED.value, reason, 0, 0, 0,
                     math.nan, math.nan, math.nan, *nan4, math.nan, math.nan, *nan4, None))
    cols = ["id", "source", "replica", "arrival_s", "prompt_len", "output_len", "tenant", "priority", "outcome",
            "reason", "generated", "preemptions", "prefix_hit_tokens", "first_scheduled_s", "first_token_s",
            "finish_s", "queue_ms", "ttft_ms", "tpot_ms", "e2el_ms", "engine_arrival_s", "frontend_delay_ms",
            "engine_queue_ms", "engine_ttft_ms", "engine_tpot_ms", "engine_e2el_ms", "token_times"]
    df = pd.DataFrame.from_records(rows, columns=cols).sort_values("id", kind="stable").reset_index(drop=True)
    if df["token_times"].isna().all():
        df = df.drop(columns="token_times")
    return df


def _latencies(s: RequestState, arrival: float, finished: bool, token_s: float, tail_s: float
               ) -> tuple[float, float, float, float]:
    """(queue, TTFT, TPOT, E2EL) in ms from `arrival`, each token delivered `token_s` after the engine
    made it and the response ended `tail_s` after the engine finished (both 0: the engine's own)."""
    r = s.req
    queue = (s.first_scheduled - arrival) * 1e3 if s.first_scheduled >= 0 else math.nan
    ttft = (s.first_token_time - arrival + token_s) * 1e3 if s.first_token_time >= 0 else math.nan
    e2el = (s.finish_time - arrival + tail_s) * 1e3 if finished else math.nan
    tpot = (e2el - ttft) / (r.output_len - 1) if finished and r.output_len > 1 else math.nan
    return queue, ttft, tpot, e2el


def _t(x: float) -> float:
    return x if x >= 0 else math.nan


def _stats(prefix: str, values: np.ndarray, out: dict, key_prefix: str = "") -> None:
    values = values[~np.isnan(values)]
    if values.size == 0:
        for k in ("mean", "median", "std", *(f"p{p}" for p in PERCENTILES)):
            out[f"{key_prefix}{k}_{prefix}_ms"] = None
        return
    out[f"{key_prefix}mean_{prefix}_ms"] = float(values.mean())
    out[f"{key_prefix}median_{prefix}_ms"] = float(np.median(values))
    out[f"{key_prefix}std_{prefix}_ms"] = float(values.std())
    for p, v in zip(PERCENTILES, np.percentile(values, PERCENTILES)):
        out[f"{key_prefix}p{p}_{prefix}_ms"] = float(v)


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


def summarize(df: pd.DataFrame, itl_s: np.ndarray, slo: SLO, prefix_cache: tuple[int, int] | None = None,
              response_tail_s: float = 0.0) -> dict:
    """The run's summary, keyed by vLLM's benchmark names (the client's figures), with the engine's
    own latencies beside them as `engine_<name>`.

    `prefix_cache` is (hit tokens, queried tokens) over every admission, re-admissions after
    preemption included: vLLM's prefix cache hit rate. Without it, hits over prompt tokens.
    `response_tail_s` is how long after the engine's finish the client sees the response end
    (`ClientClock.tail_s`): the run's duration ends there, as the client times it.
    """
    done = df[df["outcome"] == Outcome.FINISHED.value]
    counts = Counter(df["outcome"])
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
    _stats("itl", np.asarray(itl_s, float) * 1e3, out)
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
    if checks:
        checks["every_request_completed"] = out["completed"] == len(df)
    out["slo_checks"] = checks
    out["slo_pass"] = bool(checks) and all(checks.values())
    return out


def _reason_kind(reason: str) -> str:
    return reason.split(":", 1)[0] if reason else "unknown"
