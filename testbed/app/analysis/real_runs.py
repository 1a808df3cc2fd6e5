"""Real serving runs measured by others, read back so the simulator can replay and score them.

Why: without a GPU, the simulator's timings can only be trusted where it reproduces runs that
someone measured on one. The format read here is the one inference-perf writes (the load
generator of kubernetes-sigs/inference-perf, used for the H100 runs in
`../shared/calibration/vllm_h100_runs/`): one folder per run holding

- `exp-config.yaml`: the server (`model`, `tensor_parallelism`, optional
  `pipeline_parallelism`, `max_model_len`, `max_num_batched_tokens`, `max_num_seqs`,
  optional `gpu_memory_utilization` (default 0.9, vLLM's) and `async_scheduling` (default true:
  vLLM's default since 0.14; the calibration runs are vLLM 0.15.1));
- `results/config.yaml`: what the load generator resolved: `data.shared_prefix`
  (`num_groups`, `num_prompts_per_group`, `system_prompt_len`, `question_len`, `output_len`)
  and `load.stages` (`rate`, `duration`);
- `results/stage_<i>_lifecycle_metrics.json`: the client-side aggregates of stage i
  (`successes.latency.{time_to_first_token,request_latency}.mean`, `successes.prompt_len.mean`,
  `successes.count`, `failures.count`, `load_summary.{count,achieved_rate}`), and where present the
  p90 and p99 of those two latencies, `inter_token_latency` (mean, p90, p99) and the mean
  `time_per_output_token` (`Stage.measured`: how the load generator defines them, `testbed.app.analysis.inference_perf`);
- optionally `results/summary_lifecycle_metrics.json`: the same figures over the whole run (every stage's
  requests together; `RealRun.whole`).

The model's Hugging Face `config.json` is looked up as `model_configs/<last part of the model
id>/config.json` beside the run or in the folder above it. Every missing file or key is an
error naming the file and the key.
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import yaml


# metric name -> (latency in successes.latency, statistic): what the client measured, as inference-perf
# summarises it (inference_perf/reportgen/base.py:307-317); `stream_tpot` is its time_per_output_token
MEASURED = {
    "ttft": ("time_to_first_token", "mean"), "ttft_p50": ("time_to_first_token", "median"),
    "ttft_p90": ("time_to_first_token", "p90"), "ttft_p99": ("time_to_first_token", "p99"),
    "e2e": ("request_latency", "mean"), "e2e_p50": ("request_latency", "median"),
    "e2e_p90": ("request_latency", "p90"), "e2e_p99": ("request_latency", "p99"),
    "itl": ("inter_token_latency", "mean"), "itl_p90": ("inter_token_latency", "p90"),
    "itl_p99": ("inter_token_latency", "p99"), "stream_tpot": ("time_per_output_token", "mean"),
}


class RealRunError(ValueError):
    """A run folder that cannot be read; the message names the file and the key."""


@dataclass(frozen=True)
class Stage:
    """One load stage: what was asked, and what the client measured over its successes."""

    rate: float  # requests per second asked
    duration_s: float
    num_requests: int  # sent
    succeeded: int
    failed: int
    achieved_rate: float  # sent per second
    completed_rate: float  # successes per second
    mean_prompt_len: float  # tokenised prompt length the client counted
    mean_ttft_s: float
    mean_e2e_s: float
    # every figure the client reported that the validation compares, in seconds, by metric name
    # (`MEASURED`): always ttft and e2e (the means), the others where the file has them
    measured: Mapping[str, float] = field(default_factory=dict)

    @property
    def overloaded(self) -> bool:
        """The server did not keep up: requests failed, or successes came at under 90% of the rate
        they were sent. Such a stage's latencies measure how long its queue grew before the
        client gave up (a timeout, not a property of the scheduler), so it is reported, not scored."""
        return self.failed > 0 or self.completed_rate < 0.9 * self.achieved_rate


@dataclass(frozen=True)
class SharedPrefixWorkload:
    """inference-perf's `shared_prefix` data: `num_groups` system prompts, each shared by
    `num_prompts_per_group` questions; the prompts are sent cyclically; every request asks for
    exactly `output_len` tokens (the runs set ignore_eos)."""

    num_groups: int
    prompts_per_group: int
    system_prompt_len: int
    question_len: int
    output_len: int


@dataclass(frozen=True)
class RealRun:
    name: str
    path: Path
    model_id: str
    model_config: Path
    tensor_parallel: int
    pipeline_parallel: int
    max_model_len: int
    max_num_batched_tokens: int
    max_num_seqs: int
    gpu_memory_utilization: float
    async_scheduling: bool
    workload: SharedPrefixWorkload
    stages: tuple[Stage, ...]
    # the whole run's figures (`MEASURED` keys) from summary_lifecycle_metrics.json; None without that file
    whole: Mapping[str, float] | None = None

    @property
    def model_name(self) -> str:
        return self.model_id.rsplit("/", 1)[-1]


def load_run_sets(folders: str | Path | Sequence[str | Path]) -> list[RealRun]:
    """The runs of one folder or of several (`load_runs` each), in the order given; two runs of one
    name are an error (results and caches are keyed by it)."""
    many = [folders] if isinstance(folders, (str, Path)) else list(folders)
    if not many:
        raise RealRunError("no folder of real runs given")
    runs = [r for f in many for r in load_runs(f)]
    seen: dict[str, Path] = {}
    for r in runs:
        if r.name in seen:
            raise RealRunError(f"two runs named {r.name!r}: {seen[r.name]} and {r.path}")
        seen[r.name] = r.path
    return runs


def load_runs(folder: str | Path) -> list[RealRun]:
    """Every run folder (one holding `exp-config.yaml`) directly under `folder`, or `folder` itself."""
    root = Path(folder)
    if not root.is_dir():
        raise RealRunError(f"{root}: no such folder of real runs")
    if (root / "exp-config.yaml").is_file():
        return [load_run(root)]
    dirs = sorted(d for d in root.iterdir() if (d / "exp-config.yaml").is_file())
    if not dirs:
        raise RealRunError(f"{root}: no run folders (a run folder holds exp-config.yaml and results/)")
    return [load_run(d) for d in dirs]


def load_run(path: str | Path) -> RealRun:
    d = Path(path)
    exp_file, resolved_file = d / "exp-config.yaml", d / "results" / "config.yaml"
    exp, resolved = _read(exp_file, yaml.safe_load), _read(resolved_file, yaml.safe_load)
    model_id = str(_at(exp, "model", exp_file))
    workload = SharedPrefixWorkload(*(_num(resolved, f"data.shared_prefix.{k}", resolved_file, int) for k in
                                      ("num_groups", "num_prompts_per_group", "system_prompt_len", "question_len",
                                       "output_len")))
    stages = tuple(_stage(d, i, s) for i, s in enumerate(_at(resolved, "load.stages", resolved_file)))
    return RealRun(
        name=d.name, path=d, model_id=model_id, model_config=_model_config(d, model_id),
        tensor_parallel=_num(exp, "tensor_parallelism", exp_file, int, 1),
        pipeline_parallel=_num(exp, "pipeline_parallelism", exp_file, int, 1),
        max_model_len=_num(exp, "max_model_len", exp_file, int),
        max_num_batched_tokens=_num(exp, "max_num_batched_tokens", exp_file, int),
        max_num_seqs=_num(exp, "max_num_seqs", exp_file, int),
        gpu_memory_utilization=_num(exp, "gpu_memory_utilization", exp_file, float, 0.9),
        async_scheduling=bool(exp.get("async_scheduling", True)),
        workload=workload, stages=stages, whole=_whole(d))


def _whole(d: Path) -> dict[str, float] | None:
    f = d / "results" / "summary_lifecycle_metrics.json"
    if not f.is_file():
        return None
    m = _read(f, json.loads)
    figures = _measured(m)
    for key in ("ttft", "e2e"):
        if key not in figures:
            kind, stat = MEASURED[key]
            raise RealRunError(f"{f}: missing key {stat!r} (in successes.latency.{kind})")
    return figures


def _measured(m: dict) -> dict[str, float]:
    """The MEASURED figures a lifecycle-metrics file holds (a null or absent one is left out)."""
    latency = (m.get("successes") or {}).get("latency") or {}
    out = {}
    for name, (kind, stat) in MEASURED.items():
        v = (latency.get(kind) or {}).get(stat)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            out[name] = float(v)
    return out


def _stage(d: Path, i: int, asked: dict) -> Stage:
    f = d / "results" / f"stage_{i}_lifecycle_metrics.json"
    if not f.is_file():
        raise RealRunError(f"{f}: missing (results/config.yaml lists {i + 1} or more stages)")
    m = _read(f, json.loads)
    where = f"{d / 'results/config.yaml'}: load.stages[{i}]"
    sent, duration = _num(m, "load_summary.count", f, int), _num(asked, "duration", where, float)
    return Stage(
        rate=_num(asked, "rate", where, float), duration_s=duration, num_requests=sent,
        succeeded=_num(m, "successes.count", f, int), failed=_num(m.get("failures") or {}, "count", f, int, 0),
        achieved_rate=_num(m["load_summary"], "achieved_rate", f, float, sent / duration) or sent / duration,
        completed_rate=_num(m, "successes.throughput.requests_per_sec", f, float),
        mean_prompt_len=_num(m, "successes.prompt_len.mean", f, float),
        mean_ttft_s=_num(m, "successes.latency.time_to_first_token.mean", f, float),
        mean_e2e_s=_num(m, "successes.latency.request_latency.mean", f, float), measured=_measured(m))


def _model_config(d: Path, model_id: str) -> Path:
    name = model_id.rstrip("/").rsplit("/", 1)[-1]
    for base in (d, d.parent):
        p = base / "model_configs" / name / "config.json"
        if p.is_file():
            return p
    raise RealRunError(f"{d}: no config.json for model {model_id!r} (looked for model_configs/{name}/config.json "
                       f"in {d} and {d.parent})")


def _read(f: Path, parse) -> dict:
    """A YAML or JSON file's top-level mapping (`parse`: yaml.safe_load or json.loads)."""
    try:
        data = parse(f.read_text())
    except FileNotFoundError:
        raise RealRunError(f"{f}: missing") from None
    except (yaml.YAMLError, json.JSONDecodeError) as e:
        raise RealRunError(f"{f}: cannot be parsed ({e})") from None
    if not isinstance(data, dict):
        raise RealRunError(f"{f}: expected a mapping at the top")
    return data


def _num(node: object, dotted: str, where: object, kind=float, default=None):
    """The number at a dotted key path (`kind`: int or float; `default` where the key may be absent), or an error
    naming the file, the key and the value."""
    v = default if default is not None and (not isinstance(node, dict) or node.get(dotted) is None) \
        else _at(node, dotted, where)
    try:
        if isinstance(v, bool):
            raise ValueError
        return kind(v)
    except (TypeError, ValueError):
        raise RealRunError(f"{where}: key {dotted!r}: expected {'an integer' if kind is int else 'a number'}, "
                           f"got {v!r}") from None


def _at(node: object, dotted: str, where: object):
    """The value at a dotted key path, or an error naming the file and the first key missing."""
    done = []
    for key in dotted.split("."):
        if not isinstance(node, dict) or node.get(key) is None:
            inside = f" (in {'.'.join(done)})" if done else ""
            raise RealRunError(f"{where}: missing key {key!r}{inside}")
        node = node[key]
        done.append(key)
    return node
