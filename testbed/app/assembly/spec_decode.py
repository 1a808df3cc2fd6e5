"""Speculative decoding from the config: the loop's `Drafter` and the cost model's drafting
(`spec_decode.*`; the mechanics are testbed/core/spec_decode.py and testbed/sim/spec_cost.py)."""
from __future__ import annotations

import dataclasses
from importlib import resources
from typing import Callable

from omegaconf import DictConfig, OmegaConf

from testbed.core.cost import CostModel
from testbed.core.spec_decode import ACCEPTANCE_DISTS, METHODS, Drafter
from testbed.core.specs import HardwareSpec, ModelSpec
from testbed.sim.spec_cost import SpecDecodeCostModel


def drafter_factory(cfg: DictConfig) -> Callable[[], Drafter] | None:
    """A new `Drafter` per loop when spec_decode.method is not none (its values checked now)."""
    sd = cfg.get("spec_decode")
    if sd is None:
        return None
    if sd.method not in METHODS:
        raise ValueError(f"spec_decode.method={sd.method!r}: expected one of {', '.join(METHODS)}")
    if sd.acceptance_dist not in ACCEPTANCE_DISTS:
        raise ValueError(f"spec_decode.acceptance_dist={sd.acceptance_dist!r}: expected one of {', '.join(ACCEPTANCE_DISTS)}")
    if sd.method == "none":
        return None
    args = (sd.num_speculative_tokens, sd.acceptance_rate, sd.acceptance_dist, sd.acceptance_concentration, cfg.seed)
    Drafter(*args)
    return lambda: Drafter(*args)


def draft_model_spec(name: str) -> ModelSpec:
    """A model preset of the package (conf/model/<name>.yaml) as a ModelSpec."""
    path = resources.files("testbed") / "conf" / "model" / f"{name}.yaml"
    if not path.is_file():
        names = sorted(p.name.removesuffix(".yaml") for p in (resources.files("testbed") / "conf" / "model").iterdir()
                       if p.name.endswith(".yaml"))
        raise ValueError(f"spec_decode.draft_model={name!r}: no such model preset; expected one of {', '.join(names)}")
    node = OmegaConf.to_container(OmegaConf.load(str(path)))
    node.pop("defaults", None)
    return ModelSpec(**node)


def with_spec_decode(cost: CostModel, cfg: DictConfig, model: ModelSpec, hw: HardwareSpec, parallel,
                     build_kernels: Callable[[DictConfig, ModelSpec, HardwareSpec], CostModel]) -> CostModel:
    """`cost` with drafting added when spec_decode.method is not none (else `cost` itself). `parallel`:
    the run's ParallelSpec; `build_kernels`: how the run builds a measured-kernel model (passed in by
    testbed.app.assembly.run_setup, which imports this module)."""
    sd = cfg.get("spec_decode")
    if sd is None or sd.method == "none":
        return cost
    if sd.method == "ngram":
        return SpecDecodeCostModel(cost, sd.num_speculative_tokens, host_s=sd.ngram_host_s)
    if sd.method != "draft":
        raise ValueError(f"spec_decode.method={sd.method!r}: expected one of none, ngram, draft")
    draft = draft_model_spec(sd.draft_model)
    name = cost.name.split(":")[0]  # the kind that prices the target (roofline where it stood in for kernels)

    if name == "roofline":
        from testbed.sim.roofline import RooflineCostModel

        bare = dataclasses.replace(hw, step_overhead_s=0.0, decode_seq_overhead_s=0.0)
        draft_cost = RooflineCostModel(draft, bare, block_size=cfg.kv.block_size, parallel=parallel)
    elif name == "kernels":
        bare_cfg = cfg.copy()
        bare_cfg.cost_model.step_overhead_s = bare_cfg.cost_model.seq_overhead_s = 0.0
        # the draft passes run inside the target's step (the proposer in the worker's execute_model): no scheduler
        # or input-preparation work of their own, and they draft greedily (argmax over the draft logits,
        # vllm/v1/spec_decode/eagle.py of 0.15.1), so neither the host term nor the sampler's passes repeat per pass
        bare_cfg.cost_model.host_step_s = bare_cfg.cost_model.host_seq_s = 0.0
        bare_cfg.cost_model.sampler = False
        draft_cost = build_kernels(bare_cfg, draft, hw)
    else:
        raise ValueError(f"spec_decode.method=draft with cost_model={name}: a profile holds one measured model's "
                         f"step times, none of the draft {sd.draft_model}'s; use cost_model=roofline or kernels, "
                         f"or spec_decode.method=ngram")
    return SpecDecodeCostModel(cost, sd.num_speculative_tokens, draft=draft_cost)
