"""testbed-report as a paper needs it: labels that name only what was swept, one colour per policy in every
figure and report, small multiples beyond eight series, SLO thresholds drawn, plain log ticks, and a header
that says what produced the numbers. The sweeps are written by hand (the files a sweep leaves), so no
simulation runs here; tests/test_cli.py builds a report of a real one."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import yaml  # noqa: E402

from testbed.app.reports import report as R  # noqa: E402
from testbed.app.reports.report_style import MAX_SERIES, log_axis, plain_number, styles  # noqa: E402
from testbed.app.reports.report_sweep import label_keys, swept_and_constant  # noqa: E402

SLO = {"name": "mlperf_llama3_8b", "ttft_ms": 2000, "tpot_ms": 100, "e2el_ms": None, "percentile": 99,
       "attainment_target": 0.9}
MANY = ["vllm", "sglang", "vllm_v0", "vllm_priority", "sarathi", "trtllm", "orca", "fastserve", "sjf", "srpt",
        "ltr", "edf"]


def make_sweep(root: Path, policies, rates=(1.0, 2.0), traces=("azure_conv",), constant=("trace.max_requests=40",),
               commit="abc123def456") -> Path:
    """The files a multirun leaves: multirun.yaml, and per job its overrides, config, summary, run_info and
    per-request table. Latencies grow with load and differ by policy, so every line is a line."""
    task = [f"policy={','.join(policies)}", f"trace.rate_scale={','.join(f'{r:g}' for r in rates)}", *constant]
    if len(traces) > 1:
        task.append(f"trace={','.join(traces)}")
    root.mkdir(parents=True)
    (root / "multirun.yaml").write_text(yaml.safe_dump({"hydra": {"overrides": {"task": task},
                                                                  "sweeper": {"params": None}}}))
    rng = np.random.default_rng(0)
    n = 0
    for p_i, policy in enumerate(policies):
        for trace in traces:
            for rate in rates:
                job = root / f"{n}_job"
                (job / ".hydra").mkdir(parents=True)
                overrides = [f"policy={policy}", f"trace.rate_scale={rate:g}", *constant] + (
                    [f"trace={trace}"] if len(traces) > 1 else [])
                (job / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
                (job / "config.yaml").write_text(yaml.safe_dump({"policy": {"name": policy}, "trace": {
                    "name": trace, "rate_scale": rate}, "slo": SLO, "model": {"name": "llama3.1-8b"}}))
                ttft = 50.0 * rate ** 2 * (1 + p_i / 4)
                (job / "summary.json").write_text(json.dumps({
                    "policy": policy, "trace": trace, "rate_scale": rate, "model": "llama3.1-8b",
                    "hardware": "h100-sxm", "cost_model": "kernels", "frontend": "vllm_api", "slo": SLO["name"],
                    "offered_request_rate": 5.0 * rate, "completed": 40, "p50_ttft_ms": ttft,
                    "median_ttft_ms": ttft, "p99_ttft_ms": 7 * ttft, "p50_tpot_ms": 8.0 + p_i,
                    "median_tpot_ms": 8.0 + p_i, "p99_tpot_ms": 20.0 + rate + p_i,
                    "request_goodput": 5 * rate / (1 + p_i),
                    "slo_attainment": 1 / (1 + 0.1 * p_i * rate)}))
                (job / "run_info.json").write_text(json.dumps({"commit": commit}))
                pd.DataFrame({"ttft_ms": rng.lognormal(np.log(ttft), 0.5, 40), "tpot_ms": rng.lognormal(2.2, 0.3, 40),
                              "e2el_ms": rng.lognormal(7, 0.5, 40)}).to_parquet(job / "requests.parquet")
                n += 1
    return root


def _table(sweep: Path) -> pd.DataFrame:
    """The sweep's merged table (written as the sweep's end writes it), one series per policy."""
    from testbed.app.reports.sweep import write_sweep_table

    df = write_sweep_table(sweep)
    return df.assign(series=df["policy"])


def _selector(page: str) -> dict[str, str]:
    """label -> colour, from the interactive figure's selector."""
    return {label: color for color, label in re.findall(
        r'<span class="swatch[^"]*" style="border-color: (#[0-9A-Fa-f]{6})"></span>([^<]+)</label>', page)}


def test_labels_name_only_the_swept_keys(tmp_path):
    sweep = make_sweep(tmp_path / "s", ["vllm", "sjf"])
    page = R.build_report(sweep).read_text()
    assert set(_selector(page)) == {"vllm", "sjf"}  # not "vllm trace.max_requests=40"
    assert "2 jobs" not in page and "4 jobs plotted; policies: vllm, sjf." in page
    header = page[page.index('<dl class="facts">'):page.index("</dl>")]
    assert "<code>trace.max_requests=40</code>" in header  # the constant goes to the header
    # the interactive figure: each selector box shows and hides the SVG lines of its series, in every panel
    boxes = set(re.findall(r'data-n="(\d+)"', page))
    assert boxes == set(re.findall(r'id="series-(\d+)-t\d+"', page)) and len(boxes) == 2
    table = page[page.index("<tbody>"):]
    selector = page[page.index('id="selector"'):page.index("</div>", page.index('id="selector"'))]
    assert "max_requests" not in table and "max_requests" not in selector


def test_swept_keys_from_hydra_sweep_syntax(tmp_path):
    (tmp_path / "multirun.yaml").write_text(yaml.safe_dump({"hydra": {
        "overrides": {"task": ["policy=vllm,sjf", "trace.rate_scale=range(1,4)", "+x.y=choice(a,b)",
                               "trace.max_requests=40", "+experiment=foo"]},
        "sweeper": {"params": {"policy.token_budget": "128,256", "seed": "0"}}}}))
    swept, constant = swept_and_constant(tmp_path, pd.Series([], dtype=str))
    assert swept == ["policy", "trace.rate_scale", "x.y", "policy.token_budget"]
    assert constant == {"trace.max_requests": "40", "experiment": "foo", "seed": "0"}
    assert label_keys(swept) == ["policy", "x.y", "policy.token_budget"]  # load is the x axis, not a series


def test_without_multirun_yaml_the_varying_overrides_are_the_swept_keys(tmp_path):
    ov = pd.Series(["policy.token_budget=128 trace.rate_scale=1 +experiment=s logger=none",
                    "policy.token_budget=256 trace.rate_scale=2 +experiment=s logger=none"])
    swept, constant = swept_and_constant(tmp_path, ov)
    assert swept == ["policy.token_budget", "trace.rate_scale"]
    assert constant == {"experiment": "s", "logger": "none"}


def test_a_policy_keeps_its_colour_across_reports(tmp_path):
    a = _selector(R.build_report(make_sweep(tmp_path / "a", ["vllm", "sjf"])).read_text())
    b = _selector(R.build_report(make_sweep(tmp_path / "b", ["edf", "sarathi", "vllm", "sglang"])).read_text())
    assert a["vllm"] == b["vllm"]
    assert len(set(b.values())) == 4  # and the four of one report differ


def test_every_figure_of_a_report_gives_a_policy_one_colour(tmp_path):
    style = styles({"vllm": (("policy", "vllm"),), "sjf": (("policy", "sjf"),)})
    sweep = make_sweep(tmp_path / "s", ["vllm", "sjf"])
    df = _table(sweep)
    figs = [R.vs_rate_figure(df, "p99_ttft_ms", "x", style, SLO),
            R.cdf_figure(sweep, df[df.rate_scale == 1.0], style, SLO, None)]
    for fig in figs:
        colors = {ln.get_label(): matplotlib.colors.to_hex(ln.get_color()) for ax in fig.axes for ln in ax.lines
                  if not ln.get_label().startswith("_")}
        assert colors == {k: s.color.lower() for k, s in style.items()}
        matplotlib.pyplot.close(fig)


def test_beyond_eight_series_small_multiples(tmp_path):
    df = _table(make_sweep(tmp_path / "s", MANY, traces=("azure_conv", "azure_code")))
    style = styles({p: (("policy", p),) for p in MANY})
    fig = R.vs_rate_figure(df, "p99_ttft_ms", "p99 TTFT (ms)", style, SLO)
    assert len(fig.axes) > 2  # more than one panel per trace
    for ax in fig.axes:
        own = [ln for ln in ax.lines if ln.get_label() in style]
        assert 0 < len(own) <= MAX_SERIES
        assert len({matplotlib.colors.to_hex(ln.get_color()) for ln in own}) == len(own)  # no colour twice
    shown = {ln.get_label() for ax in fig.axes for ln in ax.lines if ln.get_label() in style}
    assert shown == set(MANY)
    few = R.vs_rate_figure(df[df.policy.isin(MANY[:3])], "p99_ttft_ms", "x",
                           {p: style[p] for p in MANY[:3]}, SLO)
    assert len(few.axes) == 2  # one panel per trace
    matplotlib.pyplot.close("all")


def test_slo_thresholds_are_drawn(tmp_path):
    sweep = make_sweep(tmp_path / "s", ["vllm", "sjf"])
    df = _table(sweep)
    style = styles({p: (("policy", p),) for p in ("vllm", "sjf")})

    def slo_values(fig, axis):
        return {ln.get_ydata()[0] if axis == "y" else ln.get_xdata()[0]
                for ax in fig.axes for ln in ax.lines if ln.get_gid() == "slo"}

    assert slo_values(R.vs_rate_figure(df, "p99_ttft_ms", "x", style, SLO), "y") == {2000}
    assert slo_values(R.vs_rate_figure(df, "p50_tpot_ms", "x", style, SLO), "y") == {100}
    assert slo_values(R.vs_rate_figure(df, "slo_attainment", "x", style, SLO), "y") == {0.9}
    assert slo_values(R.vs_rate_figure(df, "request_goodput", "x", style, SLO), "y") == set()
    assert slo_values(R.cdf_figure(sweep, df[df.rate_scale == 2.0], style, SLO, None), "x") == {2000, 100}
    matplotlib.pyplot.close("all")


def test_log_ticks_are_plain_numbers():
    assert [plain_number(v) for v in (1, 2, 5, 10, 20, 2000, 0.5, 7)] == ["1", "2", "5", "10", "20", "2,000",
                                                                          "0.5", "7"]
    import matplotlib.pyplot as plt

    for lo, hi in ((3, 9), (40, 30000), (0.2, 3)):
        fig, ax = plt.subplots()
        ax.plot([1, 2], [lo, hi])
        log_axis(ax, "y")
        fig.canvas.draw()
        labels = [t.get_text() for t in ax.get_yticklabels() if t.get_text()]
        assert ax.get_yscale() == "log" and len(labels) >= 2, labels
        assert all(re.fullmatch(r"[0-9.,]+", t) for t in labels), labels  # no 7×10⁰
        plt.close(fig)


def test_header_names_what_produced_the_numbers(tmp_path):
    page = R.build_report(make_sweep(tmp_path / "s", ["vllm", "sjf"])).read_text()
    facts = dict(re.findall(r"<dt>([^<]+)</dt><dd>([^<]*)</dd>", page))
    assert facts["model"] == "llama3.1-8b" and facts["GPU"] == "h100-sxm" and facts["cost model"] == "kernels"
    assert facts["trace"] == "azure_conv" and facts["commit"] == "abc123def456"
    assert "TTFT ≤ 2000 ms" in facts["SLO"]


def test_a_committed_table_alone_makes_a_report(tmp_path):
    sweep = make_sweep(tmp_path / "s", ["vllm", "sjf"])
    _table(sweep)
    alone = tmp_path / "alone"
    alone.mkdir()
    (alone / "sweep_summary.csv").write_bytes((sweep / "sweep_summary.csv").read_bytes())
    page = R.build_report(alone).read_text()
    assert "Built from the committed sweep_summary.csv alone" in page and "cdfs.png" not in page
    assert set(_selector(page)) == {"vllm", "sjf"}
    assert sorted(p.name for p in (alone / "report_figures").glob("*.png")) == sorted(
        f"{m}_vs_rate.png" for m, _ in R.VS_RATE)


def test_not_a_sweep_is_one_line_and_exit_2(tmp_path):
    code = "import sys; from testbed.app.entry.commands import report; sys.exit(report())"
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "nothing")], capture_output=True, text=True,
                          cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(Path(R.__file__).parents[2])})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == f"testbed-report: {tmp_path / 'nothing'}: no such folder (give a multirun folder, " \
                                  "or one holding a sweep_summary.csv)"
