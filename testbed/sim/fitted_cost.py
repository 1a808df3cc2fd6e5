"""A cost model fitted to a profile of the real engine (`testbed-profile`, `engine/profile.py`).

    cost_model=profile cost_model.profile=profiles/cpu_tiny_llama.csv

The step time is the engine's time for the batch plus the step loop's own host time:

    engine(shape) = c0 + max(c_floor, c_tok * tokens) + c_pairs * prefill_attn_pairs
                    + c_pkv * prefill_kv_tokens + c_dkv * decode_kv_tokens
                    + c_pseq * prefill_seqs + c_dseq * decode_seqs
    host(shape)   = h0 + h_seq * seqs            (the profile's `host` rows: plan + complete, no model)

c0 is the per-step launch/framework overhead; max(c_floor, c_tok * tokens) is the linear
layers, which cost at least one read of the weights (the floor of small steps on a GPU)
and otherwise grow with the tokens; prefill attention grows with query-key pairs and with
the KV it reads (chunks at an offset gather their cached context); decode attention with
the KV tokens its sequences read; per-sequence terms cover per-chunk kernel calls,
sampling and the input preparation's block tables. Every parameter is >= 0; they are
fitted by `scipy.optimize.least_squares` on relative error (soft-L1, so that a few points
slowed by a busy machine do not pull the fit).

Where the analytic form misses (on a CPU, caches make decode cost per KV token depend on
the batch), a residual correction interpolates the measured/fitted ratio over the decode
grid (log batch x log context) and over the single-chunk prefill grid (log chunk x log
offset). Each correction is kept only if it lowers the error on held-out rows.

Speculative decoding (spec_decode.*): a profile measures no verify pass, so each draft token a decode
sequence verifies is priced as one more decode row at its own context (`verify_as_decode_rows`): its
token through the linear layers, its query-key pairs, its per-row input and sampling cost. That reads
a sequence's KV once per query, so the verify's attention is an upper bound.

Held-out error: the fit is first made on the profile's rows minus every 5th (a
deterministic split), and its absolute percentage error on those held-out rows is
reported (`holdout`: median, p95, per kind); the model then used is refitted on every row.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np
import pandas as pd

from testbed.core.cost import BatchShape, verify_as_decode_rows

HOLDOUT_EVERY = 5
ENGINE_TERMS = ["c0", "c_floor", "c_tok", "c_pairs", "c_ctx_pairs", "c_pkv", "c_dkv", "c_pseq", "c_dseq", "c_mixed"]
HOST_TERMS = ["h0", "h_seq", "h_pseq", "h_ptok"]
_CACHE: dict[tuple, "ProfileCostModel"] = {}


def read_profile(path: str | Path) -> tuple[dict[str, str], pd.DataFrame]:
    """A profile file's `# key: value` header and its rows."""
    header: dict[str, str] = {}
    with open(path) as f:
        for line in f:
            if not line.startswith("#"):
                break
            k, _, v = line[1:].strip().partition(":")
            header[k.strip()] = v.strip()
    df = pd.read_csv(path, comment="#")
    if "load_blocks" not in df.columns:  # profiles written before the host KV tier existed: no engine step loads
        df.insert(list(df.columns).index("swap_blocks") + 1 if "swap_blocks" in df.columns else len(df.columns),
                  "load_blocks", 0)
    for col in ("num_spec_tokens", "spec_kv_tokens", "num_spec_seqs"):  # written before speculative decoding
        if col not in df.columns:
            df[col] = 0
    missing = {"kind", "seconds", *(f for f in BatchShape.__dataclass_fields__)} - set(df.columns)
    if missing:
        raise ValueError(f"{path}: not a testbed profile, missing columns {sorted(missing)}")
    return header, df


def resolve_profile_path(path: str | Path) -> Path:
    """A relative profile path is looked up from the working directory, then inside the installed
    package (where the shipped `profiles/` live), so `cost_model.profile=profiles/...` works from
    anywhere, from a checkout or from a wheel."""
    p = Path(path).expanduser()
    if p.is_absolute() or p.exists():
        return p
    shipped = Path(str(resources.files("testbed"))) / p
    return shipped if shipped.exists() else p


# --- the analytic part -------------------------------------------------------------------------
def _features(df: pd.DataFrame) -> dict[str, np.ndarray]:
    f = {k: df[k].to_numpy(float) for k in ("num_prefill_tokens", "num_prefill_seqs", "prefill_attn_pairs",
                                             "prefill_kv_tokens", "num_decode_seqs", "decode_kv_tokens")}
    f["tokens"] = f["num_prefill_tokens"] + f["num_decode_seqs"]
    f["seqs"] = f["num_prefill_seqs"] + f["num_decode_seqs"]
    f["ctx_pairs"] = _ctx_pairs(f["num_prefill_tokens"], f["num_prefill_seqs"], f["prefill_kv_tokens"])
    # the step runs both attention paths, decode rows beside prefill chunks (engine/attention.py)
    f["mixed"] = ((f["num_decode_seqs"] > 0) & (f["num_prefill_seqs"] > 0)).astype(float)
    return f


def _ctx_pairs(tokens, seqs, kv):
    """Query-key pairs of chunks that start past cached context: tokens x (context + tokens), the whole
    rectangle (exact for one chunk; chunks taken as equal otherwise). A chunk with cached context
    attends through an explicit mask, a fresh one causally: the engine's two attention paths."""
    if isinstance(tokens, np.ndarray):
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(kv > tokens, tokens * kv / np.maximum(seqs, 1), 0.0)
    return tokens * kv / seqs if kv > tokens else 0.0


def _engine_pred(p: np.ndarray, f: dict[str, np.ndarray]) -> np.ndarray:
    c0, c_floor, c_tok, c_pairs, c_ctx, c_pkv, c_dkv, c_pseq, c_dseq, c_mixed = p
    return (c0 + np.maximum(c_floor, c_tok * f["tokens"]) + c_pairs * f["prefill_attn_pairs"] + c_ctx * f["ctx_pairs"]
            + c_pkv * f["prefill_kv_tokens"] + c_dkv * f["decode_kv_tokens"]
            + c_pseq * f["num_prefill_seqs"] + c_dseq * f["num_decode_seqs"] + c_mixed * f["mixed"])


def _host_pred(p: np.ndarray, f: dict[str, np.ndarray]) -> np.ndarray:
    return p[0] + p[1] * f["seqs"] + p[2] * f["num_prefill_seqs"] + p[3] * f["num_prefill_tokens"]


def _fit(pred, f: dict[str, np.ndarray], y: np.ndarray, n_params: int) -> np.ndarray:
    """Non-negative parameters minimising the (soft-L1) relative error, from a few starting points."""
    from scipy.optimize import least_squares

    # Work in units where every column is O(1), so one tolerance suits all parameters.
    scale = np.ones(n_params)
    cols = _columns(f, n_params)
    for i, c in enumerate(cols):
        m = np.max(np.abs(c)) if c.size else 0.0
        scale[i] = np.median(y) / m if m > 0 else 1.0
    # A term the profile never exercises (a column of zeros: no decode rows, no host rows with a prefill,
    # an older grid) says nothing of its parameter: it stays 0 rather than at an arbitrary starting value
    # that would then price shapes the profile never measured.
    free = np.array([c.size > 0 and np.any(c != 0) for c in cols])

    def resid(q):
        full = np.zeros(n_params)
        full[free] = q
        return pred(full * scale, f) / y - 1.0

    best = None
    for start in (0.1, 0.5, 0.01):
        q0 = np.full(int(free.sum()), start)
        r = least_squares(resid, q0, bounds=(0.0, np.inf), loss="soft_l1", f_scale=0.05, x_scale="jac",
                          max_nfev=2000)
        if best is None or r.cost < best.cost:
            best = r
    out = np.zeros(n_params)
    out[free] = best.x
    return out * scale


def _columns(f: dict[str, np.ndarray], n_params: int) -> list[np.ndarray]:
    if n_params == len(HOST_TERMS):
        return [np.ones_like(f["seqs"]), f["seqs"], f["num_prefill_seqs"], f["num_prefill_tokens"]]
    return [np.ones_like(f["tokens"]), np.ones_like(f["tokens"]), f["tokens"], f["prefill_attn_pairs"],
            f["ctx_pairs"], f["prefill_kv_tokens"], f["decode_kv_tokens"], f["num_prefill_seqs"], f["num_decode_seqs"],
            f["mixed"]]


# --- the residual correction -------------------------------------------------------------------
class _Grid2D:
    """Bilinear interpolation of a log ratio over a rectangular grid (NaN cells: no correction).

    Built once from scattered points with scipy's LinearNDInterpolator, looked up in plain Python
    (a bisect and four multiplies), fast enough for every simulated step."""

    def __init__(self, x: np.ndarray, y: np.ndarray, z: np.ndarray):
        from scipy.interpolate import LinearNDInterpolator

        self.xs = sorted(set(x.tolist()))
        self.ys = sorted(set(y.tolist()))
        if len(self.xs) < 2 or len(self.ys) < 2:
            raise ValueError("a correction grid needs two values on each axis")
        gx, gy = np.meshgrid(self.xs, self.ys, indexing="ij")
        grid = LinearNDInterpolator(np.c_[x, y], z)(gx, gy)
        self.z = grid.tolist()  # NaN outside the points' hull

    def __call__(self, x: float, y: float) -> float:
        xs, ys = self.xs, self.ys
        if not (xs[0] <= x <= xs[-1] and ys[0] <= y <= ys[-1]):
            return 0.0
        i = min(max(bisect.bisect_right(xs, x) - 1, 0), len(xs) - 2)
        j = min(max(bisect.bisect_right(ys, y) - 1, 0), len(ys) - 2)
        tx = (x - xs[i]) / (xs[i + 1] - xs[i])
        ty = (y - ys[j]) / (ys[j + 1] - ys[j])
        z = self.z
        v = ((1 - tx) * (1 - ty) * z[i][j] + tx * (1 - ty) * z[i + 1][j]
             + (1 - tx) * ty * z[i][j + 1] + tx * ty * z[i + 1][j + 1])
        return 0.0 if v != v else v  # NaN: outside the measured hull


def _decode_coords(num_decode_seqs, decode_kv_tokens):
    return np.log(num_decode_seqs), np.log(decode_kv_tokens / num_decode_seqs)


def _prefill_coords(num_prefill_tokens, prefill_kv_tokens):
    return np.log(num_prefill_tokens), np.log1p(prefill_kv_tokens - num_prefill_tokens)


def _families(df: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    decode = (df.num_prefill_seqs.to_numpy() == 0) & (df.num_decode_seqs.to_numpy() > 0)
    prefill = (df.num_prefill_seqs.to_numpy() == 1) & (df.num_decode_seqs.to_numpy() == 0)
    return decode, prefill


@dataclass
class _Fit:
    engine: np.ndarray
    host: np.ndarray
    decode_grid: _Grid2D | None
    prefill_grid: _Grid2D | None


def _fit_all(df: pd.DataFrame, corrections: dict[str, bool]) -> _Fit:
    eng = df[df.kind != "host"]
    host = df[df.kind == "host"]
    fe = _features(eng)
    ye = eng.seconds.to_numpy(float)
    pe = _fit(_engine_pred, fe, ye, len(ENGINE_TERMS))
    ph = (_fit(_host_pred, _features(host), host.seconds.to_numpy(float), len(HOST_TERMS)) if len(host)
          else np.zeros(len(HOST_TERMS)))
    log_ratio = np.log(ye / _engine_pred(pe, fe))
    dec, pre = _families(eng)
    grids = {}
    for name, mask, coords, cols in (("decode", dec, _decode_coords, ("num_decode_seqs", "decode_kv_tokens")),
                                     ("prefill", pre, _prefill_coords, ("num_prefill_tokens", "prefill_kv_tokens"))):
        grids[name] = None
        if corrections.get(name) and mask.sum() >= 4:
            x, y = coords(*(eng[c].to_numpy(float)[mask] for c in cols))
            try:
                grids[name] = _Grid2D(x, y, log_ratio[mask])
            except Exception:  # degenerate (Qhull) grid (too few distinct values): no correction
                grids[name] = None
    return _Fit(pe, ph, grids["decode"], grids["prefill"])


def _predict(fit: _Fit, df: pd.DataFrame) -> np.ndarray:
    """Predicted seconds of profile rows: engine rows the engine part, host rows the host part."""
    f = _features(df)
    out = _engine_pred(fit.engine, f)
    dec, pre = _families(df)
    if fit.decode_grid is not None and dec.any():
        x, y = _decode_coords(f["num_decode_seqs"][dec], f["decode_kv_tokens"][dec])
        out[dec] *= np.exp([fit.decode_grid(a, b) for a, b in zip(x, y)])
    if fit.prefill_grid is not None and pre.any():
        x, y = _prefill_coords(f["num_prefill_tokens"][pre], f["prefill_kv_tokens"][pre])
        out[pre] *= np.exp([fit.prefill_grid(a, b) for a, b in zip(x, y)])
    host = (df.kind == "host").to_numpy()
    out[host] = _host_pred(fit.host, f)[host]
    return out


def _errors(pred: np.ndarray, df: pd.DataFrame) -> dict:
    ape = np.abs(pred / df.seconds.to_numpy(float) - 1.0)
    out = {"rows": int(len(df)), "median_ape": float(np.median(ape)) if len(ape) else math.nan,
           "p95_ape": float(np.percentile(ape, 95)) if len(ape) else math.nan, "by_kind": {}}
    kinds = df.kind.to_numpy()
    for k in sorted(set(kinds)):
        a = ape[kinds == k]
        out["by_kind"][k] = {"rows": int(a.size), "median_ape": float(np.median(a)),
                             "p95_ape": float(np.percentile(a, 95))}
    return out


class ProfileCostModel:
    """Step times fitted to an engine profile; `holdout` reports the error on held-out grid rows."""

    holdout_every = HOLDOUT_EVERY

    def __init__(self, fit: _Fit, header: dict, name: str, holdout: dict, corrections: dict[str, bool],
                 path: str | None = None):
        self.header, self.name, self.holdout, self.corrections, self.path = header, name, holdout, corrections, path
        self.host_link_s_per_block = 0.0  # seconds to load one KV block from the host tier (kv.offload_gb)
        self._set(fit)

    def _set(self, fit: _Fit) -> None:
        self.fit = fit
        self.params = dict(zip(ENGINE_TERMS, fit.engine.tolist())) | dict(zip(HOST_TERMS, fit.host.tolist()))
        (self._c0, self._c_floor, self._c_tok, self._c_pairs, self._c_ctx, self._c_pkv, self._c_dkv, self._c_pseq,
         self._c_dseq, self._c_mixed) = fit.engine.tolist()
        self._h0, self._h_seq, self._h_pseq, self._h_ptok = fit.host.tolist()
        self._dgrid, self._pgrid = fit.decode_grid, fit.prefill_grid

    @classmethod
    def from_file(cls, path: str | Path, holdout_every: int = HOLDOUT_EVERY) -> "ProfileCostModel":
        path = resolve_profile_path(path)
        if not path.exists():
            raise FileNotFoundError(f"cost_model.profile={str(path)!r}: no such profile file "
                                    f"(make one with testbed-profile, or use a shipped one under profiles/)")
        st = path.stat()
        key = (str(path.resolve()), st.st_mtime_ns, st.st_size, holdout_every)
        model = _CACHE.get(key)
        if model is None:  # a sweep or a fidelity run builds the same model many times: fit once per process
            header, df = read_profile(path)
            model = _CACHE[key] = cls.from_frame(df, header, f"profile:{path.name}", holdout_every, str(path))
        return model

    @classmethod
    def from_frame(cls, df: pd.DataFrame, header: dict | None = None, name: str = "profile",
                   holdout_every: int = HOLDOUT_EVERY, path: str | None = None) -> "ProfileCostModel":
        df = df[df.seconds > 0].reset_index(drop=True)
        if (df.kind != "host").sum() < len(ENGINE_TERMS) * 2:
            raise ValueError(f"{name}: {int((df.kind != 'host').sum())} engine rows, too few to fit {len(ENGINE_TERMS)} parameters")
        held = (np.arange(len(df)) % holdout_every) == holdout_every - 1
        train, test = df[~held], df[held]
        # Held-out error without and with each residual correction; keep a correction only where it helps.
        plain = _fit_all(train, {})
        both = _fit_all(train, {"decode": True, "prefill": True})
        report = {"every": holdout_every, "analytic": _errors(_predict(plain, test), test)}
        corrections = {}
        dec, pre = _families(test)
        ape_plain = np.abs(_predict(plain, test) / test.seconds.to_numpy() - 1)
        ape_both = np.abs(_predict(both, test) / test.seconds.to_numpy() - 1)
        for fam, mask in (("decode", dec), ("prefill", pre)):
            corrections[fam] = bool(mask.any() and np.mean(ape_both[mask]) < np.mean(ape_plain[mask]))
        chosen = _fit_all(train, corrections)
        report.update(_errors(_predict(chosen, test), test))
        report["corrections"] = dict(corrections)
        model = cls(_fit_all(df, corrections), dict(header or {}), name, report, corrections, path)
        model.train_error = _errors(_predict(model.fit, df), df)  # in-sample, on every row
        return model

    # --- the CostModel interface ------------------------------------------------------------------
    def engine_time(self, s: BatchShape) -> float:
        """The engine's `execute()` time for this batch (input preparation, forward, sampling)."""
        tokens = s.num_prefill_tokens + s.num_decode_seqs
        t = (self._c0 + max(self._c_floor, self._c_tok * tokens) + self._c_pairs * s.prefill_attn_pairs
             + self._c_pkv * s.prefill_kv_tokens + self._c_dkv * s.decode_kv_tokens
             + self._c_pseq * s.num_prefill_seqs + self._c_dseq * s.num_decode_seqs)
        if s.num_decode_seqs and s.num_prefill_seqs:
            t += self._c_mixed
        if s.prefill_kv_tokens > s.num_prefill_tokens:
            t += self._c_ctx * s.num_prefill_tokens * s.prefill_kv_tokens / s.num_prefill_seqs
        if s.num_prefill_seqs == 0:
            if self._dgrid is not None and s.num_decode_seqs:
                t *= math.exp(self._dgrid(math.log(s.num_decode_seqs), math.log(s.decode_kv_tokens / s.num_decode_seqs)))
        elif s.num_prefill_seqs == 1 and s.num_decode_seqs == 0 and self._pgrid is not None:
            t *= math.exp(self._pgrid(math.log(s.num_prefill_tokens),
                                      math.log1p(s.prefill_kv_tokens - s.num_prefill_tokens)))
        return t

    def host_time(self, s: BatchShape) -> float:
        """The step loop's own time per step (policy, validation, KV bookkeeping), no model."""
        return (self._h0 + self._h_seq * (s.num_prefill_seqs + s.num_decode_seqs) + self._h_pseq * s.num_prefill_seqs
                + self._h_ptok * s.num_prefill_tokens)

    def step_time(self, s: BatchShape) -> float:
        # a profile has no verify pass: the engine part prices its draft tokens as decode rows, the host
        # part (per request scheduled) stays the step's
        engine = self.engine_time(verify_as_decode_rows(s) if s.num_spec_tokens else s)
        if s.load_blocks:  # a profile measures no host-tier load: it crosses the host link (set by cost_models.with_host_link)
            return engine + self.host_time(s) + s.load_blocks * self.host_link_s_per_block
        return engine + self.host_time(s)

    def describe(self) -> str:
        h = self.holdout
        params = ", ".join(f"{k}={v:.3g}" for k, v in self.params.items())
        return (f"{self.name}: {self.header.get('model', '?')} on {self.header.get('device', '?')} "
                f"({self.header.get('dtype', '?')}); held-out error over {h['rows']} rows (every {h['every']}th): "
                f"median {h['median_ape']:.1%}, p95 {h['p95_ape']:.1%} (analytic only: median "
                f"{h['analytic']['median_ape']:.1%}, p95 {h['analytic']['p95_ape']:.1%}; corrections "
                f"{h['corrections']}); {params}")
