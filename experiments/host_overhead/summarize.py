"""Fits a + b*B (per step + per sequence, microseconds) to every measured part and writes
`results/fits.csv` and `results/fits.md` (the tables the README quotes).

    python experiments/host_overhead/summarize.py
"""
from __future__ import annotations

import csv
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import fit_line  # noqa: E402

RES = Path(__file__).resolve().parent / "results"
# (file prefix, the columns that name one series besides the part, the parts to fit)
SERIES = {
    "scheduler": (("mode", "context"), ("schedule", "update", "both")),
    "scheduler-warm": (("mode", "context"), ("schedule", "update", "both")),
    "runner": (("context",), ("prep", "post", "prep_plus_post", "_update_states", "_prepare_inputs",
                              "_build_attention_metadata", "_bookkeeping_sync", "schedule", "update",
                              "host_engine_core", "process_outputs")),
    "output": (("tokenizer",), ("encode", "decode", "process_outputs", "sse_chunk", "front_end")),
}


def read(path: Path) -> list[dict]:
    with open(path) as f:
        return list(csv.DictReader(f))


def main() -> None:
    fits = []
    for kind, (keys, parts) in SERIES.items():
        for path in sorted(RES.glob(f"{kind}_v*.csv")):
            groups = defaultdict(list)
            for r in read(path):
                if r["part"] in parts:
                    groups[(r["vllm"], r["part"]) + tuple(r[k] for k in keys)].append(r)
            for (ver, part, *kv), rows in groups.items():
                rows.sort(key=lambda r: int(r["batch"]))
                B = [int(r["batch"]) for r in rows]
                out = dict(measure=kind, vllm=ver, part=part, series=" ".join(f"{k}={v}" for k, v in zip(keys, kv)),
                           batches=f"{B[0]}-{B[-1]}")
                for clock, col in (("wall", "median_us"), ("cpu", "cpu_median_us")):
                    if col not in rows[0]:
                        continue
                    a, b, worst = fit_line(B, [float(r[col]) for r in rows])
                    out.update({f"{clock}_a_us": round(a, 1), f"{clock}_b_us": round(b, 2),
                                f"{clock}_worst_rel_resid": round(worst, 3),
                                f"{clock}_B1_us": float(rows[0][col]), f"{clock}_Bmax_us": float(rows[-1][col])})
                fits.append(out)
    if not fits:
        raise SystemExit(f"no results in {RES}")
    cols = list(dict.fromkeys(k for f in fits for k in f))
    with open(RES / "fits.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        w.writerows(fits)
    lines = ["| measure | vLLM | part | series | a (us/step) | b (us/seq) | worst rel. resid | B=1 | B=max | CPU-time a | CPU-time b |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for f in fits:
        lines.append(f"| {f['measure']} | {f['vllm']} | {f['part']} | {f['series']} | {f['wall_a_us']} | {f['wall_b_us']} | "
                     f"{f['wall_worst_rel_resid']} | {f['wall_B1_us']} | {f['wall_Bmax_us']} | {f.get('cpu_a_us', '')} | "
                     f"{f.get('cpu_b_us', '')} |")
    lines += ["", "Emulated-GPU engine loop (async_gap.py): device step period, median us (sync = async scheduling off)", ""]
    for path in sorted(RES.glob("async_gap_v*.csv")):
        per = defaultdict(dict)
        for r in read(path):
            if r["part"] in ("period", "gap"):
                per[(r["vllm"], r["gpu_ms"], int(r["batch"]))][(r["mode"], r["part"])] = float(r["median_us"])
        lines.append("| vLLM | device step (ms) | B | period sync | period async | idle gap sync | idle gap async |")
        lines.append("|---|---|---|---|---|---|---|")
        for (ver, g, B), d in sorted(per.items(), key=lambda kv: (kv[0][0], float(kv[0][1]), kv[0][2])):
            lines.append(f"| {ver} | {g} | {B} | {d.get(('sync', 'period'))} | {d.get(('async', 'period'))} | "
                         f"{d.get(('sync', 'gap'))} | {d.get(('async', 'gap'))} |")
        lines.append("")
    (RES / "fits.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
