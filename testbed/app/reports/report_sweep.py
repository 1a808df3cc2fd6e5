"""What a report says about its sweep besides the numbers: which keys were swept (the series' labels),
which were held constant (the header), and what produced the runs (model, GPU, cost model, trace, SLO,
commit).

A label that repeats a constant (`vllm trace.max_requests=1000` on every line) hides the one thing that
differs, so the swept keys are read from Hydra's own record of the sweep (`multirun.yaml`: the
command line's `hydra.overrides.task` and a preset's `hydra.sweeper.params`, in Hydra's sweep syntax:
`a=x,y`, `choice(...)`, `range(...)`). Without that file (a folder holding only `sweep_summary.csv`,
as committed under experiments/), the keys whose value differs between jobs stand in.
"""
from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import pandas as pd
import yaml

# keys that are an axis of every figure, not a series: the load (x), the trace (a panel), an experiment's
# sub-preset (a cluster size with its load: the x axis is the offered rate) and Hydra's and output's own
AXIS_KEYS = ("trace", "trace.rate_scale")
NOT_A_SERIES = ("experiment", "hydra.", "output.", "logger")
REQUIRED = ("model", "GPU", "cost model", "trace", "commit")  # what a reader needs to place the numbers


class BadSweep(ValueError):
    """A folder the report cannot read as a sweep: the command says why in one line and exits 2."""


@dataclass
class SweepFacts:
    swept: list[str]  # the keys that vary between jobs, in the order the sweep names them
    constants: dict[str, str]  # overrides the same in every job
    header: dict[str, str] = field(default_factory=dict)  # model, GPU, cost model, trace, SLO, commit ...
    slo: dict = field(default_factory=dict)  # ttft_ms, tpot_ms, e2el_ms, percentile, attainment_target


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def parse_overrides(text: str) -> dict[str, str]:
    """A job's overrides (space-separated, as sweep_summary.csv holds them) as key -> value."""
    return {_key(o): o.split("=", 1)[1] if "=" in o else "" for o in (text or "").split()}


def _from_multirun(path: Path) -> tuple[list[str], dict[str, str]]:
    from hydra.errors import HydraException
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        hydra = (yaml.safe_load(path.read_text()) or {}).get("hydra", {})
        task = list((hydra.get("overrides") or {}).get("task") or [])
        params = (hydra.get("sweeper") or {}).get("params") or {}
        task += [f"{k}={v}" for k, v in params.items()]
        parsed = OverridesParser.create().parse_overrides(task)
    except (yaml.YAMLError, AttributeError, HydraException) as e:
        raise BadSweep(f"{path}: not Hydra's record of a sweep ({type(e).__name__}: {str(e).splitlines()[0]})") from e
    swept, constants = [], {}
    for o in parsed:
        key = o.get_key_element().lstrip("+~")
        if o.is_sweep_override():
            swept.append(key) if key not in swept else None
        else:
            constants[key] = o.get_value_element_as_str()
    return swept, {k: v for k, v in constants.items() if k not in swept}


def swept_and_constant(sweep: Path, overrides: pd.Series) -> tuple[list[str], dict[str, str]]:
    """(swept keys, constant overrides) of a sweep: from multirun.yaml, else from the jobs' overrides."""
    if (sweep / "multirun.yaml").is_file():
        return _from_multirun(sweep / "multirun.yaml")
    jobs = [parse_overrides(o) for o in overrides.fillna("")]
    keys = list(dict.fromkeys(k for j in jobs for k in j))
    swept = [k for k in keys if len({j.get(k) for j in jobs}) > 1]
    return swept, {k: jobs[0][k] for k in keys if k not in swept}


def label_keys(swept: list[str]) -> list[str]:
    """The swept keys that tell one series from another (policy first), not an axis of the figures."""
    keys = [k for k in swept if k not in AXIS_KEYS and not k.startswith(NOT_A_SERIES)]
    return sorted(keys, key=lambda k: k != "policy")


def _job_file(sweep: Path, job: str, *names: str) -> Path | None:
    for name in names:
        if (sweep / job / name).is_file():
            return sweep / job / name
    return None


def _slo(sweep: Path, jobs: list[str], name: str | None) -> dict:
    """The SLO's thresholds as the jobs ran them (their config.yaml), else the shipped preset of that name."""
    for job in jobs:
        cfg_file = _job_file(sweep, job, "config.yaml", ".hydra/config.yaml")
        if cfg_file:
            slo = (yaml.safe_load(cfg_file.read_text()) or {}).get("slo")
            if isinstance(slo, dict):
                return slo
    if name:
        preset = resources.files("testbed") / "conf" / "slo" / f"{name}.yaml"
        if preset.is_file():
            return yaml.safe_load(preset.read_text()) or {}
    return {}


def slo_text(slo: dict) -> str:
    parts = [f"{m} ≤ {slo[k]:g} ms" for k, m in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("e2el_ms", "E2E"))
             if slo.get(k) is not None]
    if not parts:
        return "none (every finished request counts)"
    text = f"p{slo.get('percentile', 99):g} " + ", ".join(parts)
    return text + (f"; target {slo['attainment_target']:.0%} of requests" if slo.get("attainment_target") else "")


def _commit(sweep: Path, jobs: list[str]) -> str:
    """The testbed commit the jobs ran (their run_info.json); for a committed table without job folders, the
    commit that last changed that table, said as such."""
    seen = []
    for job in jobs:
        info = _job_file(sweep, job, "run_info.json")
        if info:
            commit = json.loads(info.read_text()).get("commit")
            if commit and commit not in seen:
                seen.append(commit)
    if seen:
        return ", ".join(seen)
    table = sweep / "sweep_summary.csv"
    try:
        out = subprocess.run(["git", "-C", str(sweep), "log", "-1", "--format=%h (%ad)", "--date=short", "--",
                              table.name], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        out = None
    if out is not None and out.returncode == 0 and out.stdout.strip():
        return f"not recorded by the runs; their table was committed at {out.stdout.strip()}"
    return "not recorded by the runs"


def _values(df: pd.DataFrame, col: str) -> str | None:
    if col not in df or df[col].dropna().empty:
        return None
    return ", ".join(str(v) for v in dict.fromkeys(df[col].dropna().astype(str)))


def _from_configs(sweep: Path, df: pd.DataFrame, jobs: list[str]) -> pd.DataFrame:
    """The model, GPU and cost model from the jobs' config.yaml where their summaries do not name them (a
    capacity search's capacity.json)."""
    missing = [c for c in ("model", "hardware", "cost_model") if c not in df or df[c].isna().all()]
    if not missing:
        return df
    found: dict[str, list] = {c: [] for c in missing}
    for job in jobs:
        cfg_file = _job_file(sweep, job, "config.yaml", ".hydra/config.yaml")
        cfg = (yaml.safe_load(cfg_file.read_text()) or {}) if cfg_file else {}
        for c in missing:
            found[c].append((cfg.get(c) or {}).get("name") if isinstance(cfg.get(c), dict) else None)
    return df.assign(**{c: v for c, v in found.items() if any(v)})


def sweep_facts(sweep: Path, df: pd.DataFrame) -> SweepFacts:
    """Everything the report's header names, from the sweep's files and the merged table."""
    swept, constants = swept_and_constant(sweep, df["overrides"] if "overrides" in df else pd.Series([], dtype=str))
    jobs = list(df["job"]) if "job" in df else []
    df = _from_configs(sweep, df, jobs)
    slo = _slo(sweep, jobs, _values(df, "slo"))
    gpu = _values(df, "hardware")
    for col, word in (("tensor_parallel_size", "TP"), ("pipeline_parallel_size", "PP")):
        if gpu and col in df and (df[col].dropna() > 1).any():
            gpu += f", {word} {_values(df, col)}"
    header = {"model": _values(df, "model"), "GPU": gpu, "cost model": _values(df, "cost_model"),
              "front end": _values(df, "frontend"), "async scheduling": _values(df, "async_scheduling"),
              "policy": None if "policy" in swept else _values(df, "policy_config") or _values(df, "policy"),
              "router": None if "router" in swept else _values(df, "router"),
              "trace": _values(df, "trace"), "SLO": f"{slo.get('name') or _values(df, 'slo') or '?'}: {slo_text(slo)}",
              "commit": _commit(sweep, jobs)}
    if "cost_model_fallback" in df and df["cost_model_fallback"].notna().any():
        header["cost model"] += f" (fallback: {_values(df, 'cost_model_fallback')})"
    for k in REQUIRED:  # said, rather than left out, where the results do not record them
        header[k] = header[k] or "not recorded in the results"
    return SweepFacts(swept, constants, {k: v for k, v in header.items() if v}, slo)
