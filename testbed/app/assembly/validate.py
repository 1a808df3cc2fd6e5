"""The composed config checked against its schemas, first thing in every entry point.

Hydra type-checks what a config file or a plain override sets, but a key added with `+`
(`+scheduler.max_num_seq=10`, the very form Hydra's own error message suggests) joins a
structured node unchecked, and the run would go on with the key silently unused. So every
entry point (`testbed-sim`, `testbed-capacity`, `testbed-profile`, `testbed-fidelity`) calls
`check_config` on the composed config: each node is compared with its dataclass
(`TestbedConfig` and the group schemas; the policy node with its registered policy's
`Knobs`), and every problem is reported at once, naming the key and the closest valid one.
Only fields typed as a mapping (`trace.columns`) are open to new keys. The same walk
range-checks every numeric value against the bounds its field declares
(`testbed.core.bounds`), so `policy.max_batch_size=-1` or `kv.swap_space_gb=-1` fail here,
naming the key and the rule, rather than stalling a run or failing deep inside it.
"""
from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from functools import cache
from typing import Any, Iterator, Union

from omegaconf import DictConfig, ListConfig, OmegaConf

from testbed.app.assembly.config import BackendConfig, DisaggConfig, SpecDecodeConfig, TestbedConfig, TraceConfig
from testbed.app.assembly.frontend import FrontendConfig
from testbed.app.assembly.plugins import load_policies, load_routers
from testbed.core.bounds import bounds_of, range_problem
from testbed.core.specs import kv_cache_dtype_name, weight_dtype_name
from testbed.vllm_backend.native_sim import NATIVE_POLICY, VLLMNativeKnobs


VLLM_SCHEDULERS = ("native", "policy")


class ConfigError(ValueError):
    """The config names keys or values that cannot run; the message lists each one."""


def check_config(cfg: DictConfig, backend: str | None = None) -> None:
    """Raise ConfigError listing every key of `cfg` that its schema does not declare, every
    numeric value outside the range its field declares (`testbed.core.bounds`), and, when the
    run uses the engine or vLLM (`backend`, else `cfg.backend.name`), every simulator-only key set
    (the engine and vLLM serve one replica, run every step and have no HTTP front end)."""
    problems = schema_choices()
    problems += [p for path, node, schema in schema_nodes(cfg)
                for p in unknown_keys(path, node, schema) + out_of_range(path, node, schema)]
    name = backend or cfg.backend.get("name")
    if name in ("engine", "vllm"):
        problems += sim_only_keys_set(cfg, name) + multi_gpu_set(cfg, name)
        if (router := (cfg.get("router") or {}).get("name", "round_robin")) != "round_robin":
            problems.append(f"router={router}: the simulator's only (backend={name} serves one replica: nothing is "
                            "routed): leave it at round_robin")
        if "kv" in cfg and cfg.kv.get("offload_gb"):
            problems.append(f"kv.offload_gb={cfg.kv.offload_gb}: the simulator's only (the host KV tier is "
                            f"bookkeeping, backend={name} would copy no block to host): leave it at 0")
    problems += dtype_problems(cfg, name)
    if name == "vllm" and cfg.backend.get("scheduler", "native") not in VLLM_SCHEDULERS:
        problems.append(f"backend.scheduler={cfg.backend.scheduler}: expected one of {', '.join(VLLM_SCHEDULERS)} "
                        "(native: vLLM's own scheduler; policy: the testbed's policy inside vLLM)")
    if name == "vllm" and cfg.backend.get("scheduler") == "policy" and "policy" in cfg:
        from testbed.vllm_backend.policy import swap_knob_problem  # imports no vLLM

        if problem := swap_knob_problem(dict(cfg.policy), cfg.policy.get("name")):
            problems.append(problem)
    if (cfg.get("policy") or {}).get("name") == NATIVE_POLICY:
        problems += native_problems(cfg, name)
    if problems:
        raise ConfigError(f"config: {len(problems)} problem(s):\n  " + "\n  ".join(problems))


def schema_choices() -> list[str]:
    """A group option named `*_schema` on the command line (`policy=edf_schema`): a schema registered for
    the configs of its group to name (app/assembly/config.py), which Hydra offers among the options but which is
    no config: it would run with its dataclass defaults, not the ones a config file sets."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():  # composed by the compose API (tests, tools): no choices recorded
        return []
    return [f"{group}={choice}: a schema (the keys a {group} config may set), not a config to run; "
            f"choose a config, e.g. {group}={choice.removesuffix('_schema')}"
            for group, choice in HydraConfig.get().runtime.choices.items()
            if isinstance(choice, str) and choice.endswith("_schema") and not group.startswith("hydra")]


def native_problems(cfg: DictConfig, backend: str | None) -> list[str]:
    """What `policy=vllm_native` cannot run: vLLM's own scheduler runs in the simulator, one replica, with
    vLLM's own KV rules (testbed/vllm_backend/native_sim.py)."""
    def get(group: str, key: str, default=None):
        return (cfg.get(group) or {}).get(key, default)

    why = "policy=vllm_native (vLLM's own scheduler in the simulator)"
    out = []
    if backend != "sim":
        out.append(f"backend={backend}: {why} runs in the simulator; with real vLLM use backend=vllm "
                   "backend.scheduler=native")
    checks = [("backend", "replicas", 1, "one replica (one vLLM engine core)"),
              ("disagg", "enabled", False, "no disaggregated pools"),
              ("spec_decode", "method", "none", "no speculative decoding"),
              ("kv", "offload_gb", 0, "no host KV tier (vLLM's KV connectors are not built)"),
              ("kv", "cache_decode_tokens", "scheduled", "vLLM's rule: blocks are cached when scheduled"),
              ("trace", "session_replay", "open", "open-loop arrivals")]
    for group, key, default, rule in checks:
        value = get(group, key, default)
        if value != default and not (key == "offload_gb" and not value):
            out.append(f"{group}.{key}={value}: {why} runs {rule}; leave it at {default}")
    return out


def schema_nodes(cfg: DictConfig) -> Iterator[tuple[str, DictConfig, type | None]]:
    """(dotted path, node, schema dataclass) for the root and every structured node below it;
    the schema is None for a policy node whose name is no registered policy."""
    stack: list[tuple[str, DictConfig, type | None]] = [("", cfg, TestbedConfig)]
    while stack:
        path, node, schema = stack.pop()
        yield path, node, schema
        for key, hint in field_types(schema).items() if schema is not None else ():
            if not (dataclasses.is_dataclass(hint) or hint is Any) or key not in node or OmegaConf.is_missing(node, key):
                continue  # only nested schemas are walked: no leaf is resolved here
            child = node[key]
            if isinstance(child, DictConfig):  # Any: the policy or router node, whose schema is its Knobs
                stack.append((f"{path}{key}.", child, hint if hint is not Any else knobs_of(key, child.get("name"))))


def unknown_keys(path: str, node: DictConfig, schema: type | None) -> list[str]:
    if schema is None:
        kind = path.rstrip(".")
        return [f"{path}name={node.get('name')!r}: no such {kind}; registered: {', '.join(sorted(_registry(kind)))}"]
    known = list(field_types(schema))
    out = []
    for key in node.keys():
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f"did you mean {path}{close[0]}?" if close else f"the keys here: {', '.join(known)}"
            out.append(f"{path}{key}: unknown key ({hint})")
    return out


def out_of_range(path: str, node: DictConfig, schema: type | None) -> list[str]:
    out = []
    for f in dataclasses.fields(schema) if schema is not None else ():
        if bounds_of(f) is not None and f.name in node and not OmegaConf.is_missing(node, f.name):
            value = node[f.name]
            value = OmegaConf.to_container(value, resolve=True) if isinstance(value, ListConfig) else value
            if problem := range_problem(f"{path}{f.name}", value, bounds_of(f)):
                out.append(problem + (" (or null)" if f.name in nullable_fields(schema) else ""))
    return out


SIM_ONLY_GROUPS = (("backend", BackendConfig, ""), ("trace", TraceConfig, ""),
                   ("frontend", FrontendConfig, " (frontend=none)"),
                   ("disagg", DisaggConfig, ""), ("spec_decode", SpecDecodeConfig, ""))


def sim_only_keys_set(cfg: DictConfig, backend: str = "engine") -> list[str]:
    """The keys that only the simulator reads (`sim_only` on their field: the backend's replica and
    step keys, the modelled HTTP front end's delays), set to anything but their default."""
    return [f"{group}.{f.name}={_as_override(node[f.name])}: the simulator's only ({f.metadata['sim_only']}); "
            f"backend={backend} would ignore it: leave it at {_as_override(f.default)}{hint}"
            for group, schema, hint in SIM_ONLY_GROUPS if (node := cfg.get(group)) is not None
            for f in dataclasses.fields(schema)
            if "sim_only" in f.metadata and node.get(f.name, f.default) != f.default]


def multi_gpu_set(cfg: DictConfig, backend: str) -> list[str]:
    """Parallelism keys above 1: only the simulator spreads a replica over several GPUs."""
    node = cfg.get("parallel") or {}
    return [f"parallel.{key}={node.get(key)}: backend={backend} runs a replica on one GPU; leave it at 1 "
            f"(the simulator models tensor / pipeline parallelism)"
            for key in ("tensor_parallel_size", "pipeline_parallel_size") if (node.get(key) or 1) != 1]


def dtype_problems(cfg: DictConfig, backend: str | None) -> list[str]:
    """Bad model.weight_dtype / kv.cache_dtype values; a model.kv_cache_dtype set apart from kv.cache_dtype;
    and, for backend=engine or vllm, either one other than the model's dtype (the engine's torch layers hold
    the model dtype's weights and KV, and the vLLM backend passes neither on)."""
    model, kv = cfg.get("model") or {}, cfg.get("kv") or {}
    dtype = model.get("dtype", "bfloat16")
    out = []
    for key, value, name in (("model.weight_dtype", model.get("weight_dtype"), weight_dtype_name),
                             ("kv.cache_dtype", kv.get("cache_dtype", "auto"), kv_cache_dtype_name)):
        try:
            quantised = name(value, dtype) != dtype
        except ValueError as e:
            out.append(str(e))
            continue
        if quantised and backend in ("engine", "vllm"):
            out.append(f"{key}={value}: the simulator's only (backend={backend} computes and caches in the model's "
                       f"dtype, {dtype}): leave it at {'null' if key.startswith('model') else 'auto'}")
    if model.get("kv_cache_dtype", "auto") != kv.get("cache_dtype", "auto"):
        out.append(f"model.kv_cache_dtype={model.get('kv_cache_dtype')}: set kv.cache_dtype instead (the model "
                   f"spec copies it)")
    return out


def _as_override(value: Any) -> str:
    """A value as the command line writes it (true, not True; null, not None)."""
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


@cache
def field_types(schema: type) -> dict[str, Any]:
    """Each field's type with Optional[...] unwrapped (a mapping type stays: an open map)."""
    hints = typing.get_type_hints(schema)
    return {f.name: _unwrap(hints[f.name]) for f in dataclasses.fields(schema)}


@cache
def nullable_fields(schema: type) -> set[str]:
    hints = typing.get_type_hints(schema)
    return {f.name for f in dataclasses.fields(schema) if type(None) in typing.get_args(hints[f.name])}


def _unwrap(t: Any) -> Any:
    if typing.get_origin(t) in (Union, types.UnionType):
        args = [a for a in typing.get_args(t) if a is not type(None)]
        return args[0] if len(args) == 1 else t
    return t


def _registry(kind: str) -> dict[str, type]:
    return load_routers() if kind == "router" else {**load_policies(), NATIVE_POLICY: VLLMNative}


class VLLMNative:
    """`policy=vllm_native` in the registry's place: no policy object (vLLM's own scheduler decides,
    testbed/vllm_backend/native_sim.py), only its knobs."""

    Knobs = VLLMNativeKnobs


def knobs_of(kind: str, name: Any) -> type | None:
    """The knob dataclass of the registered policy or router (`kind`) called `name`, or None."""
    cls = _registry(kind).get(name)
    return cls.Knobs if cls is not None else None
