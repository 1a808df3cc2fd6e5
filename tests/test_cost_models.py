"""A run's cost model from plain values (`testbed.sim.cost_models`), and the config's reading into them
(`testbed.app.assembly.run_setup.cost_model_spec`)."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from testbed.core.cost import BatchShape
from testbed.core.specs import HardwareSpec, ModelSpec, ParallelSpec
from testbed.sim import cost_models
from testbed.sim.cost_models import CostModelSpec, SpecDecodeSpec, assemble, block_bytes_per_gpu
from testbed.sim.fitted_cost import ProfileCostModel
from testbed.sim.kernel_cost import KernelCostModel
from testbed.sim.kernel_db import KernelDBError
from testbed.sim.roofline import RooflineCostModel
from testbed.sim.spec_cost import SpecDecodeCostModel


PROFILE = str(Path(__file__).resolve().parent.parent / "testbed" / "profiles" / "cpu_tiny_llama.csv")


def compose_cfg(*overrides):
    from hydra import compose, initialize_config_dir

    from testbed.app.entry.cli import CONF_DIR

    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def preset(kind: str, name: str, cls):
    from omegaconf import OmegaConf

    from testbed.app.entry.cli import CONF_DIR

    node = OmegaConf.to_container(OmegaConf.load(CONF_DIR / kind / f"{name}.yaml"))
    node.pop("defaults", None)
    return cls(**node)


@pytest.fixture(scope="module")
def llama():
    return preset("model", "llama3_1_8b", ModelSpec)


@pytest.fixture(scope="module")
def h100():
    return preset("hardware", "h100", HardwareSpec)


def test_the_plain_defaults_are_the_configs():
    """CostModelSpec repeats the config's defaults so that the simulator's side needs no config: they
    must not drift apart."""
    from testbed.app.assembly.config import CostModelConfig, KVConfig, SchedulerConfig

    config = {f.name: f.default for f in dataclasses.fields(CostModelConfig)}
    spec = {f.name: f.default for f in dataclasses.fields(CostModelSpec)}
    assert set(cost_models.COST_MODEL_KEYS) == set(config)
    assert {k: spec[k] for k in cost_models.COST_MODEL_KEYS} == config
    kv, sched = ({f.name: f.default for f in dataclasses.fields(c)} for c in (KVConfig, SchedulerConfig))
    assert spec["block_size"] == kv["block_size"]
    assert spec["max_tokens"] == max(sched["max_num_batched_tokens"], sched["max_num_seqs"])


def test_the_config_reads_into_the_spec():
    from testbed.app.assembly.run_setup import cost_model_spec

    cfg = compose_cfg("cost_model=kernels", "cost_model.kernel_scale=1.25", "scheduler.max_num_seqs=9000",
                      "kv.block_size=32", "parallel.tensor_parallel_size=2", "sampling.top_p=0.5",
                      "spec_decode.method=draft", "spec_decode.draft_model=llama3_2_1b", "kv.offload_gb=2")
    spec = cost_model_spec(cfg)
    assert (spec.name, spec.kernel_scale, spec.max_tokens, spec.block_size) == ("kernels", 1.25, 9000, 32)
    assert spec.parallel.tensor_parallel_size == 2 and spec.offload
    assert spec.sampling["top_p"] == 0.5 and spec.sampling["temperature"] is None
    assert spec.layer_overhead_s == cfg.cost_model.layer_overhead_s  # the preset's, not the schema's 0
    assert spec.spec_decode.method == "draft" and spec.spec_decode.draft.name == preset(
        "model", "llama3_2_1b", ModelSpec).name
    assert not spec.async_scheduling  # a draft model turns vLLM's async scheduling off


def test_kernels_fall_back_to_the_roofline_only_when_told(llama, h100):
    no_tables = dataclasses.replace(h100, kernel_db_gpu=None)
    with pytest.raises(KernelDBError, match="hardware.kernel_db_gpu is not set"):
        assemble(CostModelSpec(name="kernels"), llama, no_tables)
    notes: dict = {}
    cost = assemble(CostModelSpec(name="kernels", fallback="roofline"), llama, no_tables, notes)
    assert isinstance(cost, RooflineCostModel) and "kernel_db_gpu" in notes["cost_model_fallback"]
    with pytest.raises(ValueError, match="cost_model.fallback='nearest': expected roofline or null"):
        assemble(CostModelSpec(name="kernels", fallback="nearest"), llama, no_tables)
    with pytest.raises(ValueError, match=r"cost_model.name='analytic': expected one of \['roofline'"):
        assemble(CostModelSpec(name="analytic"), llama, h100)


def test_a_draft_model_s_kernel_passes_carry_no_host_or_sampler_term(llama, h100):
    draft = preset("model", "llama3_2_1b", ModelSpec)
    spec = CostModelSpec(name="kernels", max_tokens=512, host_step_s=1e-3, host_seq_s=2e-5, step_overhead_s=1e-4,
                         spec_decode=SpecDecodeSpec("draft", 3, draft_name="llama3_2_1b", draft=draft))
    cost = assemble(spec, llama, h100)
    assert isinstance(cost, SpecDecodeCostModel) and isinstance(cost.target, KernelCostModel)
    target, drafting = cost.target, cost.draft
    assert (target.host_step, target.sampler is not None) == (1e-3, True)
    assert (drafting.host_step, drafting.host_seq, drafting.sampler) == (0.0, 0.0, None)
    assert drafting.model is draft and drafting.step_overhead < target.step_overhead


def test_drafting_is_refused_where_nothing_prices_the_draft(llama, h100):
    draft = SpecDecodeSpec("draft", 3, draft_name="llama3_2_1b", draft=preset("model", "llama3_2_1b", ModelSpec))
    tiny, cpu = preset("model", "tiny_llama", ModelSpec), preset("hardware", "cpu", HardwareSpec)
    with pytest.raises(ValueError, match="a profile holds one measured model's step times, none of the draft llama3_2_1b"):
        assemble(CostModelSpec(name="profile", profile=PROFILE, spec_decode=draft), tiny, cpu)
    with pytest.raises(ValueError, match="no draft model's shapes"):
        assemble(CostModelSpec(spec_decode=SpecDecodeSpec("draft", 3, draft_name="x")), llama, h100)
    with pytest.raises(ValueError, match="spec_decode.method='eagle'"):
        assemble(CostModelSpec(spec_decode=SpecDecodeSpec("eagle", 3)), llama, h100)


def test_a_profile_charges_the_host_link_only_with_a_host_tier():
    path = PROFILE
    model, cpu = preset("model", "tiny_llama", ModelSpec), preset("hardware", "cpu", HardwareSpec)
    shared = ProfileCostModel.from_file(path)
    plain = assemble(CostModelSpec(name="profile", profile=path), model, cpu)
    tiered = assemble(CostModelSpec(name="profile", profile=path, offload=True, block_size=32), model, cpu)
    assert tiered is not plain
    assert tiered.host_link_s_per_block == block_bytes_per_gpu(32, model, ParallelSpec()) / cpu.host_link_bandwidth
    assert block_bytes_per_gpu(32, model, ParallelSpec()) == 32 * model.kv_bytes_per_token
    shape = BatchShape(num_prefill_tokens=64, num_prefill_seqs=1, prefill_attn_pairs=64 * 32.5, prefill_kv_tokens=64,
                       load_blocks=4)
    assert plain.step_time(shape) == shared.step_time(shape)  # the shared fit kept its own (no) host link
    assert tiered.step_time(shape) > plain.step_time(shape)
    with pytest.raises(ValueError, match="needs cost_model.profile"):
        assemble(CostModelSpec(name="profile"), model, cpu)


def test_the_profile_check_is_shown_the_fitted_model():
    path = PROFILE
    seen = []
    model, cpu = preset("model", "tiny_llama", ModelSpec), preset("hardware", "cpu", HardwareSpec)
    cost = assemble(CostModelSpec(name="profile", profile=path), model, cpu, check_profile=seen.append)
    assert seen == [cost]
