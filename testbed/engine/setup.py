"""From a config to a ready engine: device, model, KV cache, runner; fail early if it cannot fit.

A model or KV cache that does not fit is refused before anything is allocated with a
message saying how much was needed and how much was free, rather than dying mid-replay
in an out-of-memory error.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace

import torch
from omegaconf import DictConfig

from testbed.engine.kv_cache import PagedKVCache
from testbed.engine.models import build_model, checkpoint_folder, model_spec_of
from testbed.engine.prompts import PromptTokens
from testbed.engine.replay import EngineReplay
from testbed.engine.runner import ModelRunner
from testbed.core.loop import StepLoop
from testbed.core.specs import DTYPE_BYTES, ModelSpec

GB = 1e9
log = logging.getLogger("testbed.engine")


class DoesNotFit(MemoryError):
    pass


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"backend.device={name!r}, but torch sees no CUDA device (torch {torch.__version__})")
    return dev


CPU_THREADS_CAP = 1  # backend.threads=null on a CPU: at most this many (measured: README "The real engine")


def cpu_threads(setting: int | None, device: torch.device) -> int | None:
    """torch's thread count for a replay on `device`: `backend.threads` when set; on a CPU with none set,
    OMP_NUM_THREADS when the user set it, else at most CPU_THREADS_CAP of the cores this process may use.
    None: leave torch as it is (a GPU, whose kernels do not use them).

    Why not torch's default (one thread per core): the engine's steps are many small ops, each of which
    every thread joins; on a many-core or busy host the joins cost more than the work. The README's
    tiny_llama command took 1,454 ms a token at torch's default on 16 cores and 28 ms with one thread
    (issue 26); at 40 requests on a busy 2-core host, a mean TPOT of 816 ms at torch's default (2 threads),
    546 ms at 2 and 54 ms at 1. A larger model on many cores may gain from more: backend.threads=N."""
    if setting is not None:
        return int(setting)
    if device.type != "cpu" or os.environ.get("OMP_NUM_THREADS"):
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(CPU_THREADS_CAP, cores))


def set_cpu_threads(setting: int | None, device: torch.device) -> int:
    """Apply `cpu_threads`; the threads torch now uses."""
    threads = cpu_threads(setting, device)
    if threads is not None:
        torch.set_num_threads(threads)
    return torch.get_num_threads()


def free_memory(device: torch.device) -> int:
    """Bytes free on the device (host RAM available, for the CPU)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


@dataclass
class Engine:
    spec: ModelSpec
    runner: ModelRunner
    num_blocks: int
    device: torch.device
    dtype: torch.dtype
    cpu_threads: int | None = None  # torch's threads, where the engine runs on the CPU

    @property
    def device_name(self) -> str:
        if self.device.type == "cuda":
            return torch.cuda.get_device_name(self.device)
        return "cpu"

    def replay(self, requests, loop: StepLoop, horizon_s: float | None, seed: int) -> EngineReplay:
        return EngineReplay(requests, loop, self.runner, PromptTokens(self.spec.vocab_size, seed), horizon_s)


def decode_graph_pool_bytes(spec: ModelSpec, dtype: torch.dtype, max_batch: int, max_context_tokens: int) -> int:
    """An upper estimate of the decode graphs' shared pool: the largest step's K and V gathered
    for one layer, its float32 logits, and 25% for the layer activations around them."""
    item = torch.empty((), dtype=dtype).element_size()
    gathered = 2 * max_context_tokens * spec.num_kv_heads * spec.head_dim * item
    logits = max_batch * spec.vocab_size * 4
    return int(1.25 * (gathered + logits))


def kv_cache_blocks(cfg: DictConfig, spec: ModelSpec, device: torch.device, left: float,
                    block_bytes: int) -> tuple[int, str]:
    """How many KV blocks to allocate, and why that many.

    `kv.num_blocks` when set; else what the memory left holds, as vLLM sizes its cache on a
    GPU. On a CPU the host RAM is everyone's, so the cache takes no more than the running
    sequences can ever fill (`scheduler.max_num_seqs` x `max_model_len`) nor more than
    `kv.cpu_kv_cache_gb` (vLLM's VLLM_CPU_KVCACHE_SPACE plays that part): without them a large
    max_num_seqs took 90% of the host's free memory for a model of a few hundred kB.
    """
    kc = cfg.kv
    if kc.num_blocks is not None:
        return kc.num_blocks, "kv.num_blocks"
    candidates = [(int(left // block_bytes), f"kv.memory_utilization {kc.memory_utilization} of free memory")]
    if device.type == "cpu":
        max_len = cfg.scheduler.max_model_len or spec.max_model_len
        candidates.append((cfg.scheduler.max_num_seqs * -(-max_len // kc.block_size),
                           f"what scheduler.max_num_seqs {cfg.scheduler.max_num_seqs} x max_model_len {max_len} can use"))
        if kc.cpu_kv_cache_gb is not None:
            candidates.append((int(kc.cpu_kv_cache_gb * GB // block_bytes), f"kv.cpu_kv_cache_gb={kc.cpu_kv_cache_gb}"))
    blocks, why = min(candidates)
    return blocks, f"bounded by {why}"


def build_engine(cfg: DictConfig, spec: ModelSpec, threads: bool = False) -> Engine:
    """The engine for `cfg`; `threads`: set torch's threads by `backend.threads` first (a replay; a
    profile and testbed-fidelity set them by `profile.threads`)."""
    device = resolve_device(cfg.backend.device)
    if threads:
        log.info("torch threads: %d", set_cpu_threads(cfg.backend.get("threads"), device))
    cpu_threads = torch.get_num_threads() if device.type == "cpu" else None
    dtype_name = cfg.backend.dtype or spec.dtype
    if spec.checkpoint:  # its shapes (for the fit check), keeping where the weights come from
        spec = replace(ModelSpec.from_hf_config(checkpoint_folder(spec.checkpoint), name=spec.name, dtype=dtype_name),
                       checkpoint=spec.checkpoint, random_weights=spec.random_weights)
    weights = spec.num_params * DTYPE_BYTES[dtype_name]
    usable = free_memory(device) * cfg.kv.memory_utilization
    if weights > usable:
        raise DoesNotFit(f"model {spec.name} does not fit on {device}: its weights need {weights / GB:.2f} GB in "
                         f"{dtype_name}, {usable / GB:.2f} GB is usable (free memory x kv.memory_utilization "
                         f"{cfg.kv.memory_utilization})")
    model = build_model(spec, dtype_name, device, seed=cfg.seed)
    if spec.checkpoint:
        spec = replace(model_spec_of(model.config, name=spec.name, dtype=dtype_name),
                       checkpoint=spec.checkpoint, random_weights=spec.random_weights)
    dtype = next(model.parameters()).dtype
    block_size = cfg.kv.block_size
    block_bytes = PagedKVCache.block_bytes(spec.num_layers, block_size, spec.num_kv_heads, spec.head_dim, dtype)
    left = free_memory(device) * cfg.kv.memory_utilization - (0 if device.type == "cuda" else weights)
    left -= cfg.kv.activation_reserve_gb * GB
    graphs = device.type == "cuda" and cfg.backend.cuda_graphs
    graph_pool = decode_graph_pool_bytes(spec, dtype, cfg.scheduler.max_num_seqs,
                                         cfg.backend.cuda_graph_max_tokens) if graphs else 0
    left -= graph_pool + (block_bytes if graphs else 0)  # the graphs' memory pool, the scratch block
    num_blocks, why = kv_cache_blocks(cfg, spec, device, left, block_bytes)
    need = num_blocks * block_bytes
    if num_blocks < 1 or need > left:
        raise DoesNotFit(f"KV cache of {max(num_blocks, 1)} blocks ({block_size} tokens each) needs "
                         f"{max(need, block_bytes) / GB:.2f} GB, {max(left, 0) / GB:.2f} GB is free on {device} after "
                         f"{weights / GB:.2f} GB of weights, {cfg.kv.activation_reserve_gb} GB of activation reserve"
                         + (f" and {graph_pool / GB:.2f} GB for CUDA graphs (backend.cuda_graphs)" if graphs else ""))
    log.info("KV cache: %d blocks of %d tokens, %.3f GB on %s (%s)", num_blocks, block_size, need / GB, device, why)
    cache = PagedKVCache.for_model(model.config, num_blocks, block_size, dtype, device, scratch_block=graphs)
    runner = ModelRunner(model, cache)
    if graphs:  # captured here, before any timing: a replay or a profile never pays for a capture
        runner.enable_decode_graphs(cfg.scheduler.max_num_seqs, cfg.scheduler.max_model_len or spec.max_model_len,
                                    use_graphs=True, max_context_tokens=cfg.backend.cuda_graph_max_tokens)
    return Engine(spec, runner, num_blocks, device, dtype, cpu_threads)
