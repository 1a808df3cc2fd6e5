"""What produced a run's numbers, in its summary and in one printed line.

A simulated latency is only as trustworthy as the cost model, the data behind it and the serving
features modelled around it, and the defaults differ in how far each was checked against real runs.
So every summary names them (`provenance`): the cost model that priced the steps (`cost_model`; with
`cost_model_fallback` when the measured-kernel model could not and the roofline stood in), the kernel
tables behind it (`cost_model_data`: where they were read from, the aiconfigurator-core release, GPU,
framework, the table version and kernel source of every op), the front end (`frontend`), async
scheduling as run, the tensor and pipeline parallelism; and whether that is the **validated
configuration**: `cost_model=kernels` on vLLM's kernel tables of the H100 with the fitted values of
conf/cost_model/kernels.yaml, `frontend=vllm_api` with those of conf/frontend/vllm_api.yaml, and async
scheduling on, the configuration `testbed-validate` scores against real vLLM runs on H100 (README,
"Against real GPU runs"). `differs_from_validated` lists what differs. The printed line (`line`) is made
from the summary alone, so summary.json says the same.

These keys follow from the configuration, not from the simulation: `testbed.app.analysis.fingerprint` leaves
them out of the result hashes (`PROVENANCE_KEYS`).
"""
from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

PROVENANCE_KEYS = ("cost_model_data", "cost_model_fallback", "sampler", "async_scheduling", "tensor_parallel_size",
                   "pipeline_parallel_size", "validated_configuration", "differs_from_validated",
                   "decode_cost_model_data", "decode_cost_model_fallback")  # the last two: disaggregated pools
# (and the values of conf/cost_model/kernels.yaml and conf/frontend/vllm_api.yaml, framework vllm among them)
VALIDATED = dict(cost_model="kernels", gpu="h100_sxm", frontend="vllm_api", async_scheduling=True)


def cost_model_data(cost: Any) -> Optional[dict]:
    """The measured tables behind a kernel cost model (None for a model that reads none)."""
    db = getattr(cost, "db", None)  # KernelCostModel, also through a speculative-decoding wrapper
    if db is None or not hasattr(db, "source"):
        return None
    src = db.source
    tables = src.package if src.package else str(src.root)
    if src.kind == "shipped" and (upstream := _upstream_commit(db)):
        tables += f" and aiconfigurator @ {upstream[:7]}"  # kernel_data/NOTICE-upstream.md
    data = {"source": src.kind, "tables": tables, "gpu": db.gpu,
            "framework": db.framework, "versions": dict(sorted(db.versions.items())),
            "kernels": dict(sorted(db.sources_used.items()))}
    model = getattr(cost, "model", None)
    if getattr(model, "is_moe", False) and db.moe_distribution_used:  # the routing its expert timings assume
        data["moe_routing"] = dict(sorted(db.moe_distribution_used.items()))
    return data


def _upstream_commit(db: Any) -> Optional[str]:
    """The upstream repository's commit when a table read comes from it rather than the package
    (kernel_data/upstream.json), else None."""
    import json

    listing = db.source.root / "upstream.json"
    if not listing.is_file():
        return None
    up = json.loads(listing.read_text())
    read = {Path(path).resolve().relative_to(db.source.root.resolve()).as_posix() for path, _, _ in db.reads.values()}
    return up["commit"] if read & set(up["files"]) else None


def provenance(cfg: DictConfig, cost: Any, backend: str, async_scheduling: bool,
               fallback: Optional[str] = None) -> dict:
    """The summary's provenance keys (see the module docstring)."""
    par = cfg.get("parallel") or {}
    out: dict = {"async_scheduling": bool(async_scheduling),
                 "tensor_parallel_size": int(par.get("tensor_parallel_size") or 1),
                 "pipeline_parallel_size": int(par.get("pipeline_parallel_size") or 1)}
    data = cost_model_data(cost)
    if data is not None:
        out["cost_model_data"] = data
    sampler = getattr(cost, "sampler", None)  # the kernel model's (testbed/sim/sampler_cost.py); None: not priced
    if sampler is not None:
        out["sampler"] = sampler.params.path(sampler.vocab_size)
    if fallback is not None:
        out["cost_model_fallback"] = fallback
    if backend == "sim":
        differs = differences(cfg, cost.name, data, async_scheduling, fallback)
        out.update(validated_configuration=not differs, differs_from_validated=differs)
    return out


def _preset(group: str, name: str) -> dict:
    node = OmegaConf.to_container(OmegaConf.load(str(resources.files("testbed") / "conf" / group / f"{name}.yaml")))
    node.pop("defaults", None)
    return node


def differences(cfg: DictConfig, cost_name: str, data: Optional[dict], async_scheduling: bool,
                fallback: Optional[str]) -> list[str]:
    """What differs from the validated configuration, as `key=value (why it matters)` items."""
    out = []
    if cost_name != VALIDATED["cost_model"]:
        out.append(f"cost_model={cost_name}" + (" (the measured tables could not price this run)" if fallback else ""))
    else:
        fitted = _preset("cost_model", "kernels")
        out += [f"cost_model.{k}={cfg.cost_model.get(k)} (shipped: {v})" for k, v in fitted.items()
                if k != "fallback" and cfg.cost_model.get(k) != v]  # (fallback: it did not fall back)
        if data is not None and data["gpu"] != VALIDATED["gpu"]:
            out.append(f"kernel tables of {data['gpu']} (the validation runs are on H100: h100_sxm)")
    frontend = cfg.get("frontend") or {}
    if frontend.get("name", "none") != VALIDATED["frontend"]:
        out.append(f"frontend={frontend.get('name', 'none')}")
    else:
        shipped = _preset("frontend", "vllm_api")
        out += [f"frontend.{k}={frontend.get(k)} (shipped: {v})" for k, v in shipped.items() if frontend.get(k) != v]
    if async_scheduling != VALIDATED["async_scheduling"]:
        auto = cfg.backend.get("async_scheduling") is None  # off by vLLM's own rule, or not modelled
        why = (" (vLLM's default with ngram or draft-model speculative decoding)" if auto and
               (cfg.get("spec_decode") or {}).get("method", "none") != "none" else
               " (not modelled with disaggregated pools)" if auto and (cfg.get("disagg") or {}).get("enabled") else "")
        out.append("async scheduling off" + why)
    return out


def describe_data(data: dict) -> str:
    """e.g. 'aiconfigurator-core 0.12.0 and aiconfigurator @ 095f58a vLLM tables for h100_sxm (context attention, gemm, generation
    attention: vLLM 0.24.0), shipped with the testbed'."""
    fw = {"vllm": "vLLM", "sglang": "SGLang", "trtllm": "TensorRT-LLM"}.get(data["framework"], data["framework"])
    by_version: dict[str, list[str]] = {}
    for op, v in data["versions"].items():
        label = f"NCCL {v}" if op == "nccl" else f"{fw} {v}"
        by_version.setdefault(label, []).append("all-reduce" if op in ("nccl", "allreduce") else op.replace("_", " "))
    ops = "; ".join(f"{', '.join(o)}: {label}" for label, o in by_version.items())
    where = {"shipped": ", shipped with the testbed", "installed": ", from the installed package"}.get(data["source"], "")
    return f"{data['tables']} {fw} tables for {data['gpu']} ({ops}){where}"


def line(summary: dict) -> str:
    """One line naming the configuration that produced a simulated run's numbers and whether it is the
    validated one, e.g. 'validated configuration: llama3.1-8b on h100-sxm, cost_model=kernels
    (aiconfigurator-core 0.12.0 and aiconfigurator @ 095f58a vLLM tables for h100_sxm), frontend=vllm_api, async scheduling'."""
    cost = summary.get("cost_model", "?")
    data = summary.get("cost_model_data")
    what = f"cost_model={cost}"
    if data:
        fw = {"vllm": "vLLM", "sglang": "SGLang", "trtllm": "TensorRT-LLM"}.get(data["framework"], data["framework"])
        what += f" ({data['tables']} {fw} tables for {data['gpu']})"
    if summary.get("cost_model_fallback"):
        what += " standing in for cost_model=kernels"
    where = f"{summary.get('model')} on {summary.get('hardware')}"
    where += "".join(f", {k} {summary[key]}" for k, key in (("TP", "tensor_parallel_size"), ("PP", "pipeline_parallel_size"))
                     if summary.get(key, 1) > 1)
    if summary.get("sampler"):
        what += f", sampler: {summary['sampler']}"
    parts = [where, what, f"frontend={summary.get('frontend', 'none')}",
             "async scheduling" if summary.get("async_scheduling") else "no async scheduling"]
    if summary.get("validated_configuration"):
        return "validated configuration: " + ", ".join(parts)
    differs = summary.get("differs_from_validated")
    return "configuration: " + ", ".join(parts) + (f"; not the validated one: {'; '.join(differs)}" if differs else "")


def table_row(summary: dict) -> tuple[str, str]:
    """The printed table's row naming the cost model and its data."""
    data = summary.get("cost_model_data")
    text = summary.get("cost_model", "?") + (f": {describe_data(data)}" if data else "")
    if summary.get("cost_model_fallback"):
        text += f", standing in for kernels ({summary['cost_model_fallback']})"
    return "cost model", text
