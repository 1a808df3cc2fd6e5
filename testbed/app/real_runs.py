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
  `successes.count`, `failures.count`, `load_summary.{count,achieved_rate}`).

The model's Hugging Face `config.json` is looked up as `model_configs/<last part of the model
id>/config.json` beside the run or in the folder above it. Every missing file or key is an
error naming the file and the key.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import yaml


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

    @property
    def model_name(self) -> str:
        return self.model_id.rsplit("/", 1)[-1]


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
    exp = _yaml(d / "exp-config.yaml")
    resolved = _yaml(d / "results" / "config.yaml")
    model_id = str(_key(exp, "model", d / "exp-config.yaml"))
    sp = _key(_key(resolved, "data", d / "results/config.yaml"), "shared_prefix", d / "results/config.yaml: data")
    where = d / "results/config.yaml: data.shared_prefix"
    workload = SharedPrefixWorkload(*(int(_key(sp, k, where)) for k in
                                      ("num_groups", "num_prompts_per_group", "system_prompt_len", "question_len",
                                       "output_len")))
    raw_stages = _key(_key(resolved, "load", d / "results/config.yaml"), "stages", d / "results/config.yaml: load")
    stages = tuple(_stage(d, i, s) for i, s in enumerate(raw_stages))
    return RealRun(
        name=d.name, path=d, model_id=model_id, model_config=_model_config(d, model_id),
        tensor_parallel=int(exp.get("tensor_parallelism", 1)), pipeline_parallel=int(exp.get("pipeline_parallelism", 1)),
        max_model_len=int(_key(exp, "max_model_len", d / "exp-config.yaml")),
        max_num_batched_tokens=int(_key(exp, "max_num_batched_tokens", d / "exp-config.yaml")),
        max_num_seqs=int(_key(exp, "max_num_seqs", d / "exp-config.yaml")),
        gpu_memory_utilization=float(exp.get("gpu_memory_utilization", 0.9)),
        async_scheduling=bool(exp.get("async_scheduling", True)),
        workload=workload, stages=stages)


def _stage(d: Path, i: int, asked: dict) -> Stage:
    f = d / "results" / f"stage_{i}_lifecycle_metrics.json"
    try:
        m = json.loads(f.read_text())
    except FileNotFoundError:
        raise RealRunError(f"{f}: missing (results/config.yaml lists {i + 1} or more stages)") from None
    except json.JSONDecodeError as e:
        raise RealRunError(f"{f}: not JSON ({e})") from None
    ok = _key(m, "successes", f)
    lat = _key(ok, "latency", f"{f}: successes")
    load = _key(m, "load_summary", f)
    failed = int((m.get("failures") or {}).get("count") or 0)
    sent = int(_key(load, "count", f"{f}: load_summary"))
    duration = float(_key(asked, "duration", d / "results/config.yaml: load.stages"))
    return Stage(
        rate=float(_key(asked, "rate", d / "results/config.yaml: load.stages")), duration_s=duration,
        num_requests=sent, succeeded=int(_key(ok, "count", f"{f}: successes")), failed=failed,
        achieved_rate=float(load.get("achieved_rate") or sent / duration),
        completed_rate=float(_key(_key(ok, "throughput", f"{f}: successes"), "requests_per_sec", f"{f}: successes.throughput")),
        mean_prompt_len=float(_key(_key(ok, "prompt_len", f"{f}: successes"), "mean", f"{f}: successes.prompt_len")),
        mean_ttft_s=float(_key(_key(lat, "time_to_first_token", f"{f}: successes.latency"), "mean", f"{f}: ...time_to_first_token")),
        mean_e2e_s=float(_key(_key(lat, "request_latency", f"{f}: successes.latency"), "mean", f"{f}: ...request_latency")))


def _model_config(d: Path, model_id: str) -> Path:
    name = model_id.rstrip("/").rsplit("/", 1)[-1]
    for base in (d, d.parent):
        p = base / "model_configs" / name / "config.json"
        if p.is_file():
            return p
    raise RealRunError(f"{d}: no config.json for model {model_id!r} (looked for model_configs/{name}/config.json "
                       f"in {d} and {d.parent})")


def _yaml(f: Path) -> dict:
    try:
        data = yaml.safe_load(f.read_text())
    except FileNotFoundError:
        raise RealRunError(f"{f}: missing") from None
    except yaml.YAMLError as e:
        raise RealRunError(f"{f}: not YAML ({e})") from None
    if not isinstance(data, dict):
        raise RealRunError(f"{f}: expected a mapping at the top")
    return data


def _key(node: object, key: str, where: object):
    if not isinstance(node, dict) or node.get(key) is None:
        raise RealRunError(f"{where}: missing key {key!r}")
    return node[key]
