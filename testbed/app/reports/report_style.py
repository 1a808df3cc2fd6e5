"""How a report draws a series: one colour, marker and line style per policy (or router), the same in every
figure and every report, so a reader who learnt that `vllm` is blue keeps reading it as blue.

Colours are Okabe and Ito's qualitative palette ("Color Universal Design", 2002; Wong, Nature Methods 8:441,
2011), told apart under the common colour-vision deficiencies. Eight colours cannot name nineteen policies,
so the known names are laid out in fixed families of at most eight: within a family the colours differ,
between families the line style and the marker do (for greyscale print too). The families are the
panels of the small multiples a report draws beyond eight series, so no panel repeats a colour; a report
of at most eight series moves the later of two that share a colour to a free one (`_distinct`). A name no
family holds (a swept knob's value) takes its rank among the report's values.
"""
from __future__ import annotations

import re

import numpy as np
from dataclasses import dataclass

from matplotlib import ticker

PALETTE = ["#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#000000", "#F0E442"]  # yellow last:
# faint as a line on white, so used only by an eighth series
MARKERS = "osD^vP<X"
CONTEXT = "#d9d9d9"  # the other families' lines, behind a small multiple's own
MAX_SERIES = 8  # beyond this, one panel per family

# (family title, names in colour order, line style, marker, first colour). Each family's colours start at its
# own offset, so that the policies most often set side by side (vllm and sglang against the others) differ in
# colour too; where two families' colours meet, the line style and the marker tell them apart.
FAMILIES = {
    "policy": [
        ("vLLM and SGLang", ["vllm", "sglang", "sglang_lpm", "sglang_dfs_weight", "vllm_v0", "vllm_priority",
                             "vllm_native"], "-", "o", 0),
        ("other systems", ["sarathi", "trtllm", "orca", "fastserve", "vtc", "static"], "--", "s", 2),
        ("length and deadline orders", ["sjf", "srpt", "ltr", "edf", "least_slack"], "-.", "^", 4),
    ],
    "router": [
        ("routers", ["round_robin", "least_outstanding", "least_kv", "power_of_two", "prefix_affinity",
                     "prefix_affinity_actual", "session_affinity"], "-", "o", 0),
    ],
}


@dataclass(frozen=True)
class Style:
    color: str
    marker: str
    linestyle: str
    family: str
    order: tuple  # (family's place, place in it): the legends' and panels' order

    def kw(self) -> dict:
        return dict(color=self.color, marker=self.marker, linestyle=self.linestyle)


def _natural(value: str):
    """Numbers in numeric order (128 before 1024), then names."""
    try:
        return (0, float(value), "")
    except ValueError:
        return (1, 0.0, value)


def _known(kind: str, name: str) -> tuple[str, int, str, str, int] | None:
    """(family, colour index, line style, marker, family's place) of a known policy or router."""
    for place, (title, names, ls, marker, first) in enumerate(FAMILIES.get(kind, [])):
        if name in names:
            return title, (first + names.index(name)) % (len(PALETTE) - 1), ls, marker, place
    return None


def styles(series: dict[str, tuple[tuple[str, str], ...]]) -> dict[str, Style]:
    """label -> Style, for labels built from (key, value) components (the first decides the colour).
    Deterministic: a known policy or router gets its family's colour whatever else the report holds."""
    firsts = sorted({c[0][1] for c in series.values() if c and not _known(c[0][0], c[0][1])}, key=_natural)
    rests = sorted({c[1:] for c in series.values()}, key=lambda r: [_natural(v) for _, v in r])
    out = {}
    for label, comps in series.items():
        key, value = comps[0] if comps else ("", label)
        known = _known(key, value)
        rest = rests.index(comps[1:])
        if known:
            family, pos, ls, marker, place = known
        else:
            rank = firsts.index(value) if value in firsts else 0
            family = f"{key or 'series'} ({rank // MAX_SERIES + 1})" if len(firsts) > MAX_SERIES else key or "series"
            pos, ls, place = rank % MAX_SERIES, "-", 100 + rank // MAX_SERIES
            marker = MARKERS[pos]
        if len(rests) > 1:  # a second swept knob: the line style tells its values apart
            ls = ["-", "--", "-.", ":"][rest % 4]
        out[label] = Style(PALETTE[pos], marker, ls, family, (place, pos, rest))
    return _distinct(out) if len(out) <= MAX_SERIES else out


def _distinct(style: dict[str, Style]) -> dict[str, Style]:
    """One panel of at most eight series: where two families' colours meet, the later one (in family order)
    takes the next colour no series of this report has. So a policy keeps its colour in every report but
    one that also holds the policy whose colour it shares (vllm keeps blue in all)."""
    used, out = set(), dict(style)
    for label in sorted(style, key=lambda s: style[s].order):
        s = style[label]
        if s.color in used:
            free = [c for c in PALETTE if c not in used and c not in {t.color for t in style.values()}] or [
                c for c in PALETTE if c not in used]
            s = Style(free[0], s.marker, s.linestyle, s.family, s.order)
            out[label] = s
        used.add(s.color)
    return out


def panels(style: dict[str, Style]) -> list[tuple[str | None, list[str]]]:
    """The small multiples: one (family, labels) per family when there are more than MAX_SERIES series,
    else one panel of all of them (family None)."""
    if len(style) <= MAX_SERIES:
        return [(None, list(style))]
    fams: dict[str, list[str]] = {}
    for label, s in style.items():
        fams.setdefault(s.family, []).append(label)
    return list(fams.items())


def plain_number(v: float, _pos=None) -> str:
    """1, 2, 5, 10, 2,000, 0.5: never 7×10⁰."""
    if v == 0:
        return "0"
    if abs(v) >= 1:
        return f"{v:,.0f}" if abs(v - round(v)) < 1e-9 else f"{v:,.1f}"
    return f"{v:.3g}"


def log_axis(ax, which: str = "y") -> None:
    """A log scale labelled with plain numbers at the sparsest of 1, 1-3, 1-2-5, 1-2-3-5 and every integer
    step that gives 3 to 8 labels, or a linear scale where the data span less than a factor of 1.5."""
    axis = ax.yaxis if which == "y" else ax.xaxis
    k = 1 if which == "y" else 0
    data = [np.asarray(line.get_xydata()[:, k], dtype=float) for line in ax.lines  # not a threshold's axes-wide span
            if line.get_transform().contains_branch_seperately(ax.transData)[k] and line.get_xydata().size]
    values = np.concatenate(data) if data else np.array([])
    values = values[np.isfinite(values)]
    if not values.size or (values <= 0).any() or values.max() / values.min() < 1.5:
        return
    (ax.set_yscale if which == "y" else ax.set_xscale)("log")
    pad = 1.12 if which == "y" else 1.06
    lo, hi = values.min() / pad, values.max() * pad
    nice = ticker.LogLocator(subs=(1.0, 2.0, 5.0), numticks=100).tick_values(lo / 1.3, hi * 1.3)
    lo = max([t for t in nice if t <= lo and lo / t < 1.3], default=lo)  # an end on a labelled 1-2-5 value,
    hi = min([t for t in nice if t >= hi and t / hi < 1.3], default=hi)  # where that widens the axis little
    (ax.set_ylim if which == "y" else ax.set_xlim)(lo, hi)
    for subs in ((1.0,), (1.0, 3.0), (1.0, 2.0, 5.0), (1.0, 2.0, 3.0, 5.0), tuple(range(1, 10))):
        ticks = ticker.LogLocator(subs=subs, numticks=100).tick_values(lo, hi)
        if 3 <= ((ticks >= lo) & (ticks <= hi)).sum() <= 8:  # enough to read a value off, not a crowd
            break
    axis.set_major_locator(ticker.LogLocator(subs=subs, numticks=100))
    axis.set_major_formatter(ticker.FuncFormatter(plain_number))
    axis.set_minor_formatter(ticker.NullFormatter())


def slug(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", label).strip("-") or "series"
