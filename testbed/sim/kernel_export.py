"""Regenerate the kernel tables shipped inside the package (`testbed/sim/kernel_data/`) from an
installed aiconfigurator-core:

    python -m testbed.sim.kernel_export            # writes testbed/sim/kernel_data/
    python -m testbed.sim.kernel_export --check    # exit 1 if the shipped files differ from a fresh export

Why ship tables at all: `cost_model=kernels` is the default, and aiconfigurator-core (the `kernels`
extra) cannot be installed everywhere the testbed installs: 0.12.0 has abi3 wheels for manylinux_2_28
x86_64 and aarch64 and macOS 11+ arm64 only, for Python >=3.11,<3.14, no sdist, so nothing for
Windows, Python 3.14 or an older glibc; it is also an 81 MB wheel (114 MB installed, every GPU and
framework) that asks for numpy>=2.1. The default presets need a few hundred kB of it.

What is shipped, per GPU of the hardware presets (`conf/hardware/*.yaml`'s `kernel_db_gpu`), framework
vLLM: exactly the rows and columns `testbed.sim.kernel_db` reads for any model at every dtype it prices
(GEMMs bf16 and fp8; context and decode attention with a bf16 and an fp8 KV cache; fused MoE bf16, fp8 and
int4 weight-only; vLLM's custom all-reduce; NCCL's all-reduce), in the table versions and kernel sources
it picks. The rows are chosen by running those reads against the installed package (`KernelDB.reads`
records each file, its columns and its filters), so the shipped set follows any change to the reader's
rules; every row keeps its file's row order, and the latency column its exact values. Shapes are not
trimmed: any model reads what it would read from the package, hence bit-identical step times
(tests/test_kernel_tables.py checks both).
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd
from tabulate import tabulate

from testbed.sim.kernel_db import PACKAGE, SHIPPED_DIR, KernelDB, KernelDBError, installed_version, package_data_dir

FRAMEWORK = "vllm"
CONF_HARDWARE = Path(__file__).resolve().parents[1] / "conf" / "hardware"
UPSTREAM = "https://github.com/ai-dynamo/aiconfigurator"
COPYRIGHT = "Copyright (c) 2025-2026 NVIDIA CORPORATION & AFFILIATES"


def preset_gpus() -> list[str]:
    """The `kernel_db_gpu` of every hardware preset that names one."""
    from omegaconf import OmegaConf

    return sorted({g for p in CONF_HARDWARE.glob("*.yaml") if (g := OmegaConf.load(p).get("kernel_db_gpu"))})


def read_everything(db: KernelDB) -> dict[str, str]:
    """Make every table read `testbed.sim.kernel_cost` can make on this GPU, at every dtype it prices;
    return {read: why} for those the tables cannot serve (a model needing one fails either way: the
    manifest keeps the reason, so the shipped tables can say it)."""
    reads = {f"gemm {d}": lambda d=d: db.gemm_grid_of(d) for d in ("bfloat16", "fp8")}
    reads.update({f"{op} {kv}": lambda op=op, kv=kv: db._attention_rows(op, kv)
                  for op in ("context_attention", "generation_attention") for kv in ("bfloat16", "fp8")})
    reads.update({f"moe {d}": lambda d=d: db._moe_rows_of(d) for d in ("bfloat16", "fp8", "int4_wo")})
    reads.update({f"allreduce {n} GPUs": lambda n=n: db.allreduce_grid(n) for n in (2, 4, 8)})
    reads["nccl"] = lambda: db._nccl_rows(2)
    failed = {}
    for name, read in reads.items():
        try:
            read()
        except (KernelDBError, FileNotFoundError) as e:
            failed[name] = str(e).replace(str(db.root), "systems/data")
    return failed


def _matches(df: pd.DataFrame, filters: list[tuple]) -> np.ndarray:
    keep = np.ones(len(df), dtype=bool)
    for col, op, value in filters:
        if op != "==":
            raise ValueError(f"filter {col} {op} {value!r}: the exporter knows '==' only")
        keep &= (df[col] == value).to_numpy()
    return keep


def export(out: Path, gpus: list[str] | None = None) -> dict:
    """Write the trimmed tables, manifest.json and NOTICE.md under `out`; return the manifest."""
    src = package_data_dir()
    version = installed_version()
    gpus = gpus or preset_gpus()
    manifest = {"package": PACKAGE, "version": version, "license": "Apache-2.0", "upstream": UPSTREAM,
                "copyright": COPYRIGHT, "framework": FRAMEWORK, "generated_by": "python -m testbed.sim.kernel_export",
                "gpus": {}}
    out.mkdir(parents=True, exist_ok=True)
    for gpu in gpus:
        db = KernelDB(gpu, FRAMEWORK, data_dir=src)
        unavailable = read_everything(db)
        by_file: dict[Path, tuple[list[str], list[list[tuple]], list[str]]] = {}
        for key, (path, cols, filters) in db.reads.items():
            cs, fs, keys = by_file.setdefault(path, ([], [], []))
            cs += [c for c in cols if c not in cs]
            fs.append(filters)
            keys.append(key)
        files = {}
        for path, (cols, filter_sets, keys) in sorted(by_file.items()):
            import pyarrow.parquet as pq

            names = pq.read_schema(path).names
            filter_cols = [c for fs in filter_sets for c, _, _ in fs]
            keep_cols = [c for c in names if c in set(cols) | set(filter_cols) | {"kernel_source"}]
            full = pd.read_parquet(path, columns=keep_cols)
            mask = np.zeros(len(full), dtype=bool)
            for fs in filter_sets:
                mask |= _matches(full, fs)
            rows = full[mask].reset_index(drop=True)
            rel = path.relative_to(src)
            (out / rel).parent.mkdir(parents=True, exist_ok=True)
            rows.to_parquet(out / rel, index=False, compression="zstd")
            files[rel.as_posix()] = {"rows": int(len(rows)), "of_rows": int(len(full)), "columns": keep_cols,
                                     "of_columns": len(names), "reads": sorted(keys)}
        manifest["gpus"][gpu] = {FRAMEWORK: {"versions": dict(sorted(db.versions.items())),
                                             "kernel_sources": dict(sorted(db.sources_used.items())), "files": files,
                                             "unavailable": unavailable}}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    (out / "NOTICE.md").write_text(notice(manifest))
    return manifest


def notice(m: dict) -> str:
    """NOTICE.md: where the shipped tables come from, what was changed (Apache-2.0 4(b)), and per GPU the
    table versions read and the rows kept, laid out by tabulate as every table of the project."""
    rows = [[gpu, *(fw[FRAMEWORK]["versions"].get(k, "-") for k in KEYS),
             f"{sum(f['rows'] for f in fw[FRAMEWORK]['files'].values()):,} of "
             f"{sum(f['of_rows'] for f in fw[FRAMEWORK]['files'].values()):,}"]
            for gpu, fw in sorted(m["gpus"].items())]
    table = tabulate(rows, headers=["GPU", *KEYS, "rows"], tablefmt="pipe", disable_numparse=True)
    return f"""# Measured kernel tables shipped with llm-sched-testbed

The Parquet files below this folder are excerpts of the kernel latency tables in
**{m['package']} {m['version']}** (`aiconfigurator_core/systems/data/<gpu>/<op>/<framework>/<version>/`),
part of NVIDIA's AIConfigurator ({m['upstream']}), {m['copyright']},
licensed under the Apache License, Version 2.0 (a copy: `LICENSE-aiconfigurator-core` beside this file;
the package's metadata: `License-Expression: Apache-2.0`).

Modifications (Apache-2.0 section 4(b)): only the {m['framework']} tables of the GPUs the testbed's
hardware presets name, only the files, rows and columns `testbed/sim/kernel_db.py` reads (the table
version and kernel source it picks per op, at the dtypes it prices; vLLM's custom all-reduce and NCCL's
all-reduce), rewritten with zstd compression. Values are unchanged. `manifest.json` lists every file with
its rows and columns kept out of the original's; `{m['generated_by']}` regenerates this folder from an
installed {m['package']} (`--check` compares).

Table versions read (vLLM release the kernels were timed in) and rows kept:

{table}
"""


KEYS = ("gemm", "gemm fp8", "context_attention", "generation_attention", "moe", "allreduce", "nccl")


def _same(a: Path, b: Path) -> list[str]:
    """Files that differ between two exports (Parquet compared by content)."""
    diffs = []
    names = {p.relative_to(a).as_posix() for p in a.rglob("*") if p.is_file()} | \
            {p.relative_to(b).as_posix() for p in b.rglob("*") if p.is_file()}
    upstream = a / "upstream.json"  # tables added from the upstream repository, which no export writes
    added = set(json.loads(upstream.read_text())["files"]) | {"upstream.json", "NOTICE-upstream.md"} if upstream.is_file() \
        else set()
    for n in sorted(names - {"LICENSE-aiconfigurator-core"} - added):  # the licence text is kept, not exported
        pa, pb = a / n, b / n
        if not (pa.is_file() and pb.is_file()):
            diffs.append(f"{n}: only in {'the shipped folder' if pa.is_file() else 'a fresh export'}")
        elif n.endswith(".parquet"):
            if not pd.read_parquet(pa).equals(pd.read_parquet(pb)):
                diffs.append(f"{n}: rows differ")
        elif pa.read_bytes() != pb.read_bytes():
            diffs.append(f"{n}: differs")
    return diffs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=SHIPPED_DIR)
    ap.add_argument("--check", action="store_true", help="compare --out with a fresh export; write nothing")
    args = ap.parse_args(argv)
    if args.check:
        with tempfile.TemporaryDirectory() as tmp:
            export(Path(tmp))
            diffs = _same(args.out, Path(tmp))
        print("\n".join(diffs) if diffs else f"{args.out} is what {PACKAGE} {installed_version()} exports")
        return 1 if diffs else 0
    licence = args.out / "LICENSE-aiconfigurator-core"
    keep = licence.read_bytes() if licence.is_file() else None
    if args.out.exists():
        shutil.rmtree(args.out)
    m = export(args.out)
    if keep is not None:
        licence.write_bytes(keep)
    size = sum(p.stat().st_size for p in args.out.rglob("*") if p.is_file())
    print(f"{args.out}: {len(m['gpus'])} GPUs, {size / 1e6:.2f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
