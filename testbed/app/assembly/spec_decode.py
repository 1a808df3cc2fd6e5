"""Speculative decoding from the config: the loop's `Drafter` and the cost model's drafting
(`spec_decode.*`; the mechanics are testbed/core/spec_decode.py and testbed/sim/spec_cost.py, the cost
model's assembly testbed/sim/cost_models.py)."""
from __future__ import annotations

from importlib import resources
from typing import Callable

from omegaconf import DictConfig, OmegaConf

from testbed.core.spec_decode import ACCEPTANCE_DISTS, METHODS, Drafter
from testbed.core.specs import ModelSpec
from testbed.sim.cost_models import SpecDecodeSpec


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


def spec_decode_spec(cfg: DictConfig) -> SpecDecodeSpec | None:
    """What the cost model prices of speculative decoding (`testbed.sim.cost_models.with_spec_decode`),
    with the draft model's preset read for method=draft; None when spec_decode is off."""
    sd = cfg.get("spec_decode")
    if sd is None or sd.method == "none":
        return None
    draft = draft_model_spec(sd.draft_model) if sd.method == "draft" else None
    return SpecDecodeSpec(sd.method, sd.num_speculative_tokens, sd.ngram_host_s, sd.draft_model, draft)
