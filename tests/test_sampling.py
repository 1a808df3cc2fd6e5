"""The requests' sampling parameters (as vLLM resolves them) and the sampler's GPU time they cost."""
from __future__ import annotations

import importlib.util
import json

import pytest

from testbed.core.cost import BatchShape
from testbed.core.generation_configs import known_generation_defaults, model_generation_defaults
from testbed.core.sampling import SamplingParams, generation_defaults, resolve
from testbed.core.specs import HardwareSpec, ModelSpec, ParallelSpec
from testbed.sim.sampler_cost import SORT_BYTES_PER_LOGIT, SamplerCost

LLAMA3 = {"temperature": 0.6, "top_p": 0.9}
QWEN25 = {"repetition_penalty": 1.05, "temperature": 0.7, "top_p": 0.8, "top_k": 20}
NO_REQUEST = dict.fromkeys(("temperature", "top_p", "top_k", "min_p", "repetition_penalty"))


# ---------------------------------------------------------------- resolution, as vLLM's API server
def test_a_request_setting_nothing_takes_the_models_defaults_then_the_neutral_ones():
    p = resolve(NO_REQUEST, LLAMA3)
    assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty) == (0.6, 0.9, 0, 1.0)
    assert resolve(NO_REQUEST, {}) == SamplingParams()  # temperature 1.0: random sampling, never greedy
    assert not SamplingParams().greedy


def test_the_request_wins_and_generation_config_vllm_ignores_the_model():
    assert resolve({**NO_REQUEST, "top_p": 1.0}, LLAMA3).top_p == 1.0
    assert resolve(NO_REQUEST, QWEN25, generation_config="vllm") == SamplingParams()
    with pytest.raises(ValueError, match="generation_config='hf'"):
        resolve(NO_REQUEST, LLAMA3, generation_config="hf")


def test_out_of_range_values_name_the_key():
    with pytest.raises(ValueError, match="sampling.top_p=0"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="sampling.temperature=-1"):
        resolve({"temperature": -1.0}, {})


def test_the_path_follows_vllm_0_15_1s_sampler():
    v = 128256
    assert resolve(NO_REQUEST, LLAMA3).path(v) == "sort"
    assert resolve(NO_REQUEST, QWEN25).path(152064) == "sort+penalties"
    assert resolve(NO_REQUEST, {}).path(v) == "random"
    assert SamplingParams(top_k=20).path(v) == "top_k"
    assert SamplingParams(top_k=v).path(v) == "random"  # a top-k as wide as the vocabulary is off
    assert SamplingParams(temperature=0.0, top_p=0.9).path(v) == "greedy"  # greedy skips top-p
    assert SamplingParams(temperature=0.0, repetition_penalty=1.1).path(v) == "greedy+penalties"
    assert SamplingParams(min_p=0.1).path(v) == "random+min_p"


def test_only_keys_differing_from_transformers_defaults_count():
    file = {"do_sample": True, "temperature": 1.0, "top_k": 50, "top_p": 0.9, "bos_token_id": 1}
    assert generation_defaults(file) == {"top_p": 0.9}


# ---------------------------------------------------------------- where a model's defaults come from
def test_known_checkpoints_by_id_or_bare_name():
    assert known_generation_defaults("Qwen/Qwen2.5-7B-Instruct") == QWEN25
    assert known_generation_defaults("llama-2-7b-hf") == LLAMA3
    assert known_generation_defaults("mistralai/Mistral-Nemo-Instruct-2407") == {}
    assert known_generation_defaults("someone/unknown-model") is None
    defaults, source = model_generation_defaults(None, None, "someone/unknown-model")
    assert defaults == {} and "neutral" in source
    assert model_generation_defaults({"top_p": 0.5}, "Qwen/Qwen2.5-7B-Instruct", None)[0] == {"top_p": 0.5}


def test_a_checkpoints_generation_config_json_is_read_beside_its_config(tmp_path):
    config = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=1000, _name_or_path="me/tiny")
    (tmp_path / "config.json").write_text(json.dumps(config))
    spec = ModelSpec.from_hf_config(tmp_path)
    assert spec.hf_id == "me/tiny" and spec.generation_config is None
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.7, "top_k": 50, "eos_token_id": 2}))
    assert ModelSpec.from_hf_config(tmp_path / "config.json").generation_config == {"temperature": 0.7}
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="generation_config.json is not valid JSON"):
        ModelSpec.from_hf_config(tmp_path)


# ---------------------------------------------------------------- the sampler's GPU time
H100_BW = HardwareSpec().mem_bandwidth


def test_sampler_time_is_fixed_plus_linear_in_rows_and_vocabulary():
    sort = SamplerCost(SamplingParams(temperature=0.6, top_p=0.9), 128256, H100_BW)
    assert sort.time(0) == 0.0
    assert sort.time(64) - sort.time(32) == pytest.approx(32 * sort.per_row_s)
    # the sort's share of a row is the measured rate: 364 bytes per logit at the GPU's bandwidth
    plain = SamplerCost(SamplingParams(temperature=0.6), 128256, H100_BW)
    assert sort.per_row_s - plain.per_row_s == pytest.approx(SORT_BYTES_PER_LOGIT * 128256 / H100_BW)
    # a 152k vocabulary costs more per row than a 32k one; a slower GPU more than a faster one
    assert SamplerCost(sort.params, 152064, H100_BW).per_row_s > SamplerCost(sort.params, 32000, H100_BW).per_row_s
    assert SamplerCost(sort.params, 128256, H100_BW / 2).time(8) > sort.time(8)


def test_each_pass_adds_its_cost():
    v = 152064
    times = [SamplerCost(p, v, H100_BW).time(16) for p in (
        SamplingParams(temperature=0.0), SamplingParams(), SamplingParams(top_k=20),
        SamplingParams(top_p=0.8), SamplingParams(top_p=0.8, repetition_penalty=1.05))]
    assert times == sorted(times) and len(set(times)) == len(times)
    with pytest.raises(ValueError, match="sampler_kernel_s=-1"):
        SamplerCost(SamplingParams(), v, H100_BW, kernel_s=-1)


@pytest.mark.skipif(importlib.util.find_spec("aiconfigurator_core") is None,
                    reason="aiconfigurator-core (the measured kernel tables) is not installed")
def test_the_kernel_step_adds_exactly_the_sampler_of_its_rows():
    from testbed.sim.kernel_cost import KernelCostModel
    from testbed.sim.kernel_db import KernelDB

    model = ModelSpec(name="qwen2.5-7b", hidden_size=3584, intermediate_size=18944, num_layers=28, num_heads=28,
                      num_kv_heads=4, head_dim=128, vocab_size=152064)
    hw, db = HardwareSpec(kernel_db_gpu="h100_sxm"), KernelDB("h100_sxm", "vllm")
    sampler = SamplerCost(SamplingParams(**QWEN25), model.vocab_size, hw.mem_bandwidth)
    without = KernelCostModel(model, hw, ParallelSpec(), db, max_tokens=512)
    with_ = KernelCostModel(model, hw, ParallelSpec(), db, max_tokens=512, sampler=sampler)
    for s in (BatchShape(num_decode_seqs=11, decode_kv_tokens=11 * 900),
              BatchShape(num_prefill_tokens=300, num_prefill_seqs=1, prefill_attn_pairs=45150,
                         num_decode_seqs=40, decode_kv_tokens=40 * 700)):
        rows = s.num_decode_seqs + s.num_prefill_seqs
        assert with_.step_time(s) - without.step_time(s) == pytest.approx(sampler.time(rows), rel=1e-9)
    assert with_.step_time(BatchShape()) == without.step_time(BatchShape())  # an empty step samples nothing
