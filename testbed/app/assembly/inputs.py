"""The files a run reads, identified by their content, so that a rerun redoes a run whose data changed.

Why: a rerun skips a job whose folder already holds a complete run of the identical resolved config
(`testbed.app.entry.cli._finished_before`), and a config names its trace by path. After the trace file was
edited in place, the rerun skipped the job as done and the folder kept the results of the old data.
So a run records, beside its `config.yaml`, every input file it reads (INPUTS, `inputs.json`: per
config key the file's path, size, mtime and the SHA-256 of its bytes, read in chunks), and a rerun
skips only where each hash is still the same. Size and mtime are there for the reader: a file
touched but not changed gives the same results, so it is still skipped.

The files, each resolved as the run resolves it: `trace.path` (kind=file: the trace,
`traces.loaders.resolve_path`; kind=servegen: every file of the data folder), `trace.lengths_from`
(kind=poisson or gamma), `cost_model.profile` (cost_model=profile, `sim.fitted_cost.resolve_profile_path`)
and `model.config_json` (with the generation_config.json beside it, which the spec reads too). Not
hashed: a checkpoint's weights (`model.checkpoint`, gigabytes, read by the engine backend only) and the
kernel tables (`cost_model.data_dir`, package data unless set). A file that cannot be found is left out:
the run itself fails on it, naming the key.

Not `testbed.app.analysis.fingerprint`: that module hashes a run's results (its tables, to show a speed change
leaves them bit-identical); this one identifies what went into a run.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Callable

from omegaconf import DictConfig

INPUTS = "inputs.json"
_CHUNK = 1 << 20


def input_files(cfg: DictConfig) -> dict[str, list[Path]]:
    """The files `cfg`'s run reads, by the config key that names them (a folder: its files, sorted)."""
    from testbed.traces.loaders import resolve_path

    tc, files = cfg.trace, {}
    if tc.kind == "file" and tc.path:
        files["trace.path"] = _found(resolve_path, tc.path)
    elif tc.kind == "servegen" and tc.path:
        from testbed.traces.servegen import resolve_servegen_path

        folder = _found(resolve_servegen_path, tc.path)
        files["trace.path"] = sorted(p for p in folder[0].iterdir() if p.is_file()) if folder else []
    elif tc.kind in ("poisson", "gamma") and tc.lengths_from:
        files["trace.lengths_from"] = _found(resolve_path, tc.lengths_from)
    cost = cfg.get("cost_model")
    if cost is not None and cost.get("name") == "profile" and cost.get("profile"):
        from testbed.sim.fitted_cost import resolve_profile_path

        files["cost_model.profile"] = [p for p in _found(resolve_profile_path, cost.profile) if p.is_file()]
    spec = cfg.get("model")
    if spec is not None and spec.get("config_json"):
        given = Path(spec.config_json).expanduser()
        config = given / "config.json" if given.is_dir() else given
        beside = config.parent / "generation_config.json"
        files["model.config_json"] = [p for p in (config, beside) if p.is_file()]
    return {key: paths for key, paths in files.items() if paths}


def file_record(path: Path) -> dict:
    """`path`'s identity: where, how big, when last written, and the SHA-256 of its bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    st = path.stat()
    return {"path": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": digest.hexdigest()}


def read_inputs(cfg: DictConfig) -> dict[str, list[dict]]:
    """Every input file of `cfg`'s run, as `file_record`s by config key: what INPUTS holds."""
    return {key: [file_record(p) for p in paths] for key, paths in input_files(cfg).items()}


def write_inputs(out_dir: str | Path, inputs: dict[str, list[dict]]) -> None:
    (Path(out_dir) / INPUTS).write_text(json.dumps(inputs, indent=2, sort_keys=True) + "\n")


def forget_inputs(out_dir: str | Path) -> None:
    """Drop a folder's record before a run rewrites its results: a run that dies part way then leaves no
    record, and its folder is never skipped (an old record beside new results could match the wrong data)."""
    (Path(out_dir) / INPUTS).unlink(missing_ok=True)


def changed_inputs(out_dir: str | Path, inputs: dict[str, list[dict]]) -> str | None:
    """Why the results in `out_dir` are not of `inputs` (None: they are), as a clause: no record, or the
    config keys whose files' contents (or set of files) differ from those recorded."""
    path = Path(out_dir) / INPUTS
    if not path.exists():
        return f"it has no record of the files they came from ({INPUTS})"
    try:
        before = json.loads(path.read_text())
    except ValueError:
        before = None
    if not isinstance(before, dict):
        return f"its {INPUTS} is unreadable"

    def content(records: list[dict]) -> list:
        return sorted((Path(r.get("path", "")).name, r.get("sha256")) for r in records)

    keys = sorted(k for k in set(before) | set(inputs)
                  if content(before.get(k, [])) != content(inputs.get(k, [])))
    if not keys:
        return None
    return ", ".join(f"{k} ({_where(inputs.get(k) or before.get(k))})" for k in keys) + " changed since"


def _where(records: list[dict]) -> str:
    return records[0]["path"] if len(records) == 1 else f"{len(records)} files in {Path(records[0]['path']).parent}"


def _found(resolve: Callable[[str], Path], value: str) -> list[Path]:
    try:
        return [resolve(value)]
    except (OSError, ValueError):  # the run fails on it, naming the key
        return []
