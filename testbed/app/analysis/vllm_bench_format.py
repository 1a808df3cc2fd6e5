"""A run's results in `vllm bench serve --save-result --save-detailed`'s own keys and meanings.

Why: a researcher who has `vllm bench serve` results and scripts that read them should be able to put a
simulated run beside a real one without translating by hand. Every run writes `vllm_bench.json`
(`write_vllm_bench`), a superset of the keys vLLM 0.32 writes (vllm/benchmarks/serve.py: L2254-2290 the
run's arguments, L1280-1301 the results, L1366-1391 the statistics, L2380-2394 the per-request arrays that
only `--save-detailed` keeps); and a real file is read with its keys checked (`read_result`).

What each key means in a simulated run (a replay on the engine or on vLLM alike, from its client times):

- date: when the file was written, vLLM's format (%Y%m%d-%H%M%S): the one key that differs between two
  runs of the same config (summary.json stays deterministic).
- endpoint_type, backend: vLLM's `--backend`, the client's request function: "openai" (its default, the
  completions API of the server the `frontend` models), or the replayed run's. Not the testbed's backend,
  which is `testbed_backend` (sim, engine or vllm).
- label: "testbed-<backend>: <policy> on <trace>". model_id, tokenizer_id: the model config's `hf_id`
  (its name where it has none).
- num_prompts: the trace's rows. request_rate: the replayed run's, or the trace's arrivals per second
  (its summary's offered_request_rate; "inf" when all arrive at once, as vLLM writes it).
  burstiness: the replayed run's, or the Gamma shape with the trace's inter-arrival CV (1/CV^2; 1 for
  Poisson arrivals; None under three arrivals). max_concurrency: None (the replay is open-loop).
- duration: from the benchmark's start (the first arrival, or 0 for a replayed `vllm bench serve` run, which
  starts its clock before the first gap) to the last response's end. completed: finished requests;
  failed: the rest (rejected or unfinished at the horizon), each with its reason in `errors`.
- total_input_tokens, total_output_tokens, *_throughput, request_goodput: vLLM's, over completed requests
  and `duration`; request_goodput is None without an SLO (`slo=none`), as without `--goodput`.
- input_lens (every request), output_lens (0 for a failed one), ttfts, latencies (seconds, 0 for a failed
  one), itls (seconds, per request: the gaps between its tokens, [] where the run did not record token
  times: output.record_token_times=false), start_times (the arrival at the server, simulated seconds),
  queue_times (0: no client-side semaphore), generated_texts ("": no text is generated), errors.
- max_output_tokens_per_s, max_concurrent_requests: vLLM's per-second buckets (serve.py L686-724), from
  each token's time, or, where token times were not recorded (`testbed_token_times` false), from tokens
  spread evenly between a request's first token and its end. rtfx: 0 (no audio).
- tensor_parallel_size, pipeline_parallel_size: the run's, as `vllm bench sweep` adds the server's settings
  (vllm/benchmarks/sweep/serve.py L54-63; sweep/plot_pareto.py L77-78 counts a run's GPUs from them).
- mean/median/std/p50/p90/p99 of ttft_ms, tpot_ms, itl_ms, e2el_ms: the summary's (the same definitions,
  numpy's percentiles as vLLM's); 0 where there are no values, as vLLM's `np.mean(x or 0)` gives.
"""
from __future__ import annotations

import json
import math
from datetime import datetime
from pathlib import Path

import numpy as np

METRICS = ("ttft", "tpot", "itl", "e2el")
STATS = ("mean", "median", "std", "p50", "p90", "p99")

# every key vLLM 0.32 writes for a generation benchmark with --save-result --save-detailed, and its type
# (serve.py L2254-2290, L1280-1301, L1385-1391 with the default --metric-percentiles 99); e2el's statistics
# only with --percentile-metrics naming it (default ttft,tpot,itl: L2207)
NUMBER, INT, STR, NONE, LIST = "number", "int", "str", "null", "list"
VLLM_KEYS: dict[str, tuple[str, ...]] = {
    "date": (STR,), "endpoint_type": (STR,), "backend": (STR,), "label": (STR, NONE), "model_id": (STR,),
    "tokenizer_id": (STR, NONE), "num_prompts": (INT,), "request_rate": (NUMBER, STR), "burstiness": (NUMBER,),
    "max_concurrency": (INT, NONE), "duration": (NUMBER,), "completed": (INT,), "failed": (INT,),
    "total_input_tokens": (INT,), "total_output_tokens": (INT,), "request_throughput": (NUMBER,),
    "request_goodput": (NUMBER, NONE), "output_throughput": (NUMBER,), "total_token_throughput": (NUMBER,),
    "input_lens": (LIST,), "output_lens": (LIST,), "ttfts": (LIST,), "itls": (LIST,), "latencies": (LIST,),
    "start_times": (LIST,), "queue_times": (LIST,), "generated_texts": (LIST,), "errors": (LIST,),
    "max_output_tokens_per_s": (NUMBER,), "max_concurrent_requests": (INT,), "rtfx": (NUMBER,),
    **{f"{s}_{m}_ms": (NUMBER,) for m in ("ttft", "tpot", "itl") for s in ("mean", "median", "std", "p99")},
}
DETAILED = ("input_lens", "output_lens", "start_times", "ttfts", "itls", "generated_texts", "errors")  # L2380-2394
# what a replay needs of a real file; every other key is checked for its type where present
REQUIRED = ("model_id", "num_prompts", "request_rate", "burstiness", "duration", "completed")


class BenchResultError(ValueError):
    """A `vllm bench serve` result file that cannot be read as one: the message names the file and key."""


def _kind(value) -> str:
    if value is None:
        return NONE
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return INT
    if isinstance(value, float):
        return NUMBER
    if isinstance(value, str):
        return STR
    if isinstance(value, list):
        return LIST
    return type(value).__name__


def _fits(value, kinds: tuple[str, ...]) -> bool:
    kind = _kind(value)
    return kind in kinds or (kind == INT and NUMBER in kinds)


def check_result(data, where: str) -> dict:
    """`data` if it reads as a `vllm bench serve` result, else BenchResultError naming the key and rule."""
    if isinstance(data, list) and len(data) == 1:  # --append-result writes one object per line; json.load reads one
        data = data[0]
    if not isinstance(data, dict):
        raise BenchResultError(f"{where}: expected one JSON object (a `vllm bench serve --save-result` file), "
                               f"got {_kind(data)}")
    for key in REQUIRED:
        if key not in data:
            raise BenchResultError(f"{where}: key {key!r} is missing (`vllm bench serve --save-result` writes it)")
    for key, kinds in VLLM_KEYS.items():
        if key in data and not _fits(data[key], kinds):
            raise BenchResultError(f"{where}: key {key!r} must be {' or '.join(kinds)}, got {_kind(data[key])} "
                                   f"{data[key]!r:.40}")
    for key in (k for k in data if k.endswith("_ms") and k.split("_", 1)[0] in (*STATS, "p95", "p999")):
        if not _fits(data[key], (NUMBER,)):
            raise BenchResultError(f"{where}: key {key!r} must be number, got {_kind(data[key])} {data[key]!r:.40}")
    if isinstance(data["request_rate"], str) and data["request_rate"] != "inf":
        raise BenchResultError(f"{where}: key 'request_rate' must be a number or \"inf\", got {data['request_rate']!r}")
    n = data["num_prompts"]
    for key in DETAILED:
        if key in data and len(data[key]) != n:
            raise BenchResultError(f"{where}: key {key!r} has {len(data[key])} entries for num_prompts={n}")
    for key in ("input_lens", "output_lens"):
        if key in data and not all(_kind(v) == INT and v >= 0 for v in data[key]):
            raise BenchResultError(f"{where}: key {key!r} must hold non-negative integers")
    return data


def read_result(path: str | Path) -> dict:
    """A `vllm bench serve` result file, checked (BenchResultError, one line, for anything it cannot be)."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise BenchResultError(f"{path}: cannot be read ({e.strerror or e})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        lines = [line for line in text.splitlines() if line.strip()]
        if len(lines) > 1:  # --append-result: one run per line, the last one taken only when asked
            raise BenchResultError(f"{path}: holds {len(lines)} appended results (--append-result); "
                                   "save the one to replay in a file of its own") from None
        raise BenchResultError(f"{path}: not JSON ({e.msg} at line {e.lineno})") from None
    return check_result(data, str(path))


def peak_per_second(starts: np.ndarray, token_times: np.ndarray, latencies: np.ndarray) -> tuple[float, int]:
    """(max_output_tokens_per_s, max_concurrent_requests) over successful requests (`starts`, `latencies`:
    one per request; `token_times`: every token of theirs, joined): vLLM's one-second buckets from the first
    send (vllm/benchmarks/serve.py L686-724), counted at once instead of token by token."""
    if not len(starts):
        return 0.0, 0
    t0, n = _first_bucket(starts, latencies)
    buckets = (token_times - t0).astype(np.int64)  # int(): toward zero, as vLLM's int(token_time - t0)
    tokens = np.bincount(buckets[(token_times - t0 > -1) & (buckets < n)].clip(0), minlength=n)
    return float(tokens[:n].max()), _peak_concurrency(starts, latencies, t0, n)


def _first_bucket(starts: np.ndarray, latencies: np.ndarray) -> tuple[float, int]:
    """The buckets' origin (the first send) and how many there are (to the last response's end)."""
    t0 = starts.min()
    return t0, int(np.ceil((starts + latencies).max() - t0)) + 1


def _peak_concurrency(starts: np.ndarray, latencies: np.ndarray, t0: float, n: int) -> int:
    # each request counts in every bucket from int(start - t0) to int(end - t0), both included
    steps = np.zeros(n + 1, dtype=np.int64)
    np.add.at(steps, (starts - t0).astype(np.int64), 1)
    np.add.at(steps, (starts + latencies - t0).astype(np.int64) + 1, -1)
    return int(np.cumsum(steps)[:n].max())


def _even_token_times(first: np.ndarray, step: np.ndarray, k: np.ndarray) -> np.ndarray:
    """Every token's time where token times were not recorded: request j's i-th at first[j] + i * step[j]."""
    index = np.arange(k.sum()) - np.repeat(np.cumsum(k) - k, k)
    return np.repeat(first, k) + index * np.repeat(step, k)


def peak_of_even_tokens(starts: np.ndarray, latencies: np.ndarray, first: np.ndarray, step: np.ndarray,
                        k: np.ndarray) -> tuple[float, int]:
    """`peak_per_second(starts, _even_token_times(first, step, k), latencies)`, the same two numbers, without
    making a time for each of the millions of tokens (`_even_token_buckets`)."""
    if not len(starts):
        return 0.0, 0
    t0, n = _first_bucket(starts, latencies)
    has = k > 0
    first, step, k = first[has], step[has], k[has].astype(np.int64)
    tokens = _even_token_buckets(t0, n, first, step, k)
    if tokens is None:
        return peak_per_second(starts, _even_token_times(first, step, k), latencies)
    return float(tokens[:n].max()), _peak_concurrency(starts, latencies, t0, n)


def _even_token_buckets(t0: float, n: int, first: np.ndarray, step: np.ndarray, k: np.ndarray) -> np.ndarray | None:
    """Tokens per one-second bucket from `t0` (n buckets) of `_even_token_times(first, step, k)` (k >= 1 each),
    as peak_per_second counts them, or None where a time could fall before `t0` or is not finite. A request's
    token times rise with i (step >= 0), so its tokens in a bucket are a run of i: only where each run ends is
    found, by the float operations that make each time (an estimate, moved to the first i at or past the
    bucket's edge where rounding decides)."""
    def offset(j: np.ndarray, i: np.ndarray) -> np.ndarray:  # token i of request j, from t0: as _even_token_times
        return (first[j] + i * step[j]) - t0

    everyone = np.arange(len(k))
    lo, hi = offset(everyone, np.zeros(len(k), dtype=np.int64)), offset(everyone, k - 1)
    if not (np.isfinite(lo).all() and np.isfinite(hi).all() and (step >= 0).all() and (lo >= 0).all()):
        return None
    lo, hi = lo.astype(np.int64), hi.astype(np.int64)  # each request's first and last bucket
    edges = hi - lo  # bucket edges inside each request's span
    j = np.repeat(everyone, edges)
    edge = np.repeat(lo + 1, edges) + (np.arange(edges.sum()) - np.repeat(np.cumsum(edges) - edges, edges))
    with np.errstate(divide="ignore", invalid="ignore"):  # (an edge lies inside a span only where step > 0)
        guess = np.ceil((edge + t0 - first[j]) / step[j])
    i = np.clip(np.nan_to_num(guess), 0, k[j]).astype(np.int64)
    for _ in range(64):  # off by a token or two, where rounding decides
        back = (i > 0) & (offset(j, np.maximum(i - 1, 0)) >= edge)
        ahead = (i < k[j]) & (offset(j, np.minimum(i, k[j] - 1)) < edge)
        if not (back.any() or ahead.any()):
            break
        i = i - back + ahead
    else:
        return None
    # a request's runs, buckets lo to hi: each ends at its edge's i, the last at k
    runs = edges + 1
    at = np.cumsum(runs) - runs  # where each request's runs start in the joined list
    last = at + runs - 1
    ends = np.empty(runs.sum(), dtype=np.int64)
    ends[last] = k
    inner = np.ones(len(ends), dtype=bool)
    inner[last] = False
    ends[inner] = i
    begins = np.concatenate(([0], ends[:-1]))
    begins[at] = 0
    bucket = np.repeat(lo, runs) + (np.arange(len(ends)) - np.repeat(at, runs))
    keep = bucket < n
    return np.bincount(bucket[keep], weights=(ends - begins)[keep], minlength=n)


def _stat(summary: dict, key: str) -> float:
    value = summary.get(key)
    return 0.0 if value is None or (isinstance(value, float) and math.isnan(value)) else float(value)


def _burstiness(arrivals: np.ndarray) -> float | None:
    gaps = np.diff(np.sort(arrivals))
    if gaps.size < 2 or gaps.mean() <= 0:
        return None
    cv = gaps.std() / gaps.mean()
    return float("inf") if cv == 0 else float(1.0 / cv ** 2)


def bench_result(requests, summary: dict, model_id: str, *, backend: str = "openai", request_rate=None,
                 burstiness: float | None = None, start_s: float | None = None, date: str | None = None,
                 label: str | None = None) -> dict:
    """vLLM's result dict for a run: `requests` its per-request table (testbed.app.analysis.metrics.request_table),
    `summary` its summary. `request_rate`, `burstiness`, `start_s`, `backend` and `label`: a replayed run's (None:
    from the trace, see the module's docstring)."""
    df = requests
    finished = (df["outcome"] == "finished").to_numpy()
    arrival = df["arrival_s"].to_numpy(float)
    prompt = np.maximum(df["prompt_len"].to_numpy(), 0)
    output = df["output_len"].to_numpy()
    ttft = np.where(finished, df["ttft_ms"].to_numpy(float) / 1e3, 0.0)
    latency = np.where(finished, df["e2el_ms"].to_numpy(float) / 1e3, 0.0)
    recorded = "token_times" in df.columns and all(t is not None for t, f in zip(df["token_times"], finished) if f)
    ok = np.flatnonzero(finished)
    first = arrival[ok] + ttft[ok]
    itls = [[] for _ in range(len(df))]
    if recorded:  # each token at the client: its first token's time plus the engine's gaps since
        engine = [np.asarray(df["token_times"].iat[i], dtype=float) for i in ok]
        for i, times in zip(ok, engine):
            itls[i] = np.diff(times).tolist()
        token_times = np.concatenate([f + (t - t[0]) for f, t in zip(first, engine)]) if ok.size else np.empty(0)
        peak_tokens, peak_concurrent = peak_per_second(arrival[ok], token_times, latency[ok])
    else:  # spread evenly from the first token to the end
        k = output[ok].astype(np.int64)
        step = (latency[ok] - ttft[ok]) / np.maximum(k - 1, 1)
        peak_tokens, peak_concurrent = peak_of_even_tokens(arrival[ok], latency[ok], first, step, k)
    known = arrival[~np.isnan(arrival)]  # a row the loader rejected has no arrival
    start = start_s if start_s is not None else float(known.min()) if known.size else 0.0
    ends = arrival[ok] + latency[ok]
    duration = float(ends.max() - start) if ok.size else 0.0
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: 0.0)
    completed, total_in, total_out = int(ok.size), int(prompt[ok].sum()), int(output[ok].sum())
    if request_rate is None:
        rate = summary.get("offered_request_rate") or 0.0
        request_rate = rate if rate > 0 or len(df) < 2 else "inf"
    good = summary.get("good_requests")
    errors = [""] * len(df)  # the failed rows' only: a walk over every row's strings was a third of the file's time
    failed = np.flatnonzero(~finished)
    for i, o, r in zip(failed.tolist(), df["outcome"].iloc[failed], df["reason"].iloc[failed].fillna("")):
        errors[i] = f"{o}: {r}"
    result = {
        "date": date or datetime.now().strftime("%Y%m%d-%H%M%S"),
        "endpoint_type": backend, "backend": backend,
        "label": label or f"testbed-{summary.get('backend', 'sim')}: {summary.get('policy')} on {summary.get('trace')}",
        "model_id": model_id, "tokenizer_id": model_id, "num_prompts": int(len(df)),
        "request_rate": request_rate,
        "burstiness": burstiness if burstiness is not None else _burstiness(known),
        "max_concurrency": None,
        "duration": duration, "completed": completed, "failed": int(len(df) - completed),
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": per_s(completed),
        "request_goodput": per_s(good) if summary.get("slo", "none") != "none" and good is not None else None,
        "output_throughput": per_s(total_out), "total_token_throughput": per_s(total_in + total_out),
        "input_lens": prompt.astype(int).tolist(), "output_lens": np.where(finished, output, 0).astype(int).tolist(),
        "ttfts": ttft.tolist(), "itls": itls, "latencies": latency.tolist(), "start_times": arrival.tolist(),
        "queue_times": [0.0] * len(df), "generated_texts": [""] * len(df), "errors": errors,
        "max_output_tokens_per_s": peak_tokens, "max_concurrent_requests": peak_concurrent, "rtfx": 0.0,
    }
    for m in METRICS:
        for s in STATS:
            result[f"{s}_{m}_ms"] = _stat(summary, f"{s}_{m}_ms")
    for key in ("tensor_parallel_size", "pipeline_parallel_size"):  # as `vllm bench sweep` records the server's
        if key in summary:  # (plot_pareto.py L77-78 counts the GPUs from them)
            result[key] = summary[key]
    result["testbed_backend"] = summary.get("backend")
    result["testbed_token_times"] = bool(recorded)
    return result


def result_json(result: dict) -> str:
    """The file's text: JSON as vLLM's json.dump writes it, NaN as null (a float is never NaN in vLLM's).

    A run with no NaN or infinity anywhere (the common case) is dumped as it is: `allow_nan=False` is
    json's own scan for them, in C, and refuses the rest, which take the walk below; cleaning changes
    nothing in a result without NaN, so the text is the same either way (the walk was a third of
    writing the file: ~10^6 calls for the per-token gaps of the Azure conv trace)."""
    try:
        return json.dumps(result, allow_nan=False)
    except ValueError:
        pass

    def clean(x):
        if isinstance(x, float) and math.isnan(x):
            return None
        if isinstance(x, list):
            return [clean(v) for v in x]
        return x
    return json.dumps({k: clean(v) for k, v in result.items()})


def model_id(cfg) -> str:
    return cfg.model.get("hf_id") or cfg.model.name


def write_vllm_bench(out_dir: str | Path, requests, summary: dict, cfg, **replayed) -> Path:
    """`out_dir/vllm_bench.json` for a run (`replayed`: bench_result's keyword arguments of a replayed run)."""
    path = Path(out_dir) / "vllm_bench.json"
    path.write_text(result_json(bench_result(requests, summary, model_id(cfg), **replayed)))
    return path
