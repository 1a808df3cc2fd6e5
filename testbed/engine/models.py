"""Build the model the engine serves: a local checkpoint, or a shipped shape with random weights.

Scheduling research needs the right *shapes* (layers, heads, KV size, vocab) far more
than trained weights: step time does not depend on what the weights are. So every
preset here builds from a config alone, seeded, with no download; a checkpoint folder
on disk is used when one is given: its safetensors weights only (a pickle can run code
when unpickled), never its remote code, never a download. The presets' `_name_or_path` equals the `ModelSpec`
name of the matching `conf/model/*.yaml`, so `model_spec_of` ties engine and simulator
to the same shapes.
"""
from __future__ import annotations

import copy
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from testbed.core.specs import DTYPE_BYTES, ModelSpec

_LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

# Keyword arguments of `AutoConfig.for_model(model_type, ...)`, keyed like conf/model/*.yaml.
PRESETS: dict[str, dict] = {
    # Meta-Llama-3-8B config.json
    "llama3_8b": dict(
        model_type="llama", _name_or_path="llama3-8b", hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        vocab_size=128256, max_position_embeddings=8192, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, tie_word_embeddings=False,
        bos_token_id=128000, eos_token_id=128001),
    # Meta-Llama-3.1-8B: the 8B shapes with the 128k llama3 RoPE scaling
    "llama3_1_8b": dict(
        model_type="llama", _name_or_path="llama3.1-8b", hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        vocab_size=128256, max_position_embeddings=131072, rms_norm_eps=1e-5,
        rope_parameters={**_LLAMA3_ROPE, "factor": 8.0}, tie_word_embeddings=False,
        bos_token_id=128000, eos_token_id=128001),
    # Meta-Llama-3.2-1B config.json
    "llama3_2_1b": dict(
        model_type="llama", _name_or_path="llama3.2-1b", hidden_size=2048, intermediate_size=8192,
        num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
        vocab_size=128256, max_position_embeddings=131072, rms_norm_eps=1e-5,
        rope_parameters={**_LLAMA3_ROPE, "factor": 32.0}, tie_word_embeddings=True,
        bos_token_id=128000, eos_token_id=128001),
    # A few hundred kB of weights: CPU tests of the engine's correctness.
    # No EOS, so greedy generation always runs to max_new_tokens.
    "tiny_llama": dict(
        model_type="llama", _name_or_path="tiny-llama", hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
        max_position_embeddings=2048, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
        pad_token_id=None),
    # Qwen2 family: biased q/k/v projections, tied embeddings.
    "tiny_qwen2": dict(
        model_type="qwen2", _name_or_path="tiny-qwen2", hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
        max_position_embeddings=2048, tie_word_embeddings=True, bos_token_id=None, eos_token_id=None,
        pad_token_id=None),
    # Mistral family with a short sliding window, so tests reach past it.
    "tiny_mistral": dict(
        model_type="mistral", _name_or_path="tiny-mistral", hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, head_dim=16, vocab_size=512,
        max_position_embeddings=2048, sliding_window=12, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=None, pad_token_id=None),
}


def make_config(name: str, **overrides) -> PretrainedConfig:
    """The transformers config of a preset (`PRESETS`), with keyword overrides."""
    try:
        kw = copy.deepcopy(PRESETS[name])
    except KeyError:
        raise ValueError(f"model preset {name!r}: expected one of {sorted(PRESETS)} or a checkpoint folder") from None
    kw.update(overrides)
    return AutoConfig.for_model(kw.pop("model_type"), **kw)


def _torch_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[dtype]
    except KeyError:
        raise ValueError(f"model dtype {dtype!r}: expected bfloat16, float16 or float32") from None


_FAMILIES = ("llama", "qwen2", "mistral")


def config_of_spec(spec: ModelSpec) -> PretrainedConfig:
    """A transformers config with a `ModelSpec`'s shapes (conf/model/*.yaml), for random weights.

    Only shapes and `rope_theta` come from the spec; RoPE scaling variants (Llama 3.1/3.2)
    do not change a step's cost, so they are left out. No EOS: generation never stops early.
    """
    if spec.family not in _FAMILIES:
        raise ValueError(f"model.family={spec.family!r}: expected one of {_FAMILIES}")
    return AutoConfig.for_model(
        spec.family, _name_or_path=spec.name, hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size, num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads, head_dim=spec.head_dim,
        vocab_size=spec.vocab_size, max_position_embeddings=spec.max_model_len,
        tie_word_embeddings=spec.tie_word_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": float(spec.rope_theta)},
        bos_token_id=None, eos_token_id=None, pad_token_id=None)


def build_model(source: str | Path | PretrainedConfig | ModelSpec, dtype: str | torch.dtype | None = None,
                device: str | torch.device = "cpu", seed: int = 0,
                attn_implementation: str | None = None) -> PreTrainedModel:
    """A causal LM in eval mode from a checkpoint folder, a preset name, a config or a `ModelSpec`.

    A folder holding config.json (or a spec whose `checkpoint` names one, with
    `random_weights=false`) is loaded with `from_pretrained`: local safetensors files only, no
    remote code, never a download. A spec with a checkpoint and `random_weights=true` takes the
    checkpoint's config.json (architecture and shapes) with random weights. Anything else is built from its
    config with random weights drawn after `torch.manual_seed(seed)`, directly on `device`
    (an 8B model never passes through host memory). `dtype` defaults to the spec's, else
    bfloat16. `attn_implementation=None` keeps transformers' default (sdpa); the runner
    switches the model to paged attention itself.
    """
    if isinstance(source, ModelSpec):
        dtype = dtype or source.dtype
        if source.checkpoint and not source.random_weights:
            source = source.checkpoint
        elif source.checkpoint:  # the checkpoint's own architecture and shapes, random weights
            source = AutoConfig.from_pretrained(checkpoint_folder(source.checkpoint), local_files_only=True,
                                                trust_remote_code=False)
        elif not source.random_weights:
            raise ValueError(f"model {source.name}: random_weights=false needs model.checkpoint (a local folder)")
        else:
            source = config_of_spec(source)
    dtype = _torch_dtype(dtype or torch.bfloat16)
    extra = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    if isinstance(source, (str, Path)) and (Path(source) / "config.json").is_file():
        model = AutoModelForCausalLM.from_pretrained(safetensors_folder(source), local_files_only=True,
                                                     use_safetensors=True, trust_remote_code=False, dtype=dtype,
                                                     **extra)
        model.to(device)
    elif isinstance(source, (str, Path)) and source not in PRESETS:
        raise ValueError(f"model {str(source)!r}: neither a checkpoint folder with config.json "
                         f"nor a preset ({sorted(PRESETS)})")
    else:
        config = source if isinstance(source, PretrainedConfig) else make_config(str(source))
        torch.manual_seed(seed)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, **extra)
    return model.eval()


def checkpoint_folder(path: str | Path) -> Path:
    """`model.checkpoint`, checked to be a folder holding a transformers config.json."""
    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise ValueError(f"model.checkpoint={path}: no config.json there (a local checkpoint folder is expected; "
                         f"nothing is ever downloaded)")
    return folder


PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")


def safetensors_folder(path: str | Path) -> Path:
    """A checkpoint folder whose weights are safetensors files: a folder holding only pickled
    weights (pytorch_model.bin, ...) is refused, since unpickling can run arbitrary code."""
    folder = checkpoint_folder(path)
    if not any(folder.glob("*.safetensors")):
        pickles = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES)
        raise ValueError(f"model.checkpoint={path}: no safetensors weights there"
                         + (f", only pickled ones ({', '.join(pickles)}), which are never loaded since unpickling "
                            f"can run code: convert them to safetensors (save_pretrained(..., "
                            f"safe_serialization=True))" if pickles else "")
                         + "; or set model.random_weights=true for its shapes with random weights")
    return folder


def model_spec_of(hf_config: PretrainedConfig, name: str | None = None, dtype: str | None = None) -> ModelSpec:
    """The `ModelSpec` of an in-memory transformers config, mapped as `ModelSpec.from_hf_config`
    maps a config.json (the same keys, read from `to_dict()`), plus the engine's fields
    (family, rope_theta, checkpoint). `dtype` defaults to the config's own when the cost
    model knows it, else bfloat16."""
    cfg = hf_config.to_dict()
    heads = cfg["num_attention_heads"]
    src = str(cfg.get("_name_or_path") or "")
    ckpt = src if src and (Path(src) / "config.json").is_file() else None  # loaded from a local checkpoint
    if dtype is None:
        d = str(cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16").removeprefix("torch.")
        dtype = d if d in DTYPE_BYTES else "bfloat16"
    return ModelSpec(
        name=name or (Path(src).name if ckpt else src) or cfg.get("model_type", "model"),
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        vocab_size=cfg["vocab_size"],
        tie_word_embeddings=cfg.get("tie_word_embeddings", False),
        max_model_len=cfg.get("max_position_embeddings", 2048),
        dtype=dtype,
        family=cfg.get("model_type", "llama"),
        rope_theta=float((cfg.get("rope_parameters") or {}).get("rope_theta") or cfg.get("rope_theta") or 10000.0),
        checkpoint=ckpt,
        random_weights=ckpt is None,
    )
