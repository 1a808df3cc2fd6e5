"""Model and hardware descriptions, the inputs every cost model is built from.

They are plain dataclasses so that Hydra can type-check them (`conf/model/*.yaml`,
`conf/hardware/*.yaml`) and so that the engine can fill a `ModelSpec` from a real
transformers config: the simulator and the engine then agree on shapes and KV size.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from testbed.core.bounds import bounded, check_ranges

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8": 1}


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
    # ones above (testbed.core.specs.resolve_model_spec)
    config_json: Optional[str] = None

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
    def layer_params(self) -> int:
        """Weights of one transformer layer (attention projections, SwiGLU MLP, two norms)."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return h * q + 2 * h * kv + q * h + 3 * h * self.intermediate_size + 2 * h

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def num_params(self) -> int:
        lm_head = 0 if self.tie_word_embeddings else self.embedding_params
        return self.num_layers * self.layer_params + self.embedding_params + lm_head + self.hidden_size

    @property
    def weight_bytes(self) -> int:
        return self.num_params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every layer for one token."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @classmethod
    def from_hf_config(cls, path: str | Path, name: str | None = None, dtype: str = "bfloat16") -> "ModelSpec":
        """Read the shapes from a transformers `config.json` (file or checkpoint folder)."""
        p = Path(path)
        cfg = json.loads((p / "config.json" if p.is_dir() else p).read_text())
        heads = cfg["num_attention_heads"]
        return cls(
            name=name or cfg.get("_name_or_path") or p.name,
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads", heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            vocab_size=cfg["vocab_size"],
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            max_model_len=cfg.get("max_position_embeddings", 2048),
            dtype=dtype,
        )


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

    def validate(self) -> None:
        check_ranges(self, "hardware")


def kv_capacity_blocks(model: ModelSpec, hw: HardwareSpec, block_size: int,
                       memory_utilization: float, activation_reserve_bytes: float = 0.0) -> int:
    """Blocks that fit in the memory left after the weights, as vLLM sizes its cache."""
    if not 0 < memory_utilization <= 1:
        raise ValueError(f"kv.memory_utilization={memory_utilization}: must be in (0, 1]")
    free = hw.memory_bytes * memory_utilization - model.weight_bytes - activation_reserve_bytes
    blocks = int(free // (block_size * model.kv_bytes_per_token))
    if blocks < 1:
        need = model.weight_bytes + activation_reserve_bytes + block_size * model.kv_bytes_per_token
        raise ValueError(
            f"model {model.name} does not fit on {hw.name}: weights {model.weight_bytes / 1e9:.2f} GB plus one "
            f"KV block need {need / 1e9:.2f} GB, {hw.memory_bytes * memory_utilization / 1e9:.2f} GB usable "
            f"(memory_bytes x kv.memory_utilization)")
    return blocks
