"""`testbed-disagg-search`: how many of a fixed number of replicas should prefill (DistServe's question).

For `disagg.search_total_replicas` = N replicas (each the run's replica: same model, GPUs and
parallelism, so equal GPU counts), it tries the co-located layout (N replicas serving both phases)
and every prefill:decode split p:(N-p), and for each finds the highest load (`trace.rate_scale`)
at which `slo.attainment_target` of the requests meet the SLO, by the bisection of
`testbed-capacity` (`testbed.app.analysis.capacity.bisect_max_scale`, bounds `capacity.*`): DistServe's
per-GPU goodput search over placements (Zhong et al., OSDI 2024, section 4), here over the pool
ratio only. With `disagg.search_rate_scales` set it also runs every layout at those loads, for
goodput against rate.

Writes to `output.dir`: `search.json` (each layout's answer and bisection curve), `table.md` (layout
-> max load, goodput and the best split), `sweep_summary.csv` and `*_vs_rate.png` (the rate grid).

SIGINT or SIGTERM stops the search within the simulation under way (app/entry/stop.py): the files are
written with the layouts searched so far (the one under way with its curve so far), `interrupted`
set in search.json, and the command exits 128 + the signal (it once ignored the signal and ran on).
"""
from __future__ import annotations

import copy
import json
import logging
from pathlib import Path

import hydra
import pandas as pd
from omegaconf import DictConfig, OmegaConf

from testbed.app.entry.cli import CONF_DIR
from testbed.app.assembly.config import register_configs
from testbed.app.assembly.validate import check_config
from testbed.app.analysis.tables import markdown_table

log = logging.getLogger("testbed")
register_configs()

COLUMNS = ["layout", "prefill_replicas", "decode_replicas", "rate_scale", "offered_request_rate", "request_goodput",
           "slo_attainment", "completed", "num_requests", "p50_ttft_ms", "p99_ttft_ms", "p50_tpot_ms", "p99_tpot_ms",
           "mean_kv_transfer_ms", "p99_kv_wait_ms", "prefill_utilization", "decode_utilization", "utilization"]


def layouts(total: int) -> list[tuple[str, int, int]]:
    """(name, prefill replicas, decode replicas): co-located first (0 prefill), then every split."""
    return [(f"colocated x{total}", 0, total)] + [(f"{p}P:{total - p}D", p, total - p) for p in range(1, total)]


def layout_config(cfg: DictConfig, prefill: int, decode: int, scale: float) -> DictConfig:
    """The run's config laid out as `prefill` + `decode` replicas (prefill 0: `decode` co-located ones)."""
    job = copy.deepcopy(cfg)
    job.trace.rate_scale = float(scale)
    job.output.progress = False
    job.disagg.enabled = prefill > 0
    if job.backend.get("async_scheduling") is None:  # the pools run without it (not modelled): so does the
        job.backend.async_scheduling = False  # co-located layout, and the layouts alone differ
    if prefill:
        job.backend.replicas = 1
        job.disagg.prefill.replicas, job.disagg.decode.replicas = prefill, decode
    else:
        job.backend.replicas = decode
    return job


def run_layout(cfg: DictConfig, name: str, prefill: int, decode: int, scale: float, stop=None) -> dict:
    """One layout at one load; `stop()` turning true cuts it short (SearchStopped: no figure)."""
    from testbed.app.analysis.capacity import SearchStopped
    from testbed.app.assembly.run import simulate

    result = simulate(layout_config(cfg, prefill, decode, scale), stop)
    s = result.summary
    if s.get("interrupted"):
        raise SearchStopped
    row = {"layout": name, "prefill_replicas": prefill, "decode_replicas": decode, "rate_scale": scale,
           **{k: s.get(k) for k in COLUMNS[4:-1]}}
    span = s["duration_s"] or 1.0
    row["utilization"] = float(result.steps["duration"].sum() / (prefill + decode) / span) if len(result.steps) else 0.0
    log.info("%s at rate_scale %.4g: attainment %.3f, goodput %.3f req/s", name, scale, s["slo_attainment"],
             s["request_goodput"])
    return row


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> dict:
    from testbed.app.analysis.capacity import SearchStopped, bisect_max_scale
    from testbed.app.entry.sweep_signals import job_stop

    check_config(cfg)
    d, c = cfg.disagg, cfg.capacity
    total = d.search_total_replicas or d.prefill.replicas + d.decode.replicas
    out = Path(cfg.output.dir)
    out.mkdir(parents=True, exist_ok=True)
    answers, grid = [], []
    with job_stop() as stop:
        for name, p, n in layouts(total):
            if stop():
                break
            rows: list[dict] = []

            def attainment(scale: float) -> float:
                rows.append(run_layout(cfg, name, p, n, scale, stop))
                return rows[-1]["slo_attainment"]

            res = bisect_max_scale(attainment, cfg.slo.attainment_target, c.lo, c.hi, c.rel_tol, c.max_evals, stop)
            best = next((r for r in rows if r["rate_scale"] == res.best_scale), None)
            answers.append({"layout": name, "prefill_replicas": p, "decode_replicas": n,
                            "max_rate_scale": res.best_scale,
                            "max_request_rate": best["offered_request_rate"] if best else None,
                            "goodput_at_max": best["request_goodput"] if best else None, "bracketed": res.bracketed,
                            "interrupted": res.interrupted,
                            "curve": [{"rate_scale": x, "slo_attainment": a} for x, a in sorted(res.curve)]})
            try:
                for x in d.search_rate_scales:
                    grid.append(run_layout(cfg, name, p, n, float(x), stop))
            except SearchStopped:  # the layout's bisection ran whole, its grid did not
                answers[-1]["interrupted"] = True
                break
        split = [a for a in answers if a["prefill_replicas"] and a["max_rate_scale"]]
        best = max(split, key=lambda a: a["max_rate_scale"]) if split else None
        result = {"total_replicas": total, "slo": cfg.slo.name, "attainment_target": cfg.slo.attainment_target,
                  "model": cfg.model.name, "trace": cfg.trace.name, "layouts": answers,
                  "best_split": best["layout"] if best else None, "interrupted": stop()}
        (out / "search.json").write_text(json.dumps(result, indent=2) + "\n")
        (out / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
        table = search_table(result)
        (out / "table.md").write_text(table + "\n")
        if grid:
            df = pd.DataFrame(grid, columns=COLUMNS)
            df.to_csv(out / "sweep_summary.csv", index=False)
            plot_vs_rate(df, out)
    print(table)
    print(f"-> {out}")
    return result


def search_table(result: dict) -> str:
    lines = [f"Max load meeting {result['slo']} for {result['attainment_target']:.0%} of requests, "
             f"{result['total_replicas']} replicas ({result['model']}, {result['trace']}):", ""]
    rows = []
    for a in result["layouts"]:
        scale = a["max_rate_scale"]
        more = "" if a["bracketed"] else " (or more)"
        rows.append((a["layout"], f"{scale:.3g}{more}", f"{a['max_request_rate']:.2f}", f"{a['goodput_at_max']:.2f}")
                    if scale else (a["layout"], "none met it", "-", "-"))
    lines.append(markdown_table(["layout", "max rate_scale", "max request rate (req/s)", "goodput there (req/s)"], rows))
    lines += ["", f"best prefill:decode split: {result['best_split'] or 'none met the target'}"]
    if result.get("interrupted"):
        lines += ["", f"interrupted: {len(result['layouts'])} of the layouts searched (the last one perhaps in part)"]
    return "\n".join(lines)


def plot_vs_rate(df: pd.DataFrame, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for metric, label in (("request_goodput", "goodput (req/s)"), ("slo_attainment", "SLO attainment"),
                          ("p99_ttft_ms", "p99 TTFT (ms)"), ("p99_tpot_ms", "p99 TPOT (ms)")):
        fig, ax = plt.subplots(figsize=(5.5, 3.8))
        for name, g in df.groupby("layout", sort=False):
            g = g.sort_values("offered_request_rate")
            ax.plot(g["offered_request_rate"], g[metric], marker="o", label=name)
        ax.set_xlabel("offered load (requests/s)")
        ax.set_ylabel(label)
        if metric.endswith("_ms"):
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / f"{metric}_vs_rate.png", dpi=110)
        plt.close(fig)


if __name__ == "__main__":
    main()
