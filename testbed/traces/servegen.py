"""Workloads generated from ServeGen's production distributions (Alibaba Bailian; Xiang et al., NSDI'26).

ServeGen (github.com/alibaba/ServeGen, Apache-2.0) publishes no requests, only per-client
statistics: for every 600-s window a client's request rate, the coefficient of variation of its
inter-arrival gaps and the Gamma or Weibull law fitted to them; for every 6-h window the
distributions of its lengths. A data folder (``data/<category>/<model>/`` upstream, e.g.
``data/language/m-large``) holds, per client ``<id>``, the files `servegen/clientpool.py`
(``ClientPool._load_data``) reads:

* ``chunk-<id>-trace.csv``, no header, one row per window:
  ``timestamp,rate,cv,pattern,shape,scale``: the window's start (s, every client the same
  starts), requests per second, the gaps' CV, ``Gamma`` / ``Weibull`` (empty with rate 0
  when the client is idle), and the law's shape and scale (scipy's ``gamma(a=shape)`` and
  ``weibull_min(c=shape)``);
* ``chunk-<id>-dataset.json``: ``{"<start s>": {"<field>": "<Python dict {value: probability}>"}}``;
  fields ``input_tokens``, ``output_tokens`` (language), plus ``reason_ratio`` (reason; not
  used here: the output length already counts the reasoning tokens), or ``text_tokens``,
  ``image_count``/``image_tokens``, ``audio_*``, ``video_*``, ``output_tokens`` (multimodal;
  a prompt is its text tokens plus one draw of ``<m>_tokens`` per counted item). An empty
  ``"{}"`` means no data for that window: the client's previous one still holds, as upstream.

Generation follows ServeGen's `servegen/construct.py` (``generate_workload``, ``_sample_iats``)
where it is sound and says where it departs:

* a client's arrivals in a window: its count, ``rate * window * rate_scale`` rounded up or
  down at random so that its mean is exact (upstream: ``ceil``, then the last arrival falls
  on the window's end and is dropped); gaps drawn from the fitted law and rescaled to fill
  the window, as upstream, so the fitted shape sets the burstiness (for a Gamma law its CV
  is ``1/sqrt(shape)``, the ``cv`` column; a fitted Weibull's need not equal the measured
  ``cv``);
* lengths: each field drawn independently from the window's distribution (upstream draws
  every field of a request with one shared uniform, which makes long prompts always get
  long outputs; the data give only the marginals). A 0-token draw becomes 1 (a request has
  a prompt and generates a token);
* seeding: each (client, window) draws from its own generator seeded by ``(seed, client,
  window start)``, so the same seed gives the same requests, and a window's requests do not
  depend on which other windows were generated.

Times are the data's own (s since its timestamp 0); the requests are sorted by time (ties by
client), numbered from 0, their tenant is ``client-<id>`` and their source
``servegen:<id>@<window start>``.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from testbed.core.request import Request
from testbed.traces.errors import TraceError
from testbed.traces.loaders import DATA_DIR

PATTERNS = ("Gamma", "Weibull")
TRACE_COLUMNS = ("timestamp", "rate", "cv", "pattern", "shape", "scale")
MODALITIES = ("image", "audio", "video")
_PAIR = re.compile(r"\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*:\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*(?:,|$)")


@dataclass(frozen=True)
class Window:
    """One client's arrival statistics over ``[start, start + size)`` s; pattern "" when idle."""

    start: int
    size: float
    rate: float
    cv: float
    pattern: str
    shape: float
    scale: float


@dataclass(frozen=True)
class Pmf:
    """A length distribution: integer `values` and their cumulative probabilities (last = 1)."""

    values: np.ndarray
    cdf: np.ndarray

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return self.values[np.minimum(np.searchsorted(self.cdf, rng.random(n), side="right"), len(self.values) - 1)]

    def mean(self) -> float:
        return float(np.dot(self.values, np.diff(self.cdf, prepend=0.0)))


@dataclass
class Client:
    id: int
    windows: list[Window]
    datasets: dict[int, dict[str, Pmf]] = field(default_factory=dict)  # window start -> field -> Pmf


@dataclass
class ServeGenData:
    """A ServeGen data folder as read: its clients (by id) and their common window starts."""

    folder: str
    clients: list[Client]
    starts: list[int]

    @property
    def category(self) -> str:
        fields = {f for c in self.clients for d in c.datasets.values() for f in d}
        return "multimodal" if "image_count" in fields else "reason" if "reason_ratio" in fields else "language"


# ----------------------------------------------------------------------------- reading

def resolve_servegen_path(path: str | Path) -> Path:
    """`path` as given if it is a folder; else, for a relative path, the bundled folder of that name."""
    p = Path(path).expanduser()
    if p.is_dir():
        return p
    if not p.is_absolute() and (DATA_DIR / p).is_dir():
        return DATA_DIR / p
    raise FileNotFoundError(f"ServeGen data folder {str(path)!r} not found, neither relative to the current "
                            f"directory ({Path.cwd()}) nor among the bundled data in {DATA_DIR} (trace.path: a folder "
                            f"such as ServeGen's data/language/m-large, with chunk-<id>-trace.csv and "
                            f"chunk-<id>-dataset.json per client)")


def read_servegen(folder: str | Path) -> ServeGenData:
    """Every client of a ServeGen data folder, checked; errors name the file, line (or window) and field."""
    root = Path(folder).expanduser()
    if not root.is_dir():
        raise FileNotFoundError(f"ServeGen data folder {str(folder)!r} not found (trace.path: a folder such as "
                                f"ServeGen's data/language/m-large, with chunk-<id>-trace.csv and chunk-<id>-dataset.json)")
    traces = {}
    for p in root.glob("chunk-*-trace.csv"):
        m = re.fullmatch(r"chunk-(\d+)-trace\.csv", p.name)
        if m:
            traces[int(m.group(1))] = p
    if not traces:
        raise FileNotFoundError(f"ServeGen data folder {str(root)!r} has no chunk-<id>-trace.csv files")
    clients, starts = [], None
    for cid in sorted(traces):
        windows = _read_windows(traces[cid])
        these = [w.start for w in windows]
        if starts is None:
            starts, first = these, traces[cid].name
        elif these != starts:
            raise TraceError(traces[cid].name, 1, "timestamp", f"the windows start at other times than {first}'s "
                             f"(ServeGen's clients share one window grid)")
        ds_path = root / f"chunk-{cid}-dataset.json"
        if not ds_path.is_file():
            raise FileNotFoundError(f"ServeGen client {cid}: {ds_path.name} is missing next to {traces[cid].name}")
        clients.append(Client(cid, windows, _read_datasets(ds_path)))
    return ServeGenData(str(root), clients, starts)


def _read_windows(path: Path) -> list[Window]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            cells = line.rstrip("\r\n").split(",")
            if len(cells) != len(TRACE_COLUMNS):
                raise TraceError(path.name, line_no, "<row>", f"{len(cells)} fields, expected {len(TRACE_COLUMNS)}: "
                                 f"{','.join(TRACE_COLUMNS)}")
            vals = {}
            for col, cell in zip(TRACE_COLUMNS, cells):
                if col == "pattern":
                    if cell not in ("", *PATTERNS):
                        raise TraceError(path.name, line_no, col, f"{cell!r}: expected Gamma, Weibull or empty")
                    vals[col] = cell
                    continue
                try:
                    v = float(cell)
                except ValueError:
                    raise TraceError(path.name, line_no, col, f"{cell!r} is not a number") from None
                if not math.isfinite(v) or v < 0:
                    raise TraceError(path.name, line_no, col, f"{cell!r}: must be a finite number >= 0")
                vals[col] = v
            if vals["timestamp"] != int(vals["timestamp"]):
                raise TraceError(path.name, line_no, "timestamp", f"{cells[0]!r}: must be whole seconds")
            if rows and vals["timestamp"] <= rows[-1][1]["timestamp"]:
                raise TraceError(path.name, line_no, "timestamp", f"{cells[0]!r} does not come after the previous "
                                 f"window's {rows[-1][1]['timestamp']:g}")
            if vals["pattern"]:
                for col in ("rate", "shape", "scale"):
                    if not vals[col] > 0:
                        raise TraceError(path.name, line_no, col, f"{cells[TRACE_COLUMNS.index(col)]!r}: a window "
                                         f"with a {vals['pattern']} pattern needs {col} > 0")
            rows.append((line_no, vals))
    if not rows:
        raise TraceError(path.name, 1, "<row>", "no windows")
    starts = [int(v["timestamp"]) for _, v in rows]
    step = starts[1] - starts[0] if len(starts) > 1 else 600  # ServeGen's arrival windows are 600 s
    ends = starts[1:] + [starts[-1] + step]
    return [Window(s, float(e - s), v["rate"] if v["pattern"] else 0.0, v["cv"], v["pattern"], v["shape"], v["scale"])
            for s, e, (_, v) in zip(starts, ends, rows)]


def parse_pmf(text: str) -> tuple[np.ndarray, np.ndarray]:
    """``"{value: probability, ...}"`` (a Python dict literal, as ServeGen stores it) -> values, probabilities.

    Parsed by pattern, never evaluated (upstream calls ``eval`` on it)."""
    if not isinstance(text, str):
        raise ValueError(f"expected a string holding a dict {{value: probability}}, got {type(text).__name__}")
    body = text.strip()
    if not (body.startswith("{") and body.endswith("}")):
        raise ValueError(f"{text[:40]!r}: expected a dict {{value: probability, ...}}")
    body = body[1:-1].strip()
    if not body:
        return np.empty(0), np.empty(0)
    pairs, pos = [], 0
    for m in _PAIR.finditer(body):
        if m.start() != pos:
            break
        pairs.append((float(m.group(1)), float(m.group(2))))
        pos = m.end()
    if pos != len(body):
        raise ValueError(f"cannot read {body[pos:pos + 30]!r} as 'value: probability'")
    arr = np.array(pairs, dtype=np.float64)
    return arr[:, 0], arr[:, 1]


def _read_datasets(path: Path) -> dict[int, dict[str, Pmf]]:
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except json.JSONDecodeError as e:
        raise TraceError(path.name, e.lineno, "<row>", f"not JSON: {e.msg}") from None
    if not isinstance(raw, dict):
        raise TraceError(path.name, 1, "<row>", "expected an object {window start: {field: distribution}}")
    out: dict[int, dict[str, Pmf]] = {}
    for key, fields in raw.items():
        where = f"window {key}"
        if not re.fullmatch(r"\d+", key) or not isinstance(fields, dict):
            raise TraceError(path.name, 1, where, "expected whole seconds mapping to {field: distribution}")
        pmfs, empty = {}, False
        for name, text in fields.items():
            try:
                values, probs = parse_pmf(text)
            except ValueError as e:
                raise TraceError(path.name, 1, f"{where}.{name}", str(e)) from None
            if not len(values):
                empty = True  # upstream drops the whole window's dataset when any field is empty
                break
            if name == "reason_ratio":
                continue
            if (values < 0).any() or (values != np.round(values)).any():
                raise TraceError(path.name, 1, f"{where}.{name}", "values must be whole token counts >= 0")
            if (probs < 0).any() or not math.isclose(probs.sum(), 1.0, abs_tol=1e-3):
                raise TraceError(path.name, 1, f"{where}.{name}", f"probabilities must be >= 0 and sum to 1 "
                                 f"(they sum to {probs.sum():.6g})")
            order = np.argsort(values, kind="stable")
            cdf = np.cumsum(probs[order])
            pmfs[name] = Pmf(values[order].astype(np.int64), cdf / cdf[-1])
        if empty:
            continue
        if "output_tokens" not in pmfs or not ({"input_tokens", "text_tokens"} & pmfs.keys()):
            raise TraceError(path.name, 1, where, f"needs output_tokens and input_tokens (or text_tokens); "
                             f"has {', '.join(sorted(fields)) or 'nothing'}")
        for m in MODALITIES:
            if f"{m}_count" in pmfs and f"{m}_tokens" not in pmfs:
                raise TraceError(path.name, 1, where, f"has {m}_count but no {m}_tokens")
        out[int(key)] = pmfs
    return dict(sorted(out.items()))


# ----------------------------------------------------------------------------- generating

CUT_MIN = 1 << 16  # a window of more arrivals than this, of which a max_requests cut keeps fewer, is not drawn whole
CHUNK = 1 << 20  # gaps drawn at a time where a window's are summed or walked without being held
EXACT_SUM_MAX = 1 << 22  # Weibull gaps summed draw by draw up to this many; beyond, their sum's normal limit


def servegen(data: ServeGenData | str | Path, *, seed: int = 0, start_s: float | None = None,
             end_s: float | None = None, rate_scale: float = 1.0, max_requests: int | None = None) -> list[Request]:
    """The requests of every client in the windows overlapping ``[start_s, end_s)`` (data time, s),
    keeping those inside it; with `max_requests`, only the first that many. Defaults: from 0 to the
    end of the last window.

    `max_requests` bounds what is generated, not only what is returned (issue 25: a mistyped
    ``servegen_rate_scale=1000000`` once drew every arrival of the hour, 21.5 GB, before the cut):

    * the clients share one window grid, so every arrival of a window comes after every arrival of
      the windows before it: once the windows drawn hold `max_requests` arrivals, the later ones are
      not drawn;
    * a (client, window) with more than ``max(CUT_MIN, still needed)`` arrivals draws only the first
      it can contribute (`_first_times`). Its first gaps are the same draws as a whole window's; the
      window's total, which scales them to fill it, is drawn from the law of the rest's sum (exact for
      a Gamma law, summed draw by draw for a Weibull one, or its normal limit past `EXACT_SUM_MAX`
      draws) or, when `start_s` falls inside the window, summed over the same draws walked twice, in
      chunks. Its lengths are drawn for the arrivals kept only. Such a window's requests follow the
      same laws as an uncut run's, but are other draws; a window of at most `CUT_MIN` arrivals is drawn
      whole, so a cut at realistic rates gives exactly the uncut run's first `max_requests`.
    """
    if not isinstance(data, ServeGenData):
        data = read_servegen(data)
    if not (isinstance(rate_scale, (int, float)) and math.isfinite(rate_scale) and rate_scale > 0):
        raise ValueError(f"servegen: rate_scale={rate_scale!r} (trace.servegen_rate_scale) must be a finite number > 0")
    if max_requests is not None and (isinstance(max_requests, bool) or not isinstance(max_requests, int)
                                     or max_requests < 1):
        raise ValueError(f"servegen: max_requests={max_requests!r} (trace.max_requests) must be an integer >= 1")
    lo = 0.0 if start_s is None else float(start_s)
    hi = math.inf if end_s is None else float(end_s)
    if not hi > lo:
        raise ValueError(f"servegen: end_s={end_s!r} (trace.end_s / trace.duration_s) must come after start_s={lo:g}")
    rows: list[tuple[float, int, int, int, int]] = []  # time, client, window start, prompt, output
    for i in range(len(data.starts)):
        if max_requests is not None and len(rows) >= max_requests:
            break  # every later window's arrivals come after these
        need = None if max_requests is None else max_requests - len(rows)
        for client in data.clients:
            rows.extend(_window_rows(client, client.windows[i], data, seed, lo, hi, rate_scale, need))
    rows.sort(key=lambda r: (r[0], r[1]))
    if max_requests is not None:
        del rows[max_requests:]
    return [Request(i, t, p, o, tenant=f"client-{c}", source=f"servegen:{c}@{s}")
            for i, (t, c, s, p, o) in enumerate(rows)]


def expected_requests(data: ServeGenData, *, start_s: float | None = None, end_s: float | None = None,
                      rate_scale: float = 1.0) -> float:
    """The mean number of requests `servegen` generates in ``[start_s, end_s)`` (no max_requests cut):
    each window's ``rate * rate_scale`` times its overlap with the span. Nothing is drawn."""
    lo = 0.0 if start_s is None else float(start_s)
    hi = math.inf if end_s is None else float(end_s)
    return sum(w.rate * rate_scale * max(0.0, min(hi, w.start + w.size) - max(lo, w.start))
               for c in data.clients for w in c.windows if w.pattern)


def _window_rows(client: Client, w: Window, data: ServeGenData, seed: int, lo: float, hi: float, rate_scale: float,
                 need: int | None) -> list[tuple[float, int, int, int, int]]:
    """One client's arrivals in one window, inside ``[lo, hi)``: at most `need` when the window is cut."""
    if w.start + w.size <= lo or w.start >= hi or not w.pattern:
        return []
    rng = np.random.default_rng((seed, client.id, w.start))
    expected = w.rate * w.size * rate_scale
    n = int(math.floor(expected + rng.random()))
    if n == 0:
        return []
    if need is not None and n > max(need, CUT_MIN):
        times = _first_times(rng, w, n, lo, hi, need)
        prompt, output = _lengths(_dataset_for(client, w, data), rng, len(times))
    else:
        gaps = (rng.gamma(w.shape, 1.0, n + 1) if w.pattern == "Gamma" else rng.weibull(w.shape, n + 1))
        total = gaps.sum()
        times = w.start + np.cumsum(gaps[:n]) / total * w.size if total > 0 else \
            w.start + np.arange(1, n + 1) * (w.size / (n + 1))
        prompt, output = _lengths(_dataset_for(client, w, data), rng, n)
        keep = (times >= lo) & (times < hi)
        times, prompt, output = times[keep], prompt[keep], output[keep]
    k = len(times)
    return list(zip(times.tolist(), [client.id] * k, [w.start] * k, prompt.tolist(), output.tolist()))


def _first_times(rng: np.random.Generator, w: Window, n: int, lo: float, hi: float, need: int) -> np.ndarray:
    """The first `need` of a window's `n` arrival times inside ``[lo, hi)``, holding no more than
    `CHUNK` gaps at a time (see `servegen`)."""
    def draw(k: int) -> np.ndarray:
        return rng.gamma(w.shape, 1.0, k) if w.pattern == "Gamma" else rng.weibull(w.shape, k)

    if w.start >= lo:  # the window's first arrivals are the ones kept
        head = draw(need)
        total = float(head.sum()) + _sum_of_gaps(rng, w, n + 1 - need, draw)
        times = w.start + np.cumsum(head) / total * w.size if total > 0 else \
            w.start + np.arange(1, need + 1) * (w.size / (n + 1))
        return times[times < hi]
    # start_s inside the window: an unknown number of its arrivals come before it, so its total is
    # summed first and the same draws (the generator's state put back) walked until `need` are kept
    state = rng.bit_generator.state
    total = _sum_of_draws(n + 1, draw)
    rng.bit_generator.state = state
    if not total > 0:
        times = w.start + np.arange(1, n + 1) * (w.size / (n + 1))
        return times[(times >= lo) & (times < hi)][:need]
    parts, got, walked, left = [], 0, 0.0, n
    while left and got < need:
        gaps = draw(min(CHUNK, left))
        left -= len(gaps)
        times = w.start + (walked + np.cumsum(gaps)) / total * w.size
        walked += float(gaps.sum())
        kept = times[(times >= lo) & (times < hi)][:need - got]
        parts.append(kept)
        got += len(kept)
        if times[-1] >= hi:
            break
    return np.concatenate(parts) if parts else np.empty(0)


def _sum_of_gaps(rng: np.random.Generator, w: Window, m: int, draw) -> float:
    """The sum of `m` more gaps of the window's law, without drawing them one by one where it need not:
    a sum of m Gamma(shape, 1) draws is Gamma(m * shape, 1); a Weibull one is summed draw by draw up to
    EXACT_SUM_MAX draws, and past that is its normal limit (mean m*mu, variance m*var of one draw: its
    relative spread is below cv/2048, far under anything a trace of that many arrivals resolves)."""
    if m <= 0:
        return 0.0
    if w.pattern == "Gamma":
        return float(rng.gamma(m * w.shape, 1.0))
    if m > EXACT_SUM_MAX:
        try:
            mu = math.gamma(1.0 + 1.0 / w.shape)
            var = math.gamma(1.0 + 2.0 / w.shape) - mu * mu
        except OverflowError:  # a shape so small that one draw's moments overflow: sum them
            return _sum_of_draws(m, draw)
        return max(0.0, float(rng.normal(m * mu, math.sqrt(m * var))))
    return _sum_of_draws(m, draw)


def _sum_of_draws(m: int, draw) -> float:
    total, left = 0.0, m
    while left:
        k = min(CHUNK, left)
        total += float(draw(k).sum())
        left -= k
    return total


def _dataset_for(client: Client, w: Window, data: ServeGenData) -> dict[str, Pmf]:
    """The latest non-empty length distributions starting at or before the window (as upstream)."""
    best = None
    for start, pmfs in client.datasets.items():
        if start <= w.start:
            best = pmfs
        else:
            break
    if best is None:
        raise TraceError(f"chunk-{client.id}-dataset.json", 1, f"window {w.start}",
                         f"client {client.id} sends requests in the window at {w.start} s but has no length "
                         f"distribution starting at or before it (in {data.folder})")
    return best


def _lengths(pmfs: dict[str, Pmf], rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    prompt = (pmfs["input_tokens"] if "input_tokens" in pmfs else pmfs["text_tokens"]).sample(rng, n)
    for m in MODALITIES:
        if f"{m}_count" in pmfs:
            counts = pmfs[f"{m}_count"].sample(rng, n)
            draws = pmfs[f"{m}_tokens"].sample(rng, int(counts.sum()))
            owner = np.repeat(np.arange(n), counts)
            prompt = prompt + np.bincount(owner, weights=draws, minlength=n).astype(np.int64)
    output = pmfs["output_tokens"].sample(rng, n)
    return np.maximum(prompt, 1), np.maximum(output, 1)
