"""Model and GPU presets, `model.config_json`, and tensor / pipeline parallelism in the specs and the roofline.

Published sizes come from the model cards (parameter counts); shapes from the checkpoints' config.json.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from testbed.app.entry.cli import CONF_DIR
from testbed.app.assembly.run_setup import prepare, resolve_model_spec
from testbed.app.assembly.run import simulate
from testbed.core.cost import BatchShape
from testbed.core.specs import HardwareSpec, ModelSpec, ParallelSpec, kv_capacity_blocks
from testbed.sim.roofline import RooflineCostModel

# preset: (published total parameters, published active parameters), from the model cards
PUBLISHED = {
    "llama3_8b": (8.03e9, None), "llama3_1_8b": (8.03e9, None), "llama3_2_1b": (1.24e9, None),
    "llama3_1_70b": (70.6e9, None), "llama2_7b": (6.74e9, None), "llama2_70b": (69.0e9, None),
    "codellama_34b": (33.7e9, None), "qwen2_5_7b": (7.61e9, None), "qwen3_14b": (14.8e9, None),
    "qwen3_32b": (32.8e9, None), "qwen3_30b_a3b": (30.5e9, 3.3e9), "mistral_nemo_12b": (12.2e9, None),
    "mixtral_8x7b": (46.7e9, 12.9e9), "llama4_scout": (109e9, 17e9),
}
HARDWARE = ["h100", "h200", "a100", "l40s", "b200"]
AZURE_CONV = ["trace=azure_conv"]


def config(*overrides):
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def preset(name: str) -> ModelSpec:
    return resolve_model_spec(config(f"model={name}").model, keep_name=True)


def hardware(name: str) -> HardwareSpec:
    return HardwareSpec(**config(f"hardware={name}").hardware)


def smallest_tp(model: ModelSpec, hw: HardwareSpec) -> int:
    """The fewest GPUs (a power of two) whose memory holds the weights with room for a KV cache."""
    return next(tp for tp in (1, 2, 4, 8)
                if model.weight_bytes_per_gpu(ParallelSpec(tp)) < 0.75 * hw.memory_bytes)


def test_every_model_preset_is_listed_here():
    names = {p.stem for p in (CONF_DIR / "model").glob("*.yaml")} - {"tiny_llama"}
    assert names == set(PUBLISHED)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_parameter_counts_match_the_published_sizes(name):
    spec = preset(name)
    total, active = PUBLISHED[name]
    assert spec.num_params == pytest.approx(total, rel=0.03)
    assert spec.num_active_params == pytest.approx(active or total, rel=0.03)
    assert spec.is_moe == (active is not None)


def test_shapes_that_are_not_hidden_over_heads():
    # Qwen3 and Mistral-Nemo: head_dim 128 while hidden/heads is 64 (qwen3-30b-a3b), 80 (32b), 160 (nemo)
    for name in ("qwen3_30b_a3b", "qwen3_32b", "mistral_nemo_12b"):
        spec = preset(name)
        assert spec.head_dim == 128 != spec.hidden_size // spec.num_heads
        assert spec.kv_bytes_per_token == 2 * spec.num_layers * spec.num_kv_heads * 128 * 2


# --- config.json -----------------------------------------------------------------------------------

def write_config(folder: Path, cfg: dict) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


DENSE = {"model_type": "qwen3", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 3,
         "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1000,
         "max_position_embeddings": 4096, "rope_theta": 1e6, "tie_word_embeddings": True, "torch_dtype": "float16"}
QWEN_MOE = {"model_type": "qwen2_moe", "hidden_size": 128, "intermediate_size": 1024, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 500, "num_experts": 6,
            "num_experts_per_tok": 2, "moe_intermediate_size": 96, "shared_expert_intermediate_size": 384,
            "torch_dtype": "bfloat16"}
MIXTRAL = {"model_type": "mixtral", "hidden_size": 64, "intermediate_size": 224, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300, "num_local_experts": 4,
           "num_experts_per_tok": 2}
LLAMA4 = {"model_type": "llama4", "torch_dtype": "bfloat16",
          "text_config": {"model_type": "llama4_text", "hidden_size": 64, "intermediate_size": 96,
                          "intermediate_size_mlp": 192, "num_hidden_layers": 2, "num_attention_heads": 4,
                          "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 300, "num_local_experts": 4,
                          "num_experts_per_tok": 1, "max_position_embeddings": 8192}}


def test_config_json_dense(tmp_path):
    folder = write_config(tmp_path / "my-dense", DENSE)
    spec = ModelSpec.from_hf_config(folder)
    assert (spec.name, spec.hidden_size, spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim) == \
        ("my-dense", 256, 3, 8, 2, 64)
    assert (spec.vocab_size, spec.max_model_len, spec.dtype, spec.tie_word_embeddings) == (1000, 4096, "float16", True)
    assert not spec.is_moe and spec.rope_theta == 1e6 and spec.family == "qwen3"
    h, q, kv = 256, 8 * 64, 2 * 64
    assert spec.num_params == 3 * (2 * h * q + 2 * h * kv + 3 * h * 512 + 2 * h) + 1000 * h + h
    assert ModelSpec.from_hf_config(folder / "config.json").name == "my-dense"  # the file or its folder


def test_config_json_moe_variants(tmp_path):
    qwen = ModelSpec.from_hf_config(write_config(tmp_path / "q", QWEN_MOE))
    assert (qwen.num_experts, qwen.num_experts_per_tok, qwen.moe_intermediate_size,
            qwen.shared_expert_intermediate_size) == (6, 2, 96, 384)
    h = 128
    attention = 4 * h * h
    assert qwen.layer_params == attention + 6 * 3 * h * 96 + 3 * h * 384 + h * 6 + 2 * h
    assert qwen.active_layer_params == attention + 2 * 3 * h * 96 + 3 * h * 384 + h * 6 + 2 * h

    mixtral = ModelSpec.from_hf_config(write_config(tmp_path / "m", MIXTRAL))
    assert (mixtral.num_experts, mixtral.num_experts_per_tok, mixtral.shared_expert_intermediate_size) == (4, 2, 0)
    assert mixtral.expert_params == 3 * 64 * 224  # the experts have intermediate_size

    llama4 = ModelSpec.from_hf_config(write_config(tmp_path / "l4", LLAMA4))
    assert (llama4.hidden_size, llama4.head_dim, llama4.num_experts, llama4.num_experts_per_tok) == (64, 32, 4, 1)
    assert llama4.expert_params == 3 * 64 * 96 and llama4.shared_expert_intermediate_size == 96
    assert llama4.max_model_len == 8192 and llama4.dtype == "bfloat16"


def test_config_json_missing_key_names_file_and_key(tmp_path):
    folder = write_config(tmp_path / "broken", {k: v for k, v in DENSE.items() if k != "num_hidden_layers"})
    with pytest.raises(ValueError, match=r"broken/config.json has no 'num_hidden_layers'"):
        ModelSpec.from_hf_config(folder)
    with pytest.raises(ValueError, match="model.config_json"):
        ModelSpec.from_hf_config(tmp_path / "nowhere")


def test_config_json_through_the_config(tmp_path):
    folder = write_config(tmp_path / "tiny-moe", QWEN_MOE)
    cfg = config(f"model.config_json={folder}", "trace.max_requests=50", "kv.num_blocks=512")
    setup = prepare(cfg)
    assert setup.model.name == "tiny-moe" and setup.model.num_experts == 6  # not the preset's llama3.1-8b
    assert setup.model.num_params == ModelSpec.from_hf_config(folder).num_params
    assert resolve_model_spec(cfg.model, keep_name=True).name == "llama3.1-8b"
    assert simulate(cfg).summary["model"] == "tiny-moe"


def test_moe_top_k_is_checked():
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        ModelSpec(num_experts=8, num_experts_per_tok=0)


# --- parallelism: weights, KV, capacity ------------------------------------------------------------

def test_defaults_keep_the_single_gpu_numbers():
    for name in PUBLISHED:
        spec = preset(name)
        one = ParallelSpec()
        assert spec.weight_bytes_per_gpu(one) == spec.weight_bytes
        assert spec.kv_bytes_per_token_per_gpu(one) == spec.kv_bytes_per_token


def test_tp2_halves_the_weights_per_gpu():
    for name in ("llama3_1_70b", "mixtral_8x7b", "qwen3_30b_a3b"):
        spec = preset(name)
        half = spec.weight_bytes_per_gpu(ParallelSpec(2)) / spec.weight_bytes
        assert half == pytest.approx(0.5, abs=1e-3)  # only the norms and MoE routers are replicated
        assert spec.kv_bytes_per_token_per_gpu(ParallelSpec(2)) == spec.kv_bytes_per_token // 2


def test_kv_heads_replicate_when_tp_exceeds_them():
    spec = preset("qwen3_30b_a3b")  # 4 KV heads
    assert spec.kv_heads_per_gpu(4) == 1 and spec.kv_heads_per_gpu(8) == 1
    assert spec.kv_bytes_per_token_per_gpu(ParallelSpec(8)) == spec.kv_bytes_per_token_per_gpu(ParallelSpec(4))
    with pytest.raises(ValueError, match="tensor_parallel_size=3"):
        spec.check_parallel(ParallelSpec(3))


def test_pipeline_stages_split_layers_as_vllm():
    spec = preset("llama3_8b")  # 32 layers
    assert spec.stage_layers(3) == [11, 11, 10]  # the remainder goes to the stages before the last
    assert ModelSpec(num_layers=10).stage_layers(4) == [2, 3, 3, 2]
    stages = spec.stage_params_per_gpu(ParallelSpec(pipeline_parallel_size=2))
    assert sum(stages) == spec.num_params  # untied: embedding on the first stage, LM head on the last


def test_capacity_is_the_tightest_gpu():
    spec, hw = preset("llama3_1_70b"), hardware("h100")
    tp4 = kv_capacity_blocks(spec, hw, 16, 0.9, 1e9, ParallelSpec(4))
    free = hw.memory_bytes * 0.9 - spec.weight_bytes_per_gpu(ParallelSpec(4)) - 1e9
    assert tp4 == int(free // (16 * spec.kv_bytes_per_token_per_gpu(ParallelSpec(4))))
    pp3 = ParallelSpec(2, 3)  # 80 layers: stages of 27, 27 and 26
    per_stage = [int((hw.memory_bytes * 0.9 - w * 2 - 1e9) // (16 * kv)) for w, kv in
                 zip(spec.stage_params_per_gpu(pp3), spec.stage_kv_bytes_per_token(pp3))]
    assert kv_capacity_blocks(spec, hw, 16, 0.9, 1e9, pp3) == min(per_stage) < max(per_stage)


def test_a_model_too_big_for_one_gpu_says_to_use_tensor_parallel():
    with pytest.raises(ValueError, match=r"does not fit on h100-sxm.*parallel.tensor_parallel_size"):
        prepare(config("model=llama3_1_70b", "trace.max_requests=10"))


# --- the roofline ------------------------------------------------------------------------------------

def decode(batch: int, context: int = 512) -> BatchShape:
    return BatchShape(num_decode_seqs=batch, decode_kv_tokens=batch * context)


def test_tp2_adds_the_all_reduces():
    spec, hw = preset("llama3_1_70b"), hardware("h100")
    free_link = HardwareSpec(**{**hw.__dict__, "interconnect_bandwidth": 1e30, "interconnect_latency_s": 0.0})
    for shape in (decode(1), decode(64), BatchShape(num_prefill_tokens=2048, num_prefill_seqs=1,
                                                    prefill_attn_pairs=2048 * 1024.5, prefill_kv_tokens=2048)):
        tp2 = RooflineCostModel(spec, hw, parallel=ParallelSpec(2)).step_time(shape)
        no_comm = RooflineCostModel(spec, free_link, parallel=ParallelSpec(2)).step_time(shape)
        tokens = shape.num_tokens
        ring = 2 * (2 - 1) / 2 * tokens * spec.hidden_size * spec.dtype_bytes / hw.interconnect_bandwidth
        assert tp2 - no_comm == pytest.approx(2 * spec.num_layers * (ring + hw.interconnect_latency_s), rel=1e-6)
        tp1 = RooflineCostModel(spec, hw).step_time(shape)
        assert no_comm < tp1  # each GPU computes and reads half


def test_tp1_roofline_is_unchanged_by_the_parallel_default():
    spec, hw = preset("llama3_8b"), hardware("h100")
    a, b = RooflineCostModel(spec, hw), RooflineCostModel(spec, hw, parallel=ParallelSpec())
    for shape in (decode(1), decode(100, 2000)):
        assert a.step_time(shape) == b.step_time(shape)


def test_moe_batch1_decode_reads_only_the_routed_experts():
    spec = preset("mixtral_8x7b")
    # compute and attention made free: the step is the weight read plus the fixed overhead
    hw = HardwareSpec(matmul_flops=1e30, step_overhead_s=0.0)
    cost = RooflineCostModel(spec, hw)
    bw = hw.mem_bandwidth * hw.memory_efficiency
    read = cost.step_time(BatchShape(num_decode_seqs=1)) * bw
    # a decode token reads the active weights, less the embedding (its one row is gathered)
    assert read == pytest.approx((spec.num_active_params - spec.embedding_params) * spec.dtype_bytes, rel=1e-9)
    everything = cost.step_time(BatchShape(num_prefill_tokens=4096, num_prefill_seqs=1)) * bw
    assert everything == pytest.approx((spec.num_params - spec.embedding_params) * spec.dtype_bytes, rel=1e-6)
    # between: 8 tokens touch 8 (1 - (3/4)^8) = 7.2 of the 8 experts on average
    some = cost.step_time(BatchShape(num_decode_seqs=8)) * bw
    expert_bytes = spec.num_layers * spec.expert_params * spec.dtype_bytes
    assert some - read == pytest.approx((8 * (1 - 0.75 ** 8) - 2) * expert_bytes, rel=1e-9)


def test_kv_read_efficiency_and_per_sequence_overhead():
    spec = preset("llama3_8b")
    base = HardwareSpec()
    slow_kv = HardwareSpec(kv_read_efficiency=base.memory_efficiency / 2)
    shape = decode(64, 4096)
    t0, t1 = RooflineCostModel(spec, base).step_time(shape), RooflineCostModel(spec, slow_kv).step_time(shape)
    kv_time = 64 * 4096 * spec.kv_bytes_per_token / (base.mem_bandwidth * base.memory_efficiency)
    assert t1 - t0 == pytest.approx(kv_time, rel=1e-9)  # memory-bound attention: twice as long
    per_seq = HardwareSpec(decode_seq_overhead_s=1e-5)
    assert RooflineCostModel(spec, per_seq).step_time(shape) - t0 == pytest.approx(64e-5, rel=1e-9)


def test_pipeline_is_the_slowest_stage_plus_hand_offs():
    spec, hw = preset("llama3_8b"), hardware("h100")
    shape = decode(32, 1024)
    pp2 = RooflineCostModel(spec, hw, parallel=ParallelSpec(pipeline_parallel_size=2)).step_time(shape)
    tp1 = RooflineCostModel(spec, hw).step_time(shape)
    handoff = 32 * spec.hidden_size * spec.dtype_bytes / hw.interconnect_bandwidth + hw.interconnect_latency_s
    assert handoff < pp2 - tp1 / 2 < tp1 / 2  # a half-model stage (plus the LM head) beats the whole


# --- every GPU with a few models, through Hydra -------------------------------------------------------

@pytest.mark.parametrize("hw", HARDWARE)
@pytest.mark.parametrize("model", ["llama3_1_8b", "qwen3_30b_a3b", "llama3_1_70b"])
def test_presets_simulate_the_azure_conv_trace(hw, model):
    tp = smallest_tp(preset(model), hardware(hw))
    summary = simulate(config(f"model={model}", f"hardware={hw}", f"parallel.tensor_parallel_size={tp}",
                              "trace.max_requests=300", *AZURE_CONV)).summary
    assert summary["completed"] == 300 and summary["hardware"] == hardware(hw).name
    assert 0 < summary["mean_ttft_ms"] and 0 < summary["mean_tpot_ms"]


def test_faster_gpus_give_faster_decodes():
    spec = preset("llama3_1_8b")
    times = {hw: RooflineCostModel(spec, hardware(hw)).step_time(decode(8)) for hw in HARDWARE}
    assert times["b200"] < times["h200"] < times["h100"] < times["a100"] < times["l40s"]


@pytest.mark.slow
@pytest.mark.parametrize("hw", HARDWARE)
def test_every_model_preset_on_the_whole_trace(hw):
    for model in sorted(PUBLISHED):
        tp = smallest_tp(preset(model), hardware(hw))
        summary = simulate(config(f"model={model}", f"hardware={hw}", f"parallel.tensor_parallel_size={tp}",
                                  *AZURE_CONV)).summary
        # all served but the prompts longer than the model's context (Llama-2: 4096 tokens), which are rejected
        assert summary["unfinished"] == 0 and not summary["stalled"], (model, hw)
        assert summary["completed"] + summary["rejected"] == summary["num_requests"], (model, hw)
        assert summary["completed"] > 0.9 * summary["num_requests"], (model, hw)


@pytest.mark.parametrize("args, model", [
    (["model=llama3_1_70b", "parallel.tensor_parallel_size=4"], "llama3.1-70b"),
    (["model=mixtral_8x7b", "parallel.tensor_parallel_size=2"], "mixtral-8x7b"),
])
def test_main_command_style(tmp_path, args, model):
    from test_cli import run_cli

    proc = run_cli(args + ["trace.max_requests=300", f"output.dir={tmp_path}/run"], cwd=tmp_path)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["model"] == model and summary["completed"] == 300
    assert f"({model}, h100-sxm, kernels)" in proc.stdout
    assert f"validated configuration: {model} on h100-sxm, TP {args[1][-1]}, cost_model=kernels" in proc.stdout


def test_engine_and_vllm_backends_refuse_several_gpus():
    from testbed.app.assembly.validate import ConfigError, check_config

    for backend in ("engine", "vllm"):
        with pytest.raises(ConfigError, match=f"parallel.tensor_parallel_size=2: backend={backend}"):
            check_config(config(f"backend={backend}", "parallel.tensor_parallel_size=2"))
    check_config(config("parallel.tensor_parallel_size=2"))  # the simulator takes it
