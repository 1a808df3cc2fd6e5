"""`testbed-traces describe`: a trace's statistics and plots, as a run would replay it.

Usage:
    testbed-traces describe trace=azure_conv
    testbed-traces describe trace=mooncake trace.rate_scale=2 trace.max_requests=1000 output.dir=desc/mc
    testbed-traces describe trace.kind=file trace.format=csv trace.path=my.csv +trace.columns.arrival=ts ...
(`python -m testbed.app.analysis.traces describe ...` is the same.) The config is composed as for `testbed-sim`,
checked by `check_config`, and the requests built by `testbed.app.assembly.run_setup.build_requests`, the path
every run takes: the same file, presets, lenient rejections and transforms (window, first N,
rate scale, length caps). What is computed, and how, is `testbed.traces.describe`.

Prints a table, and writes to `output.dir` (default: `outputs/<date>/<time>_describe_<trace>`):
`description.json` (every number, and the trace config), `description.md` (the table and the
figures), `arrival_rate.png` (requests per second in each window over time) and `lengths.png`
(the CDFs of prompt and output lengths, log x).
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from testbed.app.entry.cli import CONF_DIR
from testbed.app.assembly.config import register_configs
from testbed.app.entry.stop import stop_on_signals
from testbed.app.assembly.validate import check_config
from testbed.app.analysis.tables import markdown_table, text_table

register_configs()

RUN_DIR = "hydra.run.dir='outputs/${now:%Y-%m-%d}/${now:%H-%M-%S}_describe_${trace.name}'"
TRANSFORMS = ("start_s", "end_s", "max_requests", "rate_scale", "max_prompt_len", "max_output_len")
FILES = ("description.json", "description.md", "arrival_rate.png", "lengths.png")
_REJECTED = re.compile(r"invalid-row: field (.*?): (.*)", re.DOTALL)


def describe_config(cfg: DictConfig) -> dict:
    """Check the config, build its requests, and print and write their description."""
    check_config(cfg)
    from testbed.app.assembly.run_setup import build_requests
    from testbed.traces.describe import describe_requests

    requests, rejected = build_requests(cfg.trace, cfg.seed)
    stats = describe_requests(requests, [_field_reason(reason) for _, _, reason in rejected])
    tc = cfg.trace
    description = {
        "trace": tc.name,
        "source": tc.path if tc.kind == "file" else f"{tc.kind} generator (seed {cfg.seed})",
        "transforms": {k: tc[k] for k in TRANSFORMS if tc[k] is not None and not (k == "rate_scale" and tc[k] == 1.0)},
        **stats,
        "trace_config": OmegaConf.to_container(tc, resolve=True),
    }
    out = Path(cfg.output.dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = table_rows(description)
    with stop_on_signals():  # a signal before here stops it at once; from here, once the files are whole
        _plot_rates(requests, description, out / "arrival_rate.png")
        _plot_lengths(requests, description, out / "lengths.png")
        (out / "description.json").write_text(json.dumps(description, indent=2) + "\n")
        (out / "description.md").write_text(markdown(description, rows))
    if cfg.output.print_table:
        print(f"\n{title(description)}")
        print(text_table(rows))
        print(f"written: {', '.join(str(out / f) for f in FILES)}")
    return description


def _field_reason(reason: str) -> tuple[str, str]:
    """(field, reason) of a rejected row as `build_requests` words it."""
    m = _REJECTED.fullmatch(reason)
    return (m.group(1), m.group(2)) if m else ("", reason)


def title(d: dict) -> str:
    done = ", ".join(f"{k}={v}" for k, v in d["transforms"].items())
    return f"trace {d['trace']}: {d['source']}" + (f" [{done}]" if done else "")


def _lengths(s: dict) -> str:
    if s["mean"] is None:
        return "-"
    return f"mean {s['mean']:.1f}  p50 {s['p50']:g}  p90 {s['p90']:g}  p99 {s['p99']:g}  max {s['max']}"


def _num(x, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def table_rows(d: dict) -> list[tuple[str, str]]:
    """(label, value) rows of the description, as printed and as in description.md."""
    rows = [("requests", f"{d['requests']} loaded, {d['rejected']} rejected")]
    rows += [(f"  rejected: {reason}", str(n)) for reason, n in d["rejected_by_reason"].items()]
    rows.append(("span", f"{d['span_s']:.1f} s (arrivals from {_num(d['first_arrival_s'], '.3f')} to "
                         f"{_num(d['last_arrival_s'], '.3f')} s)"))
    rows.append(("mean rate", f"{_num(d['mean_rate'], '.3f')} req/s"))
    zero = d["zero_gap_share"]
    rows.append(("gap CV", _num(d["gap_cv"], ".3f") + ("" if not zero else f" ({zero:.1%} of gaps are 0: arrivals "
                                                                           f"sharing an instant)")))
    for w in d["windows"]:
        rows.append((f"per {w['window_s']:g} s window", f"index of dispersion {_num(w['dispersion'], '.3f')}, "
                                                        f"peak {_num(w['peak_rate'], '.3g')} req/s, mean "
                                                        f"{_num(w['mean_count'], '.3g')} per window "
                                                        f"({w['full_windows']} full windows)"))
    rows.append(("prompt tokens", _lengths(d["prompt_len"])))
    rows.append(("output tokens", _lengths(d["output_len"])))
    p = d["prefix"]
    if p["requests_with_hashes"]:
        rows.append(("prefix reuse", f"{p['reuse_share']:.1%} of prompt tokens in blocks an earlier request had "
                                     f"(the hit-rate bound of an unlimited prefix cache); {p['distinct_blocks']} "
                                     f"distinct blocks of {p['block_tokens']} tokens, "
                                     f"{p['hashed_token_share']:.1%} of prompt tokens hashed"))
    else:
        rows.append(("prefix reuse", "none known (the trace gives no prefix hashes)"))
    s = d["sessions"]
    if s["sessions"]:
        rows.append(("sessions", f"{s['sessions']} holding {s['requests_in_sessions']} requests"
                                 + (f" ({s['requests_with_parent']} with a parent)" if s["requests_with_parent"] else "")
                                 + f"; turns per session {_lengths(s['turns'])}"))
    else:
        rows.append(("sessions", "none (no session ids)"))
    return rows


def markdown(d: dict, rows: list[tuple[str, str]]) -> str:
    lines = [f"# {title(d)}", "", markdown_table(["", ""], [(k.strip(), v.replace("|", "/")) for k, v in rows])]
    lines += ["", "![arrival rate](arrival_rate.png)", "", "![lengths](lengths.png)", ""]
    return "\n".join(lines)


def _plot_rates(requests, d: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from testbed.traces.describe import window_counts

    arrivals = np.fromiter((r.arrival for r in requests), dtype=np.float64, count=len(requests))
    hours = d["span_s"] > 4 * 3600
    unit, scale = ("h", 3600.0) if hours else ("s", 1.0)
    fig, ax = plt.subplots(figsize=(10, 3.6))
    for i, w in enumerate(d["windows"]):
        counts = window_counts(arrivals, w["window_s"])
        if counts.size > 2:  # the last window is cut at the last arrival: its rate would read low
            counts = counts[:-1]
        edges = np.arange(counts.size + 1) * w["window_s"] / scale
        ax.stairs(counts / w["window_s"], edges, linewidth=0.6 if i == 0 else 1.6,
                alpha=0.5 if i == 0 and len(d["windows"]) > 1 else 1.0, label=f"per {w['window_s']:g} s")
    ax.set_xlabel(f"time ({unit})")
    ax.set_ylabel("arrivals per second")
    ax.set_title(f"{d['trace']}: {d['requests']} requests, mean {_num(d['mean_rate'], '.3g')} req/s, "
                 f"gap CV {_num(d['gap_cv'], '.3g')}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_lengths(requests, d: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for ax, key, label in zip(axes, ("prompt_len", "output_len"), ("prompt tokens", "output tokens")):
        v = np.sort(np.fromiter((getattr(r, key) for r in requests), dtype=np.float64, count=len(requests)))
        v = v[v > 0]
        if v.size:
            ax.step(v, np.arange(1, v.size + 1) / v.size, where="post")
            ax.set_xscale("log")
        ax.set_xlabel(label)
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"{label}: p50 {_num(d[key]['p50'], 'g')}, p99 {_num(d[key]['p99'], 'g')}")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def describe(cfg: DictConfig) -> dict:
    return describe_config(cfg)


COMMANDS = {"describe": describe}
HELP = {"describe": "a trace's rows, rate and burstiness, lengths, prefix reuse and sessions, with plots, as a run "
                    "with the same trace config would replay it (e.g. describe trace=azure_conv)"}


def parser() -> argparse.ArgumentParser:
    """The subcommands; what follows one is Hydra's (overrides, -m, --help, --cfg ...), passed on verbatim."""
    top = argparse.ArgumentParser(prog="testbed-traces", description="A trace, as a run would replay it.")
    sub = top.add_subparsers(dest="command", required=True, metavar="{" + ",".join(COMMANDS) + "}")
    for name in COMMANDS:
        cmd = sub.add_parser(name, help=HELP[name], description=HELP[name], add_help=False)  # --help: Hydra's
        cmd.add_argument("overrides", nargs="*", metavar="key=value")
    return top


def main() -> None:
    args = sys.argv[1:]
    # a `--` after the subcommand keeps what follows it in order, options included: argparse's REMAINDER
    # drops a leading option such as Hydra's `-m` (cpython issue #61252)
    parsed = parser().parse_args([args[0], "--", *args[1:]] if args and not args[0].startswith("-") else args)
    rest = parsed.overrides[1:] if parsed.overrides[:1] == ["--"] else parsed.overrides
    if not any(a.startswith("hydra.run.dir=") for a in rest):
        rest = [*rest, RUN_DIR]  # named after the command, not after the default policy a run would use
    rest.append("~hydra.callbacks.merge_sweep")  # a sweep of descriptions has no run summaries to merge
    sys.argv = [sys.argv[0], *rest]
    COMMANDS[parsed.command]()


if __name__ == "__main__":
    main()
