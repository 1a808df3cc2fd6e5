"""Model and hardware descriptions, the inputs every cost model is built from.

They are plain dataclasses so that Hydra can type-check them (`conf/model/*.yaml`,
`conf/hardware/*.yaml`) and so that the engine can fill a `ModelSpec` from a real
transformers config: the simulator and the engine then agree on shapes and KV size.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

from testbed.core.bounds import bounded, check_ranges
from testbed.core.sampling import generation_defaults

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8": 1}

# model.weight_dtype: the linear layers' weight format (vLLM quantises its LinearBase layers and the MoE
# experts; embeddings, LM head, norms and the MoE router stay at model.dtype: get_quant_method in
# vllm/model_executor/layers/quantization/fp8.py returns no method for them), and its bytes per weight
# as (numerator, denominator). fp8: vLLM's --quantization fp8, one fp32 scale per tensor (or channel), not
# counted. int4: AWQ (vllm/model_executor/layers/quantization/auto_awq.py: 4-bit qweight, per group of 128
# input rows one params_dtype (fp16) scale and one packed 4-bit zero per output column), so
# 0.5 + 2.5 / 128 = 133/256 byte per weight; GPTQ's act-order g_idx (4 bytes per input row) is left out.
WEIGHT_DTYPES = {"bfloat16": (2, 1), "float16": (2, 1), "fp8": (1, 1), "int4": (133, 256)}
WEIGHT_DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16"}
# kv.cache_dtype (vLLM's --kv-cache-dtype, CacheDType in vllm/config/cache.py: "auto" is the model's
# dtype, fp8 = fp8_e4m3, fp8_e5m2 one byte too)
KV_CACHE_DTYPES = {"bfloat16": 2, "float16": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}
KV_CACHE_DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16"}


def _dtype_name(key: str, value: Optional[str], model_dtype: str, known: dict, aliases: dict, hint: str) -> str:
    """The canonical name of a dtype key's value (null or "auto": the model's dtype), or an error naming the key."""
    if value is None or value == "auto":
        return model_dtype
    name = aliases.get(value, value)
    if name not in known:
        raise ValueError(f"{key}={value!r}: expected {'null, ' if key.startswith('model') else ''}auto or one of "
                         f"{sorted(known) + sorted(aliases)} ({hint})")
    return name


def weight_dtype_name(value: Optional[str], model_dtype: str) -> str:
    """The canonical weight format of `model.weight_dtype` (null or "auto": the model's dtype)."""
    return _dtype_name("model.weight_dtype", value, model_dtype, WEIGHT_DTYPES, WEIGHT_DTYPE_ALIASES,
                       "fp8: vLLM's --quantization fp8; int4: AWQ/GPTQ weight-only, group 128")


def kv_cache_dtype_name(value: Optional[str], model_dtype: str) -> str:
    """The canonical KV-cache dtype of `kv.cache_dtype` ("auto": the model's dtype)."""
    return _dtype_name("kv.cache_dtype", value, model_dtype, KV_CACHE_DTYPES, KV_CACHE_DTYPE_ALIASES,
                       "vLLM's --kv-cache-dtype")


@dataclass
class ModelSpec:
    name: str = "llama3-8b"
    hidden_size: int = bounded(4096, ge=1)
    intermediate_size: int = bounded(14336, ge=1)
    num_layers: int = bounded(32, ge=1)
    num_heads: int = bounded(32, ge=1)
    num_kv_heads: int = bounded(8, ge=1)
    head_dim: int = bounded(128, ge=1)
    vocab_size: int = bounded(128256, ge=1)
    tie_word_embeddings: bool = False
    max_model_len: int = bounded(8192, ge=1)
    dtype: str = "bfloat16"
    # for the engine: which transformers architecture the shapes belong to, and where weights come from
    family: str = "llama"  # llama, qwen2 or mistral
    rope_theta: float = bounded(500000.0, gt=0)
    checkpoint: Optional[str] = None  # a local checkpoint folder; nothing is ever downloaded
    # true: random weights (timings depend on shapes only), with these shapes, or the checkpoint's
    # config.json when one is given; false: the checkpoint's safetensors weights
    random_weights: bool = True
    # mixture of experts (0 experts: a dense model). Every layer's MLP is then `num_experts` experts of
    # `moe_intermediate_size` (null: intermediate_size), `num_experts_per_tok` routed per token, plus a
    # shared expert of `shared_expert_intermediate_size` (0: none) that every token runs (Qwen2-MoE, Llama-4)
    num_experts: int = bounded(0, ge=0)
    num_experts_per_tok: int = bounded(0, ge=0)
    moe_intermediate_size: Optional[int] = bounded(None, ge=1)
    shared_expert_intermediate_size: int = bounded(0, ge=0)
    # a local Hugging Face config.json (file or folder; nothing is downloaded): its shapes replace the
    # ones above (testbed.core.specs.apply_config_json, via testbed.app.assembly.run_setup.resolve_model_spec)
    config_json: Optional[str] = None
    # the linear layers' (and MoE experts') weight format, vLLM's --quantization: null or auto (`dtype`),
    # bfloat16 (bf16), float16, fp8 (W8A8 on GPUs with fp8 tensor cores, else weight-only Marlin), int4
    # (AWQ/GPTQ weight-only, group 128 with fp16 scales). Embeddings, LM head, norms and router stay at `dtype`
    weight_dtype: Optional[str] = None
    # the KV cache's dtype: set kv.cache_dtype, which conf/config.yaml copies here (auto: `dtype`)
    kv_cache_dtype: Optional[str] = "auto"
    # the checkpoint's Hugging Face id (e.g. meta-llama/Llama-3.1-8B-Instruct): names whose generation defaults
    # testbed.core.generation_configs knows, when no generation_config.json is at hand
    hf_id: Optional[str] = None
    # the sampling defaults of the checkpoint's generation_config.json that vLLM applies to requests setting
    # none (testbed.core.sampling): repetition_penalty, temperature, top_k, top_p, min_p. null: looked up (a
    # generation_config.json beside model.config_json, else the known checkpoint named by hf_id or name);
    # {}: the file sets none
    generation_config: Optional[dict[str, float]] = None

    def __post_init__(self) -> None:
        weight_dtype_name(self.weight_dtype, self.dtype)  # a bad value fails here, naming its key
        kv_cache_dtype_name(self.kv_cache_dtype, self.dtype)
        if self.num_experts and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"model.num_experts_per_tok={self.num_experts_per_tok}: a model with "
                             f"num_experts={self.num_experts} routes each token to 1 to {self.num_experts} experts")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def dtype_bytes(self) -> int:
        try:
            return DTYPE_BYTES[self.dtype]
        except KeyError:
            raise ValueError(f"model.dtype={self.dtype!r}: expected one of {sorted(DTYPE_BYTES)}") from None

    @property
    def weight_format(self) -> str:
        """The linear layers' weight format: `weight_dtype` resolved (bfloat16, float16, fp8, int4, ...)."""
        return weight_dtype_name(self.weight_dtype, self.dtype)

    @property
    def kv_cache_format(self) -> str:
        """The KV cache's dtype: kv.cache_dtype resolved (auto: the model's dtype)."""
        return kv_cache_dtype_name(self.kv_cache_dtype, self.dtype)

    @property
    def kv_dtype_bytes(self) -> int:
        """Bytes of one K or V element in the cache."""
        return KV_CACHE_DTYPES.get(self.kv_cache_format) or self.dtype_bytes

    def linear_weight_bytes(self, params: int) -> int:
        """Bytes of `params` weights of the linear layers at `weight_format` (int4: with its group scales)."""
        num, den = WEIGHT_DTYPES.get(self.weight_format) or (self.dtype_bytes, 1)
        return -(-params * num // den)

    @property
    def layer_unquantised_params(self) -> int:
        """One layer's weights that quantisation leaves at `dtype`: the two norms, and the MoE router
        (vLLM builds the gate as a ReplicatedLinear with quant_config=None, e.g. models/mixtral.py)."""
        return 2 * self.hidden_size + (self.router_params if self.is_moe else 0)

    # --- parameters, whole model (one GPU) -------------------------------------------------------

    @property
    def attention_params(self) -> int:
        """One layer's q, k, v and o projections."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return h * q + 2 * h * kv + q * h

    @property
    def expert_params(self) -> int:
        """One routed expert's SwiGLU MLP (gate, up, down)."""
        return 3 * self.hidden_size * (self.moe_intermediate_size or self.intermediate_size)

    @property
    def shared_expert_params(self) -> int:
        return 3 * self.hidden_size * self.shared_expert_intermediate_size

    @property
    def router_params(self) -> int:
        return self.hidden_size * self.num_experts

    @property
    def mlp_params(self) -> int:
        """One layer's MLP: the dense SwiGLU, or every expert plus the shared one and the router."""
        if not self.is_moe:
            return 3 * self.hidden_size * self.intermediate_size
        return self.num_experts * self.expert_params + self.shared_expert_params + self.router_params

    @property
    def layer_params(self) -> int:
        """Weights of one transformer layer (attention projections, MLP or all experts, two norms)."""
        return self.attention_params + self.mlp_params + 2 * self.hidden_size

    @property
    def active_layer_params(self) -> int:
        """The weights of one layer that one token runs through: a MoE token uses its top-k experts,
        the shared expert and the router; a dense token uses the whole layer."""
        if not self.is_moe:
            return self.layer_params
        return (self.attention_params + self.num_experts_per_tok * self.expert_params + self.shared_expert_params
                + self.router_params + 2 * self.hidden_size)

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def num_params(self) -> int:
        lm_head = 0 if self.tie_word_embeddings else self.embedding_params
        return self.num_layers * self.layer_params + self.embedding_params + lm_head + self.hidden_size

    @property
    def num_active_params(self) -> int:
        """Parameters one token uses (MoE: the "active" size, as 12.9B of Mixtral-8x7B's 46.7B)."""
        return self.num_params - self.num_layers * (self.layer_params - self.active_layer_params)

    @property
    def weight_bytes(self) -> int:
        """Every weight: the linear layers at `weight_format`, the rest at `dtype`."""
        linear = self.num_layers * (self.layer_params - self.layer_unquantised_params)
        return self.linear_weight_bytes(linear) + (self.num_params - linear) * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every layer for one token (at the KV-cache dtype)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.kv_dtype_bytes

    # --- one GPU's share under tensor / pipeline parallelism --------------------------------------

    def check_parallel(self, parallel: "ParallelSpec") -> None:
        """The splits vLLM accepts: heads divisible by TP (vllm/config/model.py
        verify_with_parallel_config), KV heads divisible by TP or TP by KV heads (replicated, vllm
        model_executor/layers/linear.py QKVParallelLinear), at least one layer per pipeline stage."""
        tp, pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
        kv = self.num_kv_heads
        if self.num_heads % tp:
            raise ValueError(f"parallel.tensor_parallel_size={tp}: must divide model {self.name}'s "
                             f"{self.num_heads} attention heads")
        if (kv % tp if kv >= tp else tp % kv):
            raise ValueError(f"parallel.tensor_parallel_size={tp}: must divide model {self.name}'s {kv} KV heads, "
                             f"or be a multiple of them (the KV heads are then replicated)")
        if pp > self.num_layers:
            raise ValueError(f"parallel.pipeline_parallel_size={pp}: more stages than model {self.name}'s "
                             f"{self.num_layers} layers")

    def kv_heads_per_gpu(self, tensor_parallel_size: int) -> int:
        """KV heads split over TP, one replicated per GPU when there are fewer heads than GPUs
        (vllm/config/model.py ModelConfig.get_num_kv_heads: max(1, total // tp))."""
        return max(1, self.num_kv_heads // tensor_parallel_size)

    def stage_layers(self, pipeline_parallel_size: int) -> list[int]:
        """Layers per pipeline stage, as vllm/distributed/utils.py get_pp_indices splits them: evenly, the
        remainder one each to the stages before the last (which holds the final norm and LM head)."""
        pp = pipeline_parallel_size
        layers = [self.num_layers // pp] * pp
        for i in range(2, self.num_layers % pp + 2):
            layers[-i] += 1
        return layers

    def layer_params_per_gpu(self, tensor_parallel_size: int, active: bool = False) -> int:
        """One layer's weights on one GPU: heads and MLP columns (each expert's too: vLLM's FusedMoE
        splits every expert's intermediate size over TP) divided by TP, KV projections per
        `kv_heads_per_gpu`, the router and the norms replicated. `active`: what one token uses."""
        tp, h = tensor_parallel_size, self.hidden_size
        q = self.num_heads * self.head_dim // tp
        kv = self.kv_heads_per_gpu(tp) * self.head_dim
        attention = h * q + 2 * h * kv + q * h
        if not self.is_moe:
            mlp = 3 * h * _ceil_div(self.intermediate_size, tp)
        else:
            experts = self.num_experts_per_tok if active else self.num_experts
            mlp = (experts * self.expert_params_per_gpu(tp)
                   + 3 * h * _ceil_div(self.shared_expert_intermediate_size, tp) + self.router_params)
        return attention + mlp + 2 * h

    def expert_params_per_gpu(self, tensor_parallel_size: int) -> int:
        return 3 * self.hidden_size * _ceil_div(self.moe_intermediate_size or self.intermediate_size,
                                                 tensor_parallel_size)

    def embedding_params_per_gpu(self, tensor_parallel_size: int) -> int:
        """The embedding (or LM head) on one GPU: vocabulary-parallel, split over TP (vLLM's
        VocabParallelEmbedding / ParallelLMHead)."""
        return _ceil_div(self.vocab_size, tensor_parallel_size) * self.hidden_size

    def stage_params_per_gpu(self, parallel: "ParallelSpec") -> list[int]:
        """Weights on one GPU of each pipeline stage: its layers, the embedding on the first stage,
        the final norm and LM head on the last (a tied LM head is the embedding itself, a second
        copy only when it sits on another stage)."""
        tp, pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
        layer, emb = self.layer_params_per_gpu(tp), self.embedding_params_per_gpu(tp)
        stages = []
        for i, n in enumerate(self.stage_layers(pp)):
            params = n * layer
            if i == 0:
                params += emb
            if i == pp - 1:
                params += self.hidden_size + (emb if not self.tie_word_embeddings or pp > 1 else 0)
            stages.append(params)
        return stages

    def stage_weight_bytes_per_gpu(self, parallel: "ParallelSpec") -> list[int]:
        """Weight bytes on one GPU of each pipeline stage: its layers' linear weights at `weight_format`,
        the rest (norms, router, embedding, LM head) at `dtype`."""
        linear_per_layer = self.layer_params_per_gpu(parallel.tensor_parallel_size) - self.layer_unquantised_params
        return [self.linear_weight_bytes(n * linear_per_layer) + (params - n * linear_per_layer) * self.dtype_bytes
                for params, n in zip(self.stage_params_per_gpu(parallel),
                                     self.stage_layers(parallel.pipeline_parallel_size))]

    def weight_bytes_per_gpu(self, parallel: "ParallelSpec") -> int:
        """The weights on the most loaded GPU of one replica (TP=PP=1: `weight_bytes`)."""
        return max(self.stage_weight_bytes_per_gpu(parallel))

    def stage_kv_bytes_per_token(self, parallel: "ParallelSpec") -> list[int]:
        """K and V of one token on one GPU of each pipeline stage: its layers, its share of the KV heads."""
        per_layer = 2 * self.kv_heads_per_gpu(parallel.tensor_parallel_size) * self.head_dim * self.kv_dtype_bytes
        return [n * per_layer for n in self.stage_layers(parallel.pipeline_parallel_size)]

    def kv_bytes_per_token_per_gpu(self, parallel: "ParallelSpec") -> int:
        """K and V of one token on the GPU that holds the most (TP=PP=1: `kv_bytes_per_token`)."""
        return max(self.stage_kv_bytes_per_token(parallel))

    @classmethod
    def from_hf_config(cls, path: str | Path, name: str | None = None, dtype: str | None = None) -> "ModelSpec":
        """Read the shapes from a transformers `config.json` (file or checkpoint folder), MoE included:
        Mixtral's `num_local_experts`; Qwen2/3-MoE's `num_experts`, `moe_intermediate_size`,
        `shared_expert_intermediate_size`; Llama-4's `text_config` nesting (its experts and shared
        expert have `intermediate_size`, its dense layers `intermediate_size_mlp`). `dtype`: the
        file's `torch_dtype` (or `dtype`) when None. A missing required key names the file and key."""
        p = Path(path)
        file = p / "config.json" if p.is_dir() else p
        try:
            top = json.loads(file.read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"model.config_json={path}: cannot read a config.json there ({e})") from None
        cfg = top.get("text_config") or top  # multimodal checkpoints (Llama-4) nest the language model

        def need(key: str):
            if key not in cfg:
                raise ValueError(f"model.config_json: {file} has no {key!r}"
                                 + (" (under text_config)" if cfg is not top else ""))
            return cfg[key]

        heads = need("num_attention_heads")
        experts = cfg.get("num_local_experts") or cfg.get("num_experts") or 0
        moe_inter = cfg.get("moe_intermediate_size") if experts else None
        shared = cfg.get("shared_expert_intermediate_size") or 0
        if experts and (str(cfg.get("model_type", "")).startswith("llama4") or "intermediate_size_mlp" in cfg):
            # Llama-4: every MoE layer also runs one shared expert of intermediate_size
            shared = need("intermediate_size")
        if dtype is None:
            d = str(cfg.get("torch_dtype") or cfg.get("dtype") or top.get("torch_dtype") or "bfloat16")
            dtype = d.removeprefix("torch.") if d.removeprefix("torch.") in DTYPE_BYTES else "bfloat16"
        tie = cfg.get("tie_word_embeddings", top.get("tie_word_embeddings", False))
        quant = top.get("quantization_config") or cfg.get("quantization_config") or {}
        rope = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta")
        hf_id = cfg.get("_name_or_path") or top.get("_name_or_path") or None
        return cls(
            name=name or cfg.get("_name_or_path") or top.get("_name_or_path") or file.parent.name,
            hidden_size=need("hidden_size"),
            intermediate_size=need("intermediate_size"),
            num_layers=need("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or need("hidden_size") // heads,
            vocab_size=need("vocab_size"),
            tie_word_embeddings=bool(tie),
            max_model_len=cfg.get("max_position_embeddings", 2048),
            dtype=dtype,
            family=top.get("model_type") or cfg.get("model_type", "llama"),
            rope_theta=float(rope or 10000.0),
            num_experts=experts,
            num_experts_per_tok=cfg.get("num_experts_per_tok", 0) if experts else 0,
            moe_intermediate_size=moe_inter,
            shared_expert_intermediate_size=shared,
            weight_dtype=_checkpoint_weight_dtype(quant),
            hf_id=hf_id,
            generation_config=_generation_file(file.parent / "generation_config.json"),
        )


def _generation_file(path: Path) -> Optional[dict]:
    """The sampling defaults vLLM takes from a checkpoint's generation_config.json (None: no such file)."""
    if not path.is_file():
        return None
    try:
        return generation_defaults(json.loads(path.read_text()))
    except ValueError as e:
        raise ValueError(f"model.config_json: {path} is not valid JSON ({e})") from None


def _checkpoint_weight_dtype(quant: dict) -> Optional[str]:
    """A quantised checkpoint's weight format from its config.json `quantization_config`, as vLLM
    reads `quant_method` (awq / gptq 4-bit: int4; fp8: fp8); None for anything else."""
    method = str(quant.get("quant_method", "")).lower()
    if method in ("awq", "gptq") and quant.get("bits", quant.get("w_bit")) == 4:
        return "int4"
    return "fp8" if method == "fp8" else None


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def apply_config_json(spec: ModelSpec, keep_name: bool = False) -> ModelSpec:
    """`spec` itself, or, when its `config_json` is set, the shapes of that Hugging Face config.json
    (file or folder, nothing downloaded), named after the file (`_name_or_path`, else its folder)
    unless `keep_name`; the engine fields (checkpoint, random_weights) and the dtypes are kept (the
    weight dtype: the config's, else the checkpoint's `quantization_config`)."""
    if not spec.config_json:
        return spec
    read = ModelSpec.from_hf_config(spec.config_json, name=spec.name if keep_name else None)
    return replace(read, config_json=spec.config_json, checkpoint=spec.checkpoint,
                   random_weights=spec.random_weights, weight_dtype=spec.weight_dtype or read.weight_dtype,
                   kv_cache_dtype=spec.kv_cache_dtype, hf_id=spec.hf_id or read.hf_id,
                   generation_config=spec.generation_config if spec.generation_config is not None
                   else read.generation_config)


@dataclass
class ParallelSpec:
    """How one replica spreads over GPUs, as vLLM's `--tensor-parallel-size` / `--pipeline-parallel-size`:
    tensor parallelism splits every layer's heads and MLP columns across `tensor_parallel_size` GPUs
    (an all-reduce after attention and after the MLP); pipeline parallelism gives each of
    `pipeline_parallel_size` GPU groups a contiguous slice of the layers."""

    tensor_parallel_size: int = bounded(1, ge=1)
    pipeline_parallel_size: int = bounded(1, ge=1)

    @property
    def num_gpus(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def validate(self) -> None:
        check_ranges(self, "parallel")


@dataclass
class HardwareSpec:
    """Achievable (not datasheet) rates, with efficiency factors for real kernels.

    The shipped H100 figures are the ones measured on an H100 for this project
    (device-to-device copy and a large bf16 matmul), so the efficiency factors only
    have to cover what separates a real model's kernels from those best cases.
    """

    name: str = "h100-sxm"
    matmul_flops: float = bounded(769e12, gt=0)  # bf16 FLOP/s, large matmul, measured
    # fp8 tensor-core FLOP/s on the same footing as matmul_flops (the presets: the datasheet's dense fp8 figure
    # x the measured/datasheet ratio of bf16); null: no fp8 tensor cores (A100), so fp8 weights are weight-only
    # there (vLLM's MarlinFP8ScaledMMLinearKernel, vllm/model_executor/kernels/linear/scaled_mm/marlin.py) and
    # their GEMMs run at the bf16 rate
    fp8_flops: Optional[float] = bounded(None, gt=0)
    mem_bandwidth: float = bounded(2.98e12, gt=0)  # bytes/s, device copy, measured
    memory_bytes: float = bounded(80e9, gt=0)
    compute_efficiency: float = bounded(0.72, gt=0, le=1)
    memory_efficiency: float = bounded(0.88, gt=0, le=1)
    attention_efficiency: float = bounded(0.5, gt=0, le=1)
    step_overhead_s: float = bounded(0.0009, ge=0)  # launch, sampling, host bookkeeping per step (CUDA graphs on)
    host_link_bandwidth: float = bounded(25e9, gt=0)  # bytes/s device<->host for swap
    # GPU-to-GPU link (NVLink, or PCIe on cards without it): bytes/s one direction per GPU, and latency per
    # transfer; tensor-parallel all-reduces and pipeline-stage hand-offs use it
    interconnect_bandwidth: float = bounded(450e9, gt=0)
    interconnect_latency_s: float = bounded(10e-6, ge=0)
    # the GPU's name in the measured kernel database (cost_model=kernels; aiconfigurator-core's systems/data/<name>)
    kernel_db_gpu: Optional[str] = None

    # the KV-cache read's share of mem_bandwidth (null: memory_efficiency, as for the weights): paged
    # attention's scattered block reads reach less of the bandwidth than streaming the weights does
    kv_read_efficiency: Optional[float] = bounded(None, gt=0, le=1)
    # host and launch work per decode sequence per step (input preparation, sampling, detokenisation)
    decode_seq_overhead_s: float = bounded(0.0, ge=0)

    def validate(self) -> None:
        check_ranges(self, "hardware")


def kv_capacity_blocks(model: ModelSpec, hw: HardwareSpec, block_size: int, memory_utilization: float,
                       activation_reserve_bytes: float = 0.0, parallel: ParallelSpec | None = None) -> int:
    """Blocks that fit in the memory left after the weights, as vLLM sizes its cache: per GPU,
    memory x utilization - that GPU's weights - the activation reserve, over that GPU's share of a
    block; a replica holds what its tightest GPU holds (vllm/v1/core/kv_cache_utils.py
    get_kv_cache_configs takes the minimum num_blocks over the workers)."""
    if not 0 < memory_utilization <= 1:
        raise ValueError(f"kv.memory_utilization={memory_utilization}: must be in (0, 1]")
    parallel = parallel or ParallelSpec()
    model.check_parallel(parallel)
    per_gpu = zip(model.stage_weight_bytes_per_gpu(parallel), model.stage_kv_bytes_per_token(parallel))
    blocks, tightest = None, None
    for weights, kv_per_token in per_gpu:
        free = hw.memory_bytes * memory_utilization - weights - activation_reserve_bytes
        n = int(free // (block_size * kv_per_token))
        if blocks is None or n < blocks:
            blocks, tightest = n, (weights, kv_per_token)
    if blocks < 1:
        weights, kv_per_token = tightest
        need = weights + activation_reserve_bytes + block_size * kv_per_token
        gpus = "" if parallel.num_gpus == 1 else f" (per GPU, {parallel.num_gpus} GPUs)"
        raise ValueError(
            f"model {model.name} does not fit on {hw.name}{gpus}: weights {weights / 1e9:.2f} GB plus one "
            f"KV block need {need / 1e9:.2f} GB, {hw.memory_bytes * memory_utilization / 1e9:.2f} GB usable "
            f"(memory_bytes x kv.memory_utilization); spread it over more GPUs with "
            f"parallel.tensor_parallel_size (now {parallel.tensor_parallel_size}) or "
            f"parallel.pipeline_parallel_size (now {parallel.pipeline_parallel_size})")
    return blocks
