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

def servegen(data: ServeGenData | str | Path, *, seed: int = 0, start_s: float | None = None,
             end_s: float | None = None, rate_scale: float = 1.0) -> list[Request]:
    """The requests of every client in the windows overlapping ``[start_s, end_s)`` (data time, s),
    keeping those inside it. Defaults: from 0 to the end of the last window."""
    if not isinstance(data, ServeGenData):
        data = read_servegen(data)
    if not (isinstance(rate_scale, (int, float)) and math.isfinite(rate_scale) and rate_scale > 0):
        raise ValueError(f"servegen: rate_scale={rate_scale!r} (trace.servegen_rate_scale) must be a finite number > 0")
    lo = 0.0 if start_s is None else float(start_s)
    hi = math.inf if end_s is None else float(end_s)
    if not hi > lo:
        raise ValueError(f"servegen: end_s={end_s!r} (trace.end_s / trace.duration_s) must come after start_s={lo:g}")
    rows: list[tuple[float, int, int, int, int]] = []  # time, client, window start, prompt, output
    for client in data.clients:
        for w in client.windows:
            if w.start + w.size <= lo or w.start >= hi or not w.pattern:
                continue
            rng = np.random.default_rng((seed, client.id, w.start))
            expected = w.rate * w.size * rate_scale
            n = int(math.floor(expected + rng.random()))
            if n == 0:
                continue
            gaps = (rng.gamma(w.shape, 1.0, n + 1) if w.pattern == "Gamma" else rng.weibull(w.shape, n + 1))
            total = gaps.sum()
            times = w.start + np.cumsum(gaps[:n]) / total * w.size if total > 0 else \
                w.start + np.arange(1, n + 1) * (w.size / (n + 1))
            pmfs = _dataset_for(client, w, data)
            prompt, output = _lengths(pmfs, rng, n)
            keep = (times >= lo) & (times < hi)
            rows.extend(zip(times[keep].tolist(), [client.id] * int(keep.sum()), [w.start] * int(keep.sum()),
                            prompt[keep].tolist(), output[keep].tolist()))
    rows.sort(key=lambda r: (r[0], r[1]))
    return [Request(i, t, p, o, tenant=f"client-{c}", source=f"servegen:{c}@{s}")
            for i, (t, c, s, p, o) in enumerate(rows)]


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
