"""Quantised weights (model.weight_dtype) and KV cache (kv.cache_dtype): bytes, rates, KV capacity.

The acceptance test: an fp8 KV cache doubles the KV capacity in blocks against bf16. With the
weights and reserves fixed, capacity = floor(free / block bytes) and an fp8 block is exactly half a
bf16 one, so fp8 holds floor(2 free / B) = 2 floor(free / B) or that plus one blocks.
"""
from __future__ import annotations

import functools
import math

import pytest
from hydra import compose, initialize_config_dir
from hypothesis import given, settings
from hypothesis import strategies as st

from testbed.app.entry.cli import CONF_DIR
from testbed.app.assembly.run_setup import prepare, resolve_model_spec
from testbed.app.assembly.run import simulate
from testbed.app.assembly.validate import ConfigError, check_config
from testbed.core.cost import BatchShape
from testbed.core.specs import HardwareSpec, ModelSpec, ParallelSpec, kv_capacity_blocks
from testbed.sim.roofline import RooflineCostModel



def config(*overrides):
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=list(overrides))


@functools.lru_cache(maxsize=None)
def _hardware_preset(name: str) -> tuple:
    return tuple(config(f"hardware={name}").hardware.items())  # one Hydra compose per preset, not per example


def hardware(name: str) -> HardwareSpec:
    return HardwareSpec(**dict(_hardware_preset(name)))


def model(name: str = "llama3_1_8b", **kw) -> ModelSpec:
    spec = resolve_model_spec(config(f"model={name}").model, keep_name=True)
    return ModelSpec(**{**spec.__dict__, **kw})


def decode(batch: int, context: int) -> BatchShape:
    return BatchShape(num_decode_seqs=batch, decode_kv_tokens=batch * context)


def prefill(tokens: int) -> BatchShape:
    return BatchShape(num_prefill_tokens=tokens, num_prefill_seqs=1, prefill_attn_pairs=tokens * (tokens + 1) // 2,
                      prefill_kv_tokens=tokens)


# ---------------------------------------------------------------- KV capacity
@settings(max_examples=60, deadline=None)
@given(layers=st.integers(1, 96), kv_heads=st.sampled_from([1, 2, 4, 8, 16]), head_dim=st.sampled_from([64, 128, 256]),
       block_size=st.sampled_from([1, 8, 16, 32]), utilization=st.floats(0.3, 1.0), tp=st.sampled_from([1, 2, 4]),
       weights=st.sampled_from([None, "fp8", "int4"]))
def test_fp8_kv_doubles_the_kv_capacity_in_blocks(layers, kv_heads, head_dim, block_size, utilization, tp, weights):
    spec = dict(hidden_size=1024, intermediate_size=4096, num_layers=layers, num_heads=16, num_kv_heads=kv_heads,
                head_dim=head_dim, vocab_size=32000, weight_dtype=weights)
    hw, par = hardware("h100"), ParallelSpec(tp)
    bf16 = kv_capacity_blocks(ModelSpec(**spec), hw, block_size, utilization, 1e9, par)
    fp8 = kv_capacity_blocks(ModelSpec(**spec, kv_cache_dtype="fp8"), hw, block_size, utilization, 1e9, par)
    assert fp8 in (2 * bf16, 2 * bf16 + 1)


@pytest.mark.parametrize("overrides", [["model=llama3_1_8b"], ["model=llama3_1_70b", "parallel.tensor_parallel_size=4"],
                                       ["model=llama3_1_8b", "hardware=a100", "kv.block_size=32"]])
def test_fp8_kv_doubles_the_blocks_a_run_gets(overrides):
    bf16 = prepare(config(*overrides, "trace.max_requests=5")).device_blocks
    fp8 = prepare(config(*overrides, "trace.max_requests=5", "kv.cache_dtype=fp8")).device_blocks
    assert fp8 in (2 * bf16, 2 * bf16 + 1)


def test_quantised_weights_free_memory_for_kv_blocks():
    hw = hardware("h100")
    blocks = {w: kv_capacity_blocks(model(weight_dtype=w), hw, 16, 0.9, 1e9) for w in (None, "fp8", "int4")}
    assert blocks[None] < blocks["fp8"] < blocks["int4"]
    # a 70B model on 2 H100s: bf16 weights (70 GB per GPU) leave little room, fp8 a lot
    big = {w: kv_capacity_blocks(model("llama3_1_70b", weight_dtype=w), hw, 16, 0.9, 1e9, ParallelSpec(2))
           for w in (None, "fp8")}
    assert big["fp8"] > 4 * big[None]


def test_weight_bytes_quantise_the_linear_layers_only():
    bf16, fp8, int4 = (model(weight_dtype=w) for w in (None, "fp8", "int4"))
    linear = bf16.num_layers * (bf16.layer_params - bf16.layer_unquantised_params)
    assert bf16.weight_bytes == 2 * bf16.num_params
    assert bf16.weight_bytes - fp8.weight_bytes == linear  # 2 -> 1 byte, embeddings / LM head / norms kept
    assert int4.weight_bytes == math.ceil(linear * 133 / 256) + 2 * (bf16.num_params - linear)  # AWQ, group 128
    par = ParallelSpec(4, 2)
    assert (model("llama3_1_70b").weight_bytes_per_gpu(par)
            > model("llama3_1_70b", weight_dtype="fp8").weight_bytes_per_gpu(par))


# ---------------------------------------------------------------- roofline
def test_roofline_decode_falls_with_fp8_kv_at_long_contexts_and_quantised_weights_at_batch_1():
    hw = hardware("h100")
    t = {(w, kv): RooflineCostModel(model(weight_dtype=w, kv_cache_dtype=kv), hw)
         for w in (None, "fp8", "int4") for kv in ("auto", "fp8")}
    long, small = decode(64, 8192), decode(1, 512)
    assert t["fp8", "fp8"].step_time(long) < t["fp8", "auto"].step_time(long)
    assert t[None, "fp8"].step_time(long) < 0.75 * t[None, "auto"].step_time(long)  # the KV read dominates there
    assert (t["int4", "auto"].step_time(small) < t["fp8", "auto"].step_time(small)
            < 0.7 * t[None, "auto"].step_time(small))  # the weight read dominates there


def test_roofline_fp8_prefill_is_faster_on_h100_but_not_on_a100():
    for name, faster in (("h100", True), ("a100", False)):
        hw = hardware(name)
        bf16 = RooflineCostModel(model(), hw).step_time(prefill(8192))
        fp8 = RooflineCostModel(model(weight_dtype="fp8"), hw).step_time(prefill(8192))
        if faster:
            assert fp8 < 0.8 * bf16
        else:  # no fp8 tensor cores: weight-only, a compute-bound prefill gains nothing
            assert fp8 == pytest.approx(bf16, rel=1e-12)


# ---------------------------------------------------------------- kernel tables
@pytest.fixture(scope="module")
def db():
    from testbed.sim.kernel_db import KernelDB

    return KernelDB("h100_sxm", "vllm")


def kernels(db, hw="h100", **kw):
    from testbed.sim.kernel_cost import KernelCostModel

    return KernelCostModel(model(**kw), hardware(hw), ParallelSpec(), db, max_tokens=8192)


def test_kernel_decode_falls_with_fp8_kv_and_quantised_weights(db):
    bf16, fp8_kv = kernels(db), kernels(db, kv_cache_dtype="fp8")
    assert fp8_kv.step_time(decode(64, 8192)) < bf16.step_time(decode(64, 8192))
    assert db.sources_used["generation_attention fp8"] == "vllm_flash_attn_fa3"
    small = decode(1, 512)
    fp8_w, int4_w = kernels(db, weight_dtype="fp8"), kernels(db, weight_dtype="int4")
    assert int4_w.step_time(small) < fp8_w.step_time(small) < bf16.step_time(small)
    assert db.sources_used["gemm fp8"] == "CutlassFP8ScaledMMLinearKernel"


def test_kernel_fp8_prefill_reads_the_fp8_gemm_rows(db):
    assert kernels(db, weight_dtype="fp8").step_time(prefill(8192)) < 0.85 * kernels(db).step_time(prefill(8192))


def test_kernel_weight_only_gemm_saves_bytes_at_small_m_only(db):
    n, k, bf16 = 14336, 4096, db.gemm_over_m(14336, 4096, [1.0, 8192.0])
    wo = db.weight_only_gemm_over_m(n, k, [1.0, 8192.0], 133 / 256, 769e12, 2.98e12)
    assert wo[0] < 0.5 * bf16[0]
    assert wo[1] == pytest.approx(bf16[1], rel=0.02)


def test_kernel_tables_without_fp8_kv_rows_fail_naming_gpu_framework_op_and_dtype():
    from testbed.sim.kernel_cost import KernelCostModel
    from testbed.sim.kernel_db import KernelDB, KernelDBError

    with pytest.raises(KernelDBError) as e:
        KernelCostModel(model(kv_cache_dtype="fp8"), hardware("a100"), ParallelSpec(), KernelDB("a100_sxm", "vllm"))
    for word in ("kv.cache_dtype=fp8", "a100_sxm", "vllm", "attention", "kv_cache_dtype == 'fp8'"):
        assert word in str(e.value)


# ---------------------------------------------------------------- config
@pytest.mark.parametrize("overrides, words", [
    (["model.weight_dtype=int8"], "model.weight_dtype='int8': expected null, auto or one of"),
    (["kv.cache_dtype=fp4"], "kv.cache_dtype='fp4': expected auto or one of"),
    (["model.kv_cache_dtype=fp8"], "model.kv_cache_dtype=fp8: set kv.cache_dtype instead"),
    (["backend=engine", "kv.cache_dtype=fp8"], "kv.cache_dtype=fp8: the simulator's only (backend=engine"),
    (["backend=engine", "model.weight_dtype=int4"], "model.weight_dtype=int4: the simulator's only"),
])
def test_bad_or_unsupported_dtypes_are_refused_naming_the_key(overrides, words):
    with pytest.raises(ConfigError) as e:
        check_config(config(*overrides))
    assert words in str(e.value)


def test_the_model_dtype_spelled_out_is_no_quantisation():
    check_config(config("backend=engine", "model.weight_dtype=bf16", "kv.cache_dtype=bfloat16"))
    with pytest.raises(ValueError, match="model.weight_dtype='w4a8'"):
        ModelSpec(weight_dtype="w4a8")


def test_defaults_and_their_explicit_spelling_give_the_same_run():
    base = ["trace.max_requests=300", "output.write_steps=false"]
    auto = simulate(config(*base)).summary
    explicit = simulate(config(*base, "model.weight_dtype=bfloat16", "kv.cache_dtype=bf16")).summary
    fp8 = simulate(config(*base, "kv.cache_dtype=fp8")).summary
    drop = {"wall_s"}
    assert {k: v for k, v in auto.items() if k not in drop} == {k: v for k, v in explicit.items() if k not in drop}
    assert fp8["kv_blocks"] in (2 * auto["kv_blocks"], 2 * auto["kv_blocks"] + 1)


@pytest.mark.parametrize("quant, expect", [({"quant_method": "awq", "bits": 4, "group_size": 128}, "int4"),
                                           ({"quant_method": "gptq", "bits": 4}, "int4"),
                                           ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "fp8"),
                                           ({"quant_method": "gptq", "bits": 8}, None), (None, None)])
def test_a_quantised_checkpoint_config_sets_the_weight_dtype_unless_the_config_does(tmp_path, quant, expect):
    import json

    hf = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=4, num_attention_heads=16,
              num_key_value_heads=4, vocab_size=32000, **({"quantization_config": quant} if quant else {}))
    (tmp_path / "config.json").write_text(json.dumps(hf))
    assert resolve_model_spec(config(f"model.config_json={tmp_path}").model).weight_dtype == expect
    assert resolve_model_spec(config(f"model.config_json={tmp_path}", "model.weight_dtype=bf16").model).weight_dtype == "bf16"
