"""A run's cost model from plain values: the model's and the hardware's specs and a `CostModelSpec`
(the cost model's parameters, and what of the run it prices by: KV block size, batch bound,
parallelism, sampling, speculative decoding).

It sits beside the cost models it assembles so that the simulator's side of the choice (which kind,
its fallback, the draft model's bare passes, the host link a profile lacks) is read and tested
without a composed config; `testbed.app.assembly.run_setup` turns the config into a `CostModelSpec`
and passes what only the application knows (the profile's machine check) as a callback.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import logging
import warnings
from dataclasses import dataclass, field
from typing import Callable, Optional

from testbed.core.cost import CostModel
from testbed.core.generation_configs import model_generation_defaults
from testbed.core.sampling import SamplingParams, resolve
from testbed.core.specs import HardwareSpec, ModelSpec, ParallelSpec
from testbed.sim.roofline import RooflineCostModel
from testbed.sim.spec_cost import SpecDecodeCostModel

log = logging.getLogger("testbed")

KINDS = ("roofline", "profile", "kernels")
# the fields of CostModelSpec that are keys of the config's cost_model node, under the same names
COST_MODEL_KEYS = ("name", "profile", "fallback", "framework", "framework_version", "version_near", "moe_distribution",
                   "data_dir", "step_overhead_s", "layer_overhead_s", "seq_overhead_s", "allreduce_overhead_s",
                   "kernel_scale", "sampler", "sampler_kernel_s", "sampler_sort_bytes_per_logit", "host_step_s",
                   "host_seq_s")
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "frequency_penalty",
                 "presence_penalty")


@dataclass(frozen=True)
class SpecDecodeSpec:
    """Speculative decoding as the cost model prices it (the loop's drafting is `testbed.core.spec_decode`).
    `draft`: the draft model's shapes, for method=draft (`draft_name` names it in errors)."""

    method: str
    num_speculative_tokens: int
    ngram_host_s: float = 0.0
    draft_name: Optional[str] = None
    draft: Optional[ModelSpec] = None


@dataclass(frozen=True)
class CostModelSpec:
    """What prices a run's steps, as plain values (the fields of `cost_model.*` keep their config names).

    `sampling`/`generation_config`: the requests' sampling values and vLLM's `--generation-config` mode,
    resolved against the priced model's own defaults (a draft model drafts greedily and samples nothing).
    `offload`: whether a host KV tier exists (a profile then charges its loads at the host link)."""

    name: str = "roofline"
    block_size: int = 16  # (the defaults are the config's: kv.block_size, scheduler.max_num_batched_tokens)
    parallel: ParallelSpec = field(default_factory=ParallelSpec)
    max_tokens: int = 8192  # the most tokens a step holds (the batch bound): how far a kernel table's grid reaches
    async_scheduling: bool = False
    offload: bool = False
    profile: Optional[str] = None
    fallback: Optional[str] = None
    framework: str = "vllm"
    framework_version: Optional[str] = None
    version_near: Optional[str] = None
    moe_distribution: str = "balanced"
    data_dir: Optional[str] = None
    step_overhead_s: float = 0.0
    layer_overhead_s: float = 0.0
    seq_overhead_s: float = 0.0
    allreduce_overhead_s: float = 0.0
    kernel_scale: float = 1.0
    sampler: bool = True
    sampler_kernel_s: float = 6.5e-6
    sampler_sort_bytes_per_logit: float = 364.0
    host_step_s: float = 0.0
    host_seq_s: float = 0.0
    sampling: dict = field(default_factory=dict)
    generation_config: str = "auto"
    spec_decode: Optional[SpecDecodeSpec] = None


def assemble(spec: CostModelSpec, model: ModelSpec, hw: HardwareSpec, notes: dict | None = None,
             check_profile: Callable[[CostModel], object] | None = None) -> CostModel:
    """The cost model of `spec.name`, with speculative decoding's drafting when `spec.spec_decode` is on.
    `notes` (when given) receives `cost_model_fallback` when the roofline stood in for the kernel model;
    `check_profile` is shown a fitted profile, to warn when it was measured on another machine."""
    return with_spec_decode(target_model(spec, model, hw, notes, check_profile), spec, model, hw)


def target_model(spec: CostModelSpec, model: ModelSpec, hw: HardwareSpec, notes: dict | None = None,
                 check_profile: Callable[[CostModel], object] | None = None) -> CostModel:
    """The model that prices the target's own passes (no drafting)."""
    name = spec.name
    roofline = lambda: RooflineCostModel(model, hw, block_size=spec.block_size, parallel=spec.parallel)  # noqa: E731
    if name == "roofline":
        return roofline()
    if name == "profile":
        from testbed.sim.fitted_cost import ProfileCostModel

        if not spec.profile:
            raise ValueError("cost_model=profile needs cost_model.profile=<a profile file> (testbed-profile writes one; "
                             "profiles/ holds the shipped ones)")
        cost = ProfileCostModel.from_file(spec.profile)
        measured = cost.header.get("model")
        if measured and measured != model.name:
            warnings.warn(f"cost model {cost.name} was measured on model {measured!r}, this run is {model.name!r}",
                          stacklevel=2)
        if check_profile is not None:
            check_profile(cost)
        if spec.parallel.num_gpus > 1:
            warnings.warn(f"cost model {cost.name} holds one GPU's measured step times: parallel.* sizes the KV "
                          f"cache only, the step times stay single-GPU", stacklevel=2)
        return with_host_link(cost, spec, model, hw)
    if name == "kernels":
        from testbed.sim.kernel_db import KernelDBError

        try:
            return kernel_model(spec, model, hw)
        except (KernelDBError, ImportError) as e:
            if spec.fallback is None:
                raise
            if spec.fallback != "roofline":
                raise ValueError(f"cost_model.fallback={spec.fallback!r}: expected roofline or null") from None
            log.warning("cost_model=kernels cannot price this run (%s): the roofline stands in for it, and the summary "
                        "says so (cost_model.fallback=null makes this an error)", e)
            if notes is not None:
                notes["cost_model_fallback"] = str(e)
            return roofline()
    raise ValueError(f"cost_model.name={name!r}: expected one of {list(KINDS)}")


def kernel_model(spec: CostModelSpec, model: ModelSpec, hw: HardwareSpec) -> CostModel:
    """The measured-kernel cost model for hardware.kernel_db_gpu (its tables: testbed.sim.kernel_db.find_tables).
    A run the tables cannot price raises KernelDBError (ImportError: no tables for the GPU without the
    `kernels` extra); `target_model` then falls back to the roofline when spec.fallback says so."""
    from testbed.sim.kernel_cost import KernelCostModel
    from testbed.sim.sampler_cost import SamplerCost
    from testbed.sim.kernel_db import KernelDBError

    if not hw.kernel_db_gpu:
        raise KernelDBError(f"hardware.kernel_db_gpu is not set for {hw.name}: cost_model=kernels needs the GPU's name "
                            f"in the measured kernel database (e.g. hardware.kernel_db_gpu=h100_sxm; "
                            f"`python -m testbed.sim.kernel_db` lists them)")
    db = shared_kernel_db(hw.kernel_db_gpu, spec.framework, spec.framework_version, spec.data_dir, spec.version_near,
                          spec.moe_distribution)
    sampler = None
    if spec.sampler:
        params, _ = sampling_params(spec.sampling, spec.generation_config, model)
        sampler = SamplerCost(params, model.vocab_size, hw.mem_bandwidth, kernel_s=spec.sampler_kernel_s,
                              sort_bytes_per_logit=spec.sampler_sort_bytes_per_logit)
    return KernelCostModel(model, hw, spec.parallel, db, step_overhead_s=spec.step_overhead_s,
                           layer_overhead_s=spec.layer_overhead_s, seq_overhead_s=spec.seq_overhead_s,
                           allreduce_overhead_s=spec.allreduce_overhead_s,
                           kernel_scale=spec.kernel_scale, block_size=spec.block_size,
                           max_tokens=spec.max_tokens, sampler=sampler,
                           host_step_s=spec.host_step_s, host_seq_s=spec.host_seq_s,
                           async_scheduling=spec.async_scheduling)


def with_spec_decode(cost: CostModel, spec: CostModelSpec, model: ModelSpec, hw: HardwareSpec) -> CostModel:
    """`cost` with drafting added when spec.spec_decode is on (else `cost` itself)."""
    sd = spec.spec_decode
    if sd is None or sd.method == "none":
        return cost
    if sd.method == "ngram":
        return SpecDecodeCostModel(cost, sd.num_speculative_tokens, host_s=sd.ngram_host_s)
    if sd.method != "draft":
        raise ValueError(f"spec_decode.method={sd.method!r}: expected one of none, ngram, draft")
    if sd.draft is None:
        raise ValueError(f"spec_decode.method=draft: no draft model's shapes given (spec_decode.draft_model={sd.draft_name!r})")
    name = cost.name.split(":")[0]  # the kind that prices the target (roofline where it stood in for kernels)

    if name == "roofline":
        bare = dataclasses.replace(hw, step_overhead_s=0.0, decode_seq_overhead_s=0.0)
        draft_cost = RooflineCostModel(sd.draft, bare, block_size=spec.block_size, parallel=spec.parallel)
    elif name == "kernels":
        # the draft passes run inside the target's step (the proposer in the worker's execute_model): no scheduler
        # or input-preparation work of their own, and they draft greedily (argmax over the draft logits,
        # vllm/v1/spec_decode/eagle.py of 0.15.1), so neither the host term nor the sampler's passes repeat per pass
        bare_spec = dataclasses.replace(spec, step_overhead_s=0.0, seq_overhead_s=0.0, host_step_s=0.0,
                                        host_seq_s=0.0, sampler=False)
        draft_cost = kernel_model(bare_spec, sd.draft, hw)
    else:
        raise ValueError(f"spec_decode.method=draft with cost_model={name}: a profile holds one measured model's "
                         f"step times, none of the draft {sd.draft_name}'s; use cost_model=roofline or kernels, "
                         f"or spec_decode.method=ngram")
    return SpecDecodeCostModel(cost, sd.num_speculative_tokens, draft=draft_cost)


def with_host_link(cost, spec: CostModelSpec, model: ModelSpec, hw: HardwareSpec):
    """A profile cost model that charges host-tier loads at the hardware's host link (a profile
    measures none); a copy, as fitted models are shared within a process."""
    if not spec.offload:
        return cost
    cost = copy.copy(cost)
    cost.host_link_s_per_block = block_bytes_per_gpu(spec.block_size, model, spec.parallel) / hw.host_link_bandwidth
    return cost


def block_bytes_per_gpu(block_size: int, model: ModelSpec, parallel: ParallelSpec) -> int:
    """One KV block's bytes on one GPU (its share of the KV heads and layers): what host memory
    (swap space, the offload tier) holds per block, per GPU, as vLLM sizes both."""
    return block_size * model.kv_bytes_per_token_per_gpu(parallel)


def sampling_params(request: dict, generation_config: str, model: ModelSpec) -> tuple[SamplingParams, str]:
    """The requests' sampling parameters as vLLM resolves them (`request`'s values, else the model's
    generation defaults, else the neutral ones) and where the model's defaults came from."""
    defaults, source = model_generation_defaults(model.generation_config, model.hf_id, model.name)
    return resolve({k: request.get(k) for k in SAMPLING_KEYS}, defaults, generation_config), source


@functools.lru_cache(maxsize=8)
def shared_kernel_db(gpu: str, framework: str, version: str | None, data_dir: str | None, near: str | None = None,
                     moe_distribution: str = "balanced"):
    """One `KernelDB` per set of tables in a process. Its look-ups are memoised on the instance, so a
    process that builds many cost models (testbed-validate's replays: one per run and fitted value)
    reads and grids each table once instead of once per model (about 0.3 s each); the look-ups are
    pure, so sharing them changes no step time."""
    from testbed.sim.kernel_db import KernelDB

    return KernelDB(gpu, framework, version, data_dir, near=near, moe_distribution=moe_distribution)
