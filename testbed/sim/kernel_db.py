"""Measured kernel latencies from aiconfigurator-core's tables, interpolated to any shape.

aiconfigurator-core ships per-GPU Parquet tables of single kernels timed in a serving framework
(`systems/data/<gpu>/<op>/<framework>/<version>/*.parquet`, latency in ms). A step's cost composed
from them (`testbed.sim.kernel_cost`) inherits the real kernels' efficiency curves (tile
quantisation, launch floors, bandwidth saturation) that a roofline has to guess. This module
reads only the rows and columns one model needs and answers in seconds.

Interpolation (our own; aiconfigurator's sdk does the same job in compiled code): every table is
put on a dense grid over its measured axis values; latency is multilinear in log(latency) over
log(axis), so a power law between two measured points is followed exactly; cells the sweep never
measured are filled from their neighbours the same way (both sides along some axis, else one side
scaled by the axis' work exponent); beyond the grid's top an axis scales its work (GEMM m, n, k and
MoE tokens linearly, i.e. by FLOPs or bytes; context attention quadratically in the sequence
length; decode attention and all-reduce linearly), below its bottom the latency stays at the
smallest measured one (a launch floor).

Which table versions a GPU ends up with (version=None: the newest version holding the framework's
preferred kernel, else the newest whose rows come from one kernel source), vllm, aiconfigurator-core
0.12.0 ('-': no usable table: a model needing that op fails with the reason):

| GPU (kernel_db_gpu) | gemm | attention | moe | all-reduce |
| --- | --- | --- | --- | --- |
| h100_sxm (hardware=h100) | 0.24.0 | 0.24.0 | 0.24.0 | 0.24.0 |
| h200_sxm | 0.24.0 | 0.24.0 | 0.24.0 | 0.24.0 |
| a100_sxm | 0.14.0 | 0.14.0 | - (no balanced rows) | 0.14.0 |
| b200_sxm | 0.24.0 | 0.22.0 | 0.22.0 | 0.24.0 |
| l40s | 0.24.0 | 0.24.0 | 0.24.0 | 0.22.0 |
| rtx_pro_6000_server | 0.24.0 | 0.24.0 | 0.24.0 | 0.24.0 |
| b300_sxm, gb200, gb300 | 0.24.0 | - | - | 0.24.0 (gb300: 0.27.0) |
| b60 | 0.26.0 | 0.26.0 | - | - |
| a100_pcie, a30, h100_pcie, l4 | - | - | - | - |

(`python -m testbed.sim.kernel_db` prints the table for every GPU in the installed package.)

Where the tables are read from (`find_tables`): `cost_model.data_dir` when set; else, for a GPU and
framework whose tables ship inside this package (`testbed/sim/kernel_data/`: aiconfigurator-core
0.12.0's vLLM tables of the hardware presets' GPUs, trimmed to the rows and columns read here;
NOTICE.md says what and why) and no `framework_version` asked for, the shipped ones; else the
installed aiconfigurator-core (the `kernels` extra). Shipped first, so that a preset's step times do
not depend on whether, or which 0.12.x of, the optional package is installed; for the rows shipped
the two give bit-identical step times (tests/test_kernel_tables.py), and `testbed.sim.kernel_export`
regenerates the shipped files from the installed package.
"""
from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

INSTALL_HINT = ("cost_model=kernels needs measured kernel tables: pip install 'llm-sched-testbed[kernels]' "
                "(aiconfigurator-core)")
PACKAGE = "aiconfigurator-core"
SHIPPED_DIR = Path(__file__).resolve().parent / "kernel_data"  # package data (pyproject: sim/kernel_data/**)

# per framework: which measured kernel each op uses, in order of preference (the one the framework runs for
# an unquantised bf16 model first); a table holding a single kernel source for the op uses that one
# an op's quantised rows (`<op>_<dtype>`, e.g. gemm_fp8, attention_fp8 for an fp8 KV cache, moe_int4_wo) have
# their own preferences where the kernel differs (vLLM: cutlass scaled_mm for per-tensor fp8 GEMMs, FlashInfer for
# fp8 KV on GPUs without FA3, Marlin for int4 experts); an op without them uses the op's own
FRAMEWORKS = {
    # each op's kernel as the collector names it, then its older name (the vLLM 0.14.0 tables: vllm_default is
    # torch's linear, vllm_flash_attn is vLLM's FlashAttention, version 3 on Hopper, vllm_fused_moe the Triton
    # fused MoE that later tables call by its modular-kernel parts)
    "vllm": dict(gemm=("torch.nn.functional.linear", "vllm_default"), attention=("vllm_flash_attn_fa3", "vllm_flash_attn"),
                 moe=("vllm_unquantizedfusedmoe_triton_tritonexperts", "vllm_fused_moe"), allreduce_backend="vllm_graph",
                 gemm_fp8=("CutlassFP8ScaledMMLinearKernel",),
                 attention_fp8=("vllm_flash_attn_fa3", "vllm_flashinfer_trtllmprefill", "vllm_flashinfer_trtllmdecode",
                                "vllm_flashinfer_fiprefill", "vllm_flashinfer_fidecode", "vllm_flashinfer"),
                 moe_fp8=("vllm_modeloptfp8moe_flashinfer_cutlass_flashinferexperts",
                          "vllm_modeloptfp8moe_triton_tritonexperts", "vllm_fused_moe"),
                 moe_int4_wo=("vllm_compressedtensorswna16marlinmoe_marlin_marlinexperts", "vllm_marlin_int4_moe")),
    "sglang": dict(gemm=("sglang_torch_linear", "sglang"), attention=("fa3", "triton"),
                   moe=("sglang_fused_moe_triton",), allreduce_backend="sglang_graph"),
    "trtllm": dict(gemm=("torch_flow",), attention=("torch_flow",), moe=("moe_torch_flow_cutlass", "moe_torch_flow"),
                   allreduce_backend=None),
}
OPS = {  # op -> (folder, file)
    "gemm": ("gemm", "gemm_perf.parquet"),
    "context_attention": ("attention", "context_attention_perf.parquet"),
    "generation_attention": ("attention", "generation_attention_perf.parquet"),
    "moe": ("moe", "moe_perf.parquet"),
    "allreduce": ("comm", "custom_allreduce_perf.parquet"),
}


class KernelDBError(ValueError):
    """A GPU, framework, version or shape the measured tables do not have."""


def package_data_dir() -> Path:
    """The installed aiconfigurator-core's `systems/data`, found without importing the package."""
    spec = importlib.util.find_spec("aiconfigurator_core")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(INSTALL_HINT)
    return Path(list(spec.submodule_search_locations)[0]) / "systems" / "data"


@dataclass(frozen=True)
class TableSource:
    """Where a KernelDB reads its tables: `kind` is data_dir, shipped or installed; `package` the
    aiconfigurator-core release they come from (None for a data_dir of unknown origin)."""
    root: Path
    kind: str
    package: Optional[str]


@functools.lru_cache(maxsize=None)
def shipped_manifest() -> dict:
    """The shipped tables' manifest (written by testbed.sim.kernel_export): source release, GPUs, files."""
    import json

    path = SHIPPED_DIR / "manifest.json"
    return json.loads(path.read_text()) if path.is_file() else {"gpus": {}}


def shipped_gpus(framework: str = "vllm") -> list[str]:
    m = shipped_manifest()
    return sorted(g for g, fws in m["gpus"].items() if framework in fws)


def installed_version() -> Optional[str]:
    from importlib import metadata

    try:
        return metadata.version(PACKAGE)
    except metadata.PackageNotFoundError:
        return None


def find_tables(gpu: str, framework: str, version: Optional[str] = None,
                data_dir: Optional[str | Path] = None, own_sources: bool = False) -> TableSource:
    """The folder to read `gpu`'s `framework` tables from (the order: this module's docstring).
    `own_sources`: kernel sources other than FRAMEWORKS' are asked for, which only the package's tables hold."""
    if data_dir is not None:
        return TableSource(Path(data_dir), "data_dir", None)
    if version is None and not own_sources and gpu in shipped_gpus(framework):
        return TableSource(SHIPPED_DIR, "shipped", f"{PACKAGE} {shipped_manifest()['version']}")
    try:
        root = package_data_dir()
    except ImportError:
        shipped = ", ".join(shipped_gpus(framework)) or "none"
        why = (f"framework_version={version!r} is not among the shipped tables" if version is not None and
               gpu in shipped_gpus(framework) else f"the testbed ships {framework} tables for {shipped} only")
        raise ImportError(f"{INSTALL_HINT}: {gpu} {framework}: {why}") from None
    return TableSource(root, "installed", f"{PACKAGE} {installed_version()}")


def _version_distance(v: str, near: str) -> float:
    """How far release `v` is from `near`, major.minor.patch read as one number (0.14.0 is 1.1 from 0.15.1,
    0.24.0 is 8.9): a table timed at the nearest release is the likeliest to have the same kernels."""
    def number(x: str) -> float:
        parts = [p[0] for p in _version_key(x)] + [0, 0, 0]
        return parts[0] * 1e6 + parts[1] * 1e3 + parts[2]
    return abs(number(v) - number(near)) / 1e3


def _version_key(v: str) -> tuple:
    """'0.24.0' > '0.9.1'; '1.3.0rc20' > '1.3.0rc10'; a final release above its release candidates."""
    import re

    parts = []
    for piece in re.split(r"[.]", v):
        m = re.match(r"(\d+)(?:rc(\d+))?(?:post(\d+))?", piece)
        if m:
            parts.append((int(m.group(1)), int(m.group(2)) if m.group(2) else 10**9, int(m.group(3) or 0)))
        else:
            parts.append((-1, 0, 0))
    return tuple(parts)


class LogGrid:
    """Latency on a dense grid over positive axes, multilinear in log-log space.

    `up` gives each axis' work exponent, used past the top of the grid and to fill unmeasured
    cells that have a measured neighbour on one side only."""

    def __init__(self, axes: Sequence[np.ndarray], values: np.ndarray, up: Sequence[float]):
        self.axes = [np.asarray(a, dtype=float) for a in axes]
        self.log_axes = [np.log(a) for a in self.axes]
        self.up = tuple(float(u) for u in up)
        logv = np.log(np.asarray(values, dtype=float))
        if np.isnan(logv).all():
            raise KernelDBError("no measured point to interpolate from")
        self.logv = _fill(logv, self.log_axes, self.up)
        # the look-up's working copies: the cells as Python floats (the same doubles), flat, by strides;
        # each axis' brackets memoised by coordinate (a run's steps ask the same batch size again and again)
        self._flat = self.logv.ravel().tolist()
        self._strides = [st // self.logv.itemsize for st in self.logv.strides]
        self._brackets: list[dict[float, tuple]] = [{} for _ in self.axes]

    @classmethod
    def from_rows(cls, cols: Sequence[np.ndarray], latency: np.ndarray, up: Sequence[float]) -> "LogGrid":
        axes = [np.unique(c) for c in cols]
        vals = np.full([len(a) for a in axes], np.nan)
        idx = tuple(np.searchsorted(a, c) for a, c in zip(axes, cols))
        vals[idx] = latency
        return cls(axes, vals, up)

    def _bracket(self, d: int, x: float) -> tuple[int, int, float, float]:
        """(lower index, upper index, weight of the upper, log factor beyond the top) on axis d."""
        ax, lax = self.axes[d], self.log_axes[d]
        if x <= ax[0]:
            return 0, 0, 0.0, 0.0
        if x >= ax[-1]:
            return len(ax) - 1, len(ax) - 1, 0.0, self.up[d] * (np.log(x) - lax[-1])
        hi = int(np.searchsorted(ax, x))
        lo = hi - 1
        return lo, hi, (np.log(x) - lax[lo]) / (lax[hi] - lax[lo]), 0.0

    def __call__(self, *point: float) -> float:
        brackets = []
        for d, x in enumerate(point):
            x = float(x)
            memo = self._brackets[d]
            b = memo.get(x)
            if b is None:
                b = memo[x] = self._bracket(d, x)
            brackets.append(b)
        total = sum(b[3] for b in brackets)
        acc = 0.0
        flat, strides = self._flat, self._strides
        for corner in range(1 << len(brackets)):
            w, at = 1.0, 0
            for d, (lo, hi, t, _) in enumerate(brackets):
                if corner >> d & 1:
                    w *= t
                    at += hi * strides[d]
                else:
                    w *= 1.0 - t
                    at += lo * strides[d]
            if w:
                acc += w * flat[at]  # the cell's double, as logv[idx] gives it
        return float(np.exp(acc + total))

    def curve(self, axis: int, fixed: Sequence[float], xs: np.ndarray, monotone: bool = False) -> np.ndarray:
        """Latencies at every x of `xs` along `axis`, the other axes at `fixed` (in axis order, the
        interpolated axis left out): vectorised, the same numbers as calling the grid point by point.
        `monotone`: the grid's nodes along the axis as a running maximum, for an axis along which the work
        only grows (a GEMM's rows: the same weights read, more of everything else), so that a noisy cell
        faster than a smaller one (vLLM 0.14.0's H100 LM head: 0.43 ms at 1 row, 0.36 ms at 8) prices none
        of the larger shapes below the smaller."""
        nodes = []
        for g in self.axes[axis]:
            pt = list(fixed)
            pt.insert(axis, g)
            nodes.append(np.log(self(*pt)))
        nodes = np.asarray(nodes)
        if monotone:
            nodes = np.maximum.accumulate(nodes)
        lax = self.log_axes[axis]
        lx = np.log(np.asarray(xs, dtype=float))
        out = np.interp(lx, lax, nodes)  # clamps below the bottom (the launch floor) and at the top
        above = lx > lax[-1]
        out[above] += self.up[axis] * (lx[above] - lax[-1])
        return np.exp(out)


def _fill(logv: np.ndarray, log_axes: Sequence[np.ndarray], up: Sequence[float]) -> np.ndarray:
    """Unmeasured cells (NaN) from their measured neighbours: interpolated in log-log between the
    nearest measured cells on both sides along an axis (averaged over the axes where that exists);
    a cell with neighbours on one side only is scaled from the nearest by that axis' work exponent,
    and only once no cell can be interpolated any more."""
    v = logv.copy()
    while np.isnan(v).any():
        interp_sum, interp_n = np.zeros_like(v), np.zeros_like(v)
        extra_sum, extra_n = np.zeros_like(v), np.zeros_like(v)
        for d, lax in enumerate(log_axes):
            vd = np.moveaxis(v, d, -1)
            n = vd.shape[-1]
            pos = np.broadcast_to(np.arange(n), vd.shape)
            ok = ~np.isnan(vd)
            below = np.maximum.accumulate(np.where(ok, pos, -1), axis=-1)
            above = np.flip(np.minimum.accumulate(np.flip(np.where(ok, pos, n), -1), axis=-1), -1)
            has_b, has_a = below >= 0, above < n
            bi, ai = np.clip(below, 0, n - 1), np.clip(above, 0, n - 1)
            vb = np.take_along_axis(vd, bi, -1)
            va = np.take_along_axis(vd, ai, -1)
            x, xb, xa = lax[pos], lax[bi], lax[ai]
            nan = ~ok
            both = nan & has_b & has_a
            with np.errstate(invalid="ignore", divide="ignore"):
                t = np.where(both, (x - xb) / np.where(both, xa - xb, 1.0), 0.0)
            est_i = np.where(both, vb + t * (va - vb), 0.0)
            one = nan & (has_b ^ has_a)
            est_e = np.where(has_b, vb + up[d] * (x - xb), va + up[d] * (x - xa))
            est_e = np.where(one, est_e, 0.0)
            interp_sum += np.moveaxis(est_i, -1, d)
            interp_n += np.moveaxis(both.astype(float), -1, d)
            extra_sum += np.moveaxis(est_e, -1, d)
            extra_n += np.moveaxis(one.astype(float), -1, d)
        if (interp_n > 0).any():
            fill = interp_n > 0
            v[fill] = interp_sum[fill] / interp_n[fill]
        else:
            fill = extra_n > 0
            v[fill] = extra_sum[fill] / extra_n[fill]
    return v


@dataclass(frozen=True)
class HeadsMatch:
    """Which measured (heads, kv heads) stands in for the model's, and how many times its batch."""
    heads: int
    kv_heads: int
    batch_factor: float


def match_heads(model_heads: int, model_kv: int, measured: Sequence[tuple[int, int]],
                decode: bool = False) -> HeadsMatch:
    """An attention kernel splits its work into (sequence, kv head) tiles (FlashAttention's grid is
    batch x heads), so b sequences of H heads cost about as much as b * H / H' sequences of H' heads
    at the same query-per-kv-head ratio. The measured pair with the closest ratio, then the closest
    kv-head count, is used with the batch scaled accordingly (exact when the pair was measured).

    Decoding (`decode`) reads each sequence's KV once per kv head, whatever number of query heads share
    it (FlashAttention 3 packs a kv head's query heads into one tile to decode, hopper/heuristics.h
    should_pack_gqa): its batch is scaled by the kv heads instead. The tables show it: vLLM 0.14.0's H100
    decode attention at 4 kv heads takes the same time for 4 to 64 query heads (within 3%, batch 1-128,
    1-4k tokens) and 1.8x that at 8 kv heads (batch 32, 4k). By query heads, a 28-head 4-kv-head model
    (Qwen2.5-7B) stood in by 32 heads over 4 read 12.5% too little KV."""
    group = model_heads / model_kv
    if (model_heads, model_kv) in set(measured):
        return HeadsMatch(model_heads, model_kv, 1.0)
    best = min(measured, key=lambda hk: (abs(np.log(hk[0] / hk[1] / group)), abs(np.log(hk[1] / model_kv)), -hk[1]))
    return HeadsMatch(best[0], best[1], model_kv / best[1] if decode else model_heads / best[0])


# the token-to-expert routings aiconfigurator's collector times the fused MoE under (collector/vllm/collect_moe.py:
# balanced logits, or expert loads drawn from a power law of exponent 1.01 or 1.2)
MOE_DISTRIBUTIONS = ("balanced", "power_law_1.01", "power_law_1.2")


class KernelDB:
    """The measured tables of one (gpu, framework, version) and interpolated look-ups in seconds.

    version=None takes, per op, the version present nearest to `near` (the framework release the simulated
    server runs; on a tie the older), or the newest with near=None (they differ per op: the collector does
    not re-measure every op at every release). `data_dir`: a folder laid out as aiconfigurator-core's
    `systems/data` (None: the installed package's). `moe_distribution`: the tables' token-to-expert routing
    whose fused-MoE rows are read (`balanced`, `power_law_1.01`, `power_law_1.2`); a table without such rows
    is read at `balanced`, and `moe_distribution_used` says so."""

    def __init__(self, gpu: str, framework: str = "vllm", version: Optional[str] = None,
                 data_dir: Optional[str | Path] = None, kernel_sources: Optional[dict] = None,
                 near: Optional[str] = None, moe_distribution: str = "balanced"):
        self.source = find_tables(gpu, framework, version, data_dir, own_sources=bool(kernel_sources))
        root = self.source.root
        if not root.is_dir():
            raise KernelDBError(f"kernel database folder {root} does not exist")
        gpus = sorted(p.name for p in root.iterdir() if p.is_dir())
        if gpu not in gpus:
            raise KernelDBError(f"GPU {gpu!r} is not in the kernel database {root}; it has: {', '.join(gpus)}")
        if framework not in FRAMEWORKS:
            raise KernelDBError(f"framework {framework!r}: expected one of {sorted(FRAMEWORKS)}")
        self.root, self.gpu, self.framework, self.requested_version = root, gpu, framework, version
        self.near = near
        if moe_distribution not in MOE_DISTRIBUTIONS:
            raise ValueError(f"cost_model.moe_distribution={moe_distribution!r}: expected one of "
                             f"{', '.join(MOE_DISTRIBUTIONS)} (the routings aiconfigurator's MoE tables measured)")
        self.moe_distribution = moe_distribution
        self.moe_distribution_used: dict[str, str] = {}  # moe dtype -> the routing its rows were read at
        self.sources = {**FRAMEWORKS[framework], **{op: (v,) if isinstance(v, str) and op != "allreduce_backend" else v
                                                    for op, v in (kernel_sources or {}).items()}}
        self.versions: dict[str, str] = {}
        self.sources_used: dict[str, str] = {}
        # key -> (file, columns, filters) of every table read (testbed.sim.kernel_export ships exactly these rows)
        self.reads: dict[str, tuple[Path, list[str], list[tuple]]] = {}

    # ---------------------------------------------------------------- reading
    def _candidates(self, op: str) -> list[Path]:
        """The op's table files in order of preference: newest first, or nearest to `near` first (only the
        requested one when a version is set)."""
        folder, file = OPS[op]
        fw_dir = self.root / self.gpu / folder / self.framework
        present = sorted((p.name for p in fw_dir.iterdir() if (p / file).is_file()), key=_version_key,
                         reverse=True) if fw_dir.is_dir() else []
        if not present:
            have = sorted(p.name for p in (self.root / self.gpu / folder).iterdir()
                          if p.is_dir()) if (self.root / self.gpu / folder).is_dir() else []
            raise KernelDBError(f"{self.gpu} has no {op} table for framework {self.framework!r} ({file}); "
                                f"frameworks with {folder} tables there: {', '.join(have) or 'none'}"
                                + self._why_not_shipped(op))
        if self.requested_version is None:
            if self.near is not None:
                present = sorted(present, key=lambda v: (_version_distance(v, self.near), _version_key(v)))
            return [fw_dir / v / file for v in present]
        if self.requested_version in present:
            return [fw_dir / self.requested_version / file]
        raise KernelDBError(f"{self.gpu} {self.framework} has no {op} table of version "
                            f"{self.requested_version!r}; versions: {', '.join(present)}")

    def _why_not_shipped(self, op: str) -> str:
        """Why the shipped tables lack an op: what the package they were cut from said (manifest.json)."""
        if self.source.kind != "shipped":
            return ""
        gone = shipped_manifest()["gpus"][self.gpu][self.framework].get("unavailable", {})
        why = next((v for k, v in gone.items() if k.startswith(op)), None)
        return f" (shipped from {self.source.package}, where {why})" if why else ""

    def _source(self, op_source: str, dtype: str) -> str:
        """The preference list for an op's rows of `dtype` (its own when the framework names one)."""
        key = f"{op_source}_{dtype}"
        return key if dtype != "bfloat16" and key in self.sources else op_source

    def _read(self, op: str, columns: list[str], filters: list[tuple], source: Optional[str] = None,
              key: Optional[str] = None, exclude: tuple = ()):
        """Rows of the newest table version that has them: only `columns` (and latency), only rows matching
        `filters` (a filter on a column an older table lacks is dropped: e.g. no window_size means no
        sliding window) and, with `source`, of the op's preferred kernel source: the newest version
        measuring one of the preferred sources, else the newest whose rows come from a single source.
        `key`: the name `versions` and `sources_used` record it under (default: `op`)."""
        import pandas as pd
        import pyarrow.parquet as pq

        why, tables = [], []
        for path in self._candidates(op):
            if path.parent.name in exclude:  # versions the caller found wanting (attention_grid: a head size)
                continue
            names = set(pq.read_schema(path).names)
            use = [f for f in filters if f[0] in names]
            rule = " and ".join(f"{c} {o} {v!r}" for c, o, v in use) or "no filter"
            avail = set(pd.read_parquet(path, columns=["kernel_source"], filters=use or None).kernel_source.unique()) \
                if source is not None else {None}
            if not avail:
                why.append(f"{path.parent.name}: no rows where {rule}")
                continue
            tables.append((path, names, use, avail))
        if source is not None:
            wanted = self.sources[source]
            chosen = next(((t, k) for t in tables for k in wanted if k in t[3]), None) \
                or next(((t, next(iter(t[3]))) for t in tables if len(t[3]) == 1), None)
            if chosen is None:
                why += [f"{t[0].parent.name}: kernel sources {sorted(t[3])}, none of {list(wanted)}" for t in tables]
                raise KernelDBError(f"{self.gpu} {self.framework} {op}: no usable table ({'; '.join(why)})")
            (path, names, use, _), pick = chosen
            use = use + [("kernel_source", "==", pick)]
            self.sources_used[key or op] = pick
        elif tables:
            path, names, use, _ = tables[0]
        else:
            raise KernelDBError(f"{self.gpu} {self.framework} {op}: no usable table ({'; '.join(why)})")
        self.versions[key or op] = path.parent.name
        cols = [c for c in columns if c in names] + ["latency"]
        self.reads[key or op] = (path, cols, use)
        return pd.read_parquet(path, columns=cols, filters=use or None)

    def _path(self, op: str) -> Path:
        """The newest table file of an op (its version recorded in `versions`)."""
        path = self._candidates(op)[0]
        self.versions[op] = path.parent.name
        return path

    # ---------------------------------------------------------------- tables
    @functools.cached_property
    def gemm_grid(self) -> LogGrid:
        return self.gemm_grid_of("bfloat16")

    @functools.lru_cache(maxsize=None)
    def gemm_grid_of(self, dtype: str) -> LogGrid:
        """GEMM latency over (m, n, k) for the tables' gemm_dtype `dtype` (bfloat16; fp8: W8A8 with
        per-tensor scales, vLLM's Fp8LinearMethod on GPUs with fp8 tensor cores)."""
        df = self._read("gemm", ["m", "n", "k"], [("gemm_dtype", "==", dtype)], source=self._source("gemm", dtype),
                        key="gemm" if dtype == "bfloat16" else f"gemm {dtype}")
        df = df.groupby(["m", "n", "k"], as_index=False).latency.median()
        return LogGrid.from_rows([df.m.values, df.n.values, df.k.values], df.latency.values * 1e-3, up=(1, 1, 1))

    @functools.lru_cache(maxsize=None)
    def _attention_rows(self, op: str, kv_dtype: str = "bfloat16", exclude: tuple = ()):
        cols = ["batch_size", "isl", "step", "num_heads", "num_key_value_heads", "head_dim"]
        key = op if kv_dtype == "bfloat16" else f"{op} {kv_dtype}"
        return self._read(op, cols, [("kv_cache_dtype", "==", kv_dtype), ("window_size", "==", 0)],
                          source=self._source("attention", kv_dtype), exclude=exclude,
                          key=key if not exclude else f"{key} (another head size)")

    @property
    def _context_rows(self):
        return self._attention_rows("context_attention", "bfloat16")

    @property
    def _generation_rows(self):
        return self._attention_rows("generation_attention", "bfloat16")

    @functools.lru_cache(maxsize=None)
    def attention_grid(self, phase: str, heads: int, kv_heads: int, head_dim: int,
                       kv_dtype: str = "bfloat16") -> tuple[LogGrid, HeadsMatch]:
        """Context ("context": batch x prompt length, no cached prefix) or decode ("generation": batch
        x KV length) attention at these per-GPU heads. The decode table's `step` is the tokens
        already generated after a 1-token prompt (isl=1), so a row attends over isl + step KV tokens;
        aiconfigurator's engine keys the same rows by that sum (its table view of
        generation_attention_perf lists 2, 4, ..., 131072 for steps 1, 3, ..., 131071).
        `kv_dtype`: the tables' kv_cache_dtype (bfloat16, fp8), bf16 queries either way."""
        op = "context_attention" if phase == "context" else "generation_attention"
        key = op if kv_dtype == "bfloat16" else f"{op} {kv_dtype}"  # as _attention_rows records its reads
        df = self._attention_rows(op, kv_dtype)
        hd, measured, tried = df[df.head_dim == head_dim], set(df.head_dim), (self.reads[key][0].parent.name,)
        while hd.empty and len(tried) < len(self._candidates(op)):
            # the preferred version lacks this head size (vLLM 0.14.0's H100 tables time 128 only): the next one
            try:
                df = self._attention_rows(op, kv_dtype, exclude=tried)
            except KernelDBError:
                break
            hd, measured = df[df.head_dim == head_dim], measured | set(df.head_dim)
            tried += (self.reads[f"{key} (another head size)"][0].parent.name,)
        if hd.empty:
            raise KernelDBError(f"{phase} attention: head_dim={head_dim} was not measured on {self.gpu} "
                                f"{self.framework}; measured: {sorted(int(h) for h in measured)}")
        pairs = sorted(set(map(tuple, hd[["num_heads", "num_key_value_heads"]].values.tolist())))
        match = match_heads(heads, kv_heads, pairs, decode=phase != "context")
        rows = hd[(hd.num_heads == match.heads) & (hd.num_key_value_heads == match.kv_heads)]
        length = rows.isl.values if phase == "context" else rows.isl.values + rows.step.values
        frame = rows.assign(length=length).groupby(["batch_size", "length"], as_index=False).latency.median()
        grid = LogGrid.from_rows([frame.batch_size.values, frame.length.values], frame.latency.values * 1e-3,
                                 up=(1, 2 if phase == "context" else 1))
        return grid, match

    @property
    def _moe_rows(self):
        return self._moe_rows_of("bfloat16")

    @functools.lru_cache(maxsize=None)
    def _moe_rows_of(self, dtype: str):
        """The fused-MoE rows at `moe_distribution` (the table nearest in version that measured it), else,
        when no table did (aiconfigurator-core's packaged tables keep `balanced` rows only), at `balanced`."""
        key = "moe" if dtype == "bfloat16" else f"moe {dtype}"
        for dist in dict.fromkeys([self.moe_distribution, "balanced"]):
            try:
                rows = self._read("moe", ["num_tokens", "hidden_size", "inter_size", "topk", "num_experts",
                                          "moe_tp_size"],
                                  [("moe_dtype", "==", dtype), ("distribution", "==", dist), ("moe_ep_size", "==", 1)],
                                  source=self._source("moe", dtype), key=key)
            except KernelDBError:
                if dist == "balanced":
                    raise
                continue
            self.moe_distribution_used[dtype] = dist
            return rows

    @functools.lru_cache(maxsize=None)
    def moe_grid(self, hidden: int, inter: int, topk: int, experts: int, tp: int,
                 dtype: str = "bfloat16") -> tuple[LogGrid, tuple]:
        """The fused-MoE latency over tokens at the closest measured (hidden, inter, topk, experts,
        tp) (exact when measured; the caller scales a stand-in's latency by the work ratio), for the
        tables' moe_dtype `dtype` (bfloat16, fp8, int4_wo)."""
        df = self._moe_rows_of(dtype)
        configs = df[["hidden_size", "inter_size", "topk", "num_experts", "moe_tp_size"]].drop_duplicates()
        want = np.log([hidden, inter / tp, topk, experts])
        have = np.log(np.column_stack([configs.hidden_size, configs.inter_size / configs.moe_tp_size,
                                       configs.topk, configs.num_experts]).astype(float))
        dist = np.abs(have - want).sum(axis=1) + 0.01 * (configs.moe_tp_size.values != tp)
        best = tuple(int(x) for x in configs.iloc[int(np.argmin(dist))].values)
        rows = df[(df.hidden_size == best[0]) & (df.inter_size == best[1]) & (df.topk == best[2])
                  & (df.num_experts == best[3]) & (df.moe_tp_size == best[4])]
        rows = rows.groupby("num_tokens", as_index=False).latency.median()
        return LogGrid.from_rows([rows.num_tokens.values], rows.latency.values * 1e-3, up=(1,)), best

    @functools.lru_cache(maxsize=None)
    def allreduce_grid(self, num_gpus: int) -> tuple[LogGrid, str]:
        """bf16 all-reduce latency over the message size in elements (aiconfigurator's comm ops key
        the tables by tokens x hidden, an element count). The framework's custom all-reduce
        (CUDA-graph captured) table, else NCCL's."""
        backend = self.sources["allreduce_backend"]
        frame, source = None, None
        if backend is not None:
            try:
                df = self._read("allreduce", ["num_gpus", "message_size"],
                                [("backend", "==", backend), ("allreduce_dtype", "==", "bfloat16")])
                frame, source = df[df.num_gpus == num_gpus], f"{self.framework} custom all-reduce"
            except (KernelDBError, FileNotFoundError):
                frame = None
        if frame is None or frame.empty:
            frame, source = self._nccl_rows(num_gpus), "nccl"
        frame = frame.groupby("message_size", as_index=False).latency.median()
        return LogGrid.from_rows([frame.message_size.values], frame.latency.values * 1e-3, up=(1,)), source

    def _nccl_rows(self, num_gpus: int):
        import pandas as pd

        nccl_dir = self.root / self.gpu / "comm" / "nccl"
        present = sorted((p.name for p in nccl_dir.iterdir() if (p / "nccl_perf.parquet").is_file()),
                         key=_version_key) if nccl_dir.is_dir() else []
        if not present:
            raise KernelDBError(f"{self.gpu} has neither a {self.framework} custom all-reduce table nor an NCCL one")
        self.versions["nccl"] = present[-1]
        path, cols = nccl_dir / present[-1] / "nccl_perf.parquet", ["num_gpus", "message_size", "latency"]
        use = [("op_name", "==", "all_reduce"), ("nccl_dtype", "==", "half")]
        self.reads["nccl"] = (path, cols, use)
        df = pd.read_parquet(path, columns=cols, filters=use)
        rows = df[df.num_gpus == num_gpus]
        if rows.empty:
            raise KernelDBError(f"all-reduce over {num_gpus} GPUs was not measured on {self.gpu}; "
                                f"measured GPU counts: {sorted(df.num_gpus.unique().tolist())}")
        return rows

    # ---------------------------------------------------------------- look-ups (seconds)
    def gemm(self, m: float, n: float, k: float) -> float:
        """One GEMM's latency, as `gemm_over_m` prices it (monotone in m)."""
        return float(self.gemm_over_m(n, k, np.array([m], dtype=float))[0])

    def gemm_over_m(self, n: int, k: int, ms: np.ndarray, dtype: str = "bfloat16") -> np.ndarray:
        grid = self.gemm_grid if dtype == "bfloat16" else self.gemm_grid_of(dtype)
        return grid.curve(0, (n, k), ms, monotone=True)

    def weight_only_gemm_over_m(self, n: int, k: int, ms: np.ndarray, bytes_per_weight: float, flops: float,
                                bandwidth: float) -> np.ndarray:
        """A weight-only quantised GEMM (int4 AWQ/GPTQ, or fp8 on a GPU without fp8 tensor cores: vLLM's
        Marlin kernels dequantise the weights to bf16 in the kernel), which the vLLM tables do not
        measure (aiconfigurator-core's sdk likewise maps int4_wo to bf16 compute, GEMMQuantMode in
        sdk/common.py): the bf16 latency scaled by the ratio of the two GEMMs' roofline times (2 m n k
        FLOPs at `flops`; the weights at `bytes_per_weight` vs 2 plus bf16 activations in and out, at
        `bandwidth`), so a small-m GEMM gains the weight bytes saved and a large-m one nothing; never
        below the bf16 table's smallest latency (its launch floor)."""
        ms = np.asarray(ms, dtype=float)
        bf16 = self.gemm_grid.curve(0, (n, k), ms)
        compute = 2.0 * ms * n * k / flops
        activations = 2.0 * (ms * k + ms * n)
        ratio = (np.maximum(compute, (n * k * bytes_per_weight + activations) / bandwidth)
                 / np.maximum(compute, (2.0 * n * k + activations) / bandwidth))
        floor = float(np.exp(self.gemm_grid.logv.min()))
        return np.maximum(bf16 * ratio, np.minimum(bf16, floor))

    def context_attention(self, batch: float, length: float, heads: int, kv_heads: int, head_dim: int,
                          kv_dtype: str = "bfloat16") -> float:
        grid, match = self.attention_grid("context", heads, kv_heads, head_dim, kv_dtype)
        return grid(batch * match.batch_factor, length)

    def generation_attention(self, batch: float, kv_len: float, heads: int, kv_heads: int, head_dim: int,
                             kv_dtype: str = "bfloat16") -> float:
        grid, match = self.attention_grid("generation", heads, kv_heads, head_dim, kv_dtype)
        return grid(batch * match.batch_factor, kv_len)

    def moe_over_tokens(self, tokens: np.ndarray, hidden: int, inter: int, topk: int, experts: int, tp: int,
                        flops: float, bandwidth: float, dtype: str = "bfloat16") -> np.ndarray:
        """Fused MoE (routed experts, tokens spread as `moe_distribution` says) for every token count in `tokens`. A
        stand-in configuration's latency is scaled by the ratio of the two configurations' roofline
        times at each token count (FLOPs of the routed tokens vs bytes of the experts they touch)."""
        grid, best = self.moe_grid(hidden, inter, topk, experts, tp, dtype)
        t = grid.curve(0, (), np.asarray(tokens, dtype=float))
        if best != (hidden, inter, topk, experts, tp):
            t = t * _moe_roofline(tokens, hidden, inter / tp, topk, experts, flops, bandwidth) \
                / _moe_roofline(tokens, best[0], best[1] / best[4], best[2], best[3], flops, bandwidth)
        return t

    def allreduce_over_elements(self, elements: np.ndarray, num_gpus: int) -> np.ndarray:
        grid, _ = self.allreduce_grid(num_gpus)
        return grid.curve(0, (), np.asarray(elements, dtype=float))


def _moe_roofline(tokens, hidden, inter_per_gpu, topk, experts, flops, bandwidth):
    tokens = np.asarray(tokens, dtype=float)
    work = 2 * tokens * topk * 3 * hidden * inter_per_gpu / flops
    touched = np.minimum(experts, tokens * topk)
    return np.maximum(work, touched * 3 * hidden * inter_per_gpu * 2 / bandwidth)


def versions_table(framework: str = "vllm", data_dir: Optional[str | Path] = None) -> list[tuple[str, dict]]:
    """(gpu, {op: the version a model reads, or '-'}) for every GPU in the database."""
    root = Path(data_dir) if data_dir is not None else package_data_dir()
    out = []
    for gpu in sorted(p.name for p in root.iterdir() if p.is_dir()):
        db, row = KernelDB(gpu, framework, data_dir=root), {}
        reads = {"gemm": lambda: db.gemm_grid, "context_attention": lambda: db._context_rows,
                 "moe": lambda: db._moe_rows, "allreduce": lambda: db.allreduce_grid(2)}
        for op, read in reads.items():
            try:
                read()
                row[op] = db.versions.get(op) or f"nccl {db.versions.get('nccl')}"
            except KernelDBError:
                row[op] = "-"
        out.append((gpu, row))
    return out


if __name__ == "__main__":
    import sys

    fw = sys.argv[1] if len(sys.argv) > 1 else "vllm"
    try:
        where = package_data_dir()
    except ImportError:  # without the package: the tables shipped inside this one
        where = SHIPPED_DIR
    from tabulate import tabulate

    print(f"The table version each op reads ({fw}, {where}):")
    print(tabulate([[gpu, *row.values()] for gpu, row in versions_table(fw, where)],
                   headers=["GPU", "gemm", "attention", "moe", "all-reduce"], tablefmt="pipe", disable_numparse=True))
