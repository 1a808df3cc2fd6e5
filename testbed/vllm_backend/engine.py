"""An in-process vLLM engine over a local model folder, with the recording scheduler plugged in.

In-process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so that the Scheduler subclass runs in this
process and its log is readable after each step; eager (no graph capture), tokenizer-free
(prompts are token ids), synchronous scheduling (vLLM's async scheduling plans step N+1
before step N's tokens are back, which would blur which step produced a token). Nothing is
downloaded: the model is a folder on disk and HF_HUB_OFFLINE is set.
"""
from __future__ import annotations

import gc
import os
from dataclasses import dataclass

from testbed.vllm_backend import require_vllm
from testbed.vllm_backend.recording import SchedulerLog, scheduler_class


@dataclass
class EngineSettings:
    """What the engine is built from (the app fills it from the config: scheduler.*, kv.*, model.dtype)."""

    model_dir: str
    dtype: str = "float32"
    max_model_len: int = 2048
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    enable_prefix_caching: bool = True
    num_blocks: int | None = None  # vLLM's num_gpu_blocks_override
    kv_cache_bytes: int | None = None  # on a CPU only: vLLM's kv_cache_memory_bytes (VLLM_CPU_KVCACHE_SPACE's role)
    seed: int = 0
    # vLLM's scheduler settings that the testbed's `vllm` policy has as knobs (native mode takes them from it)
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    scheduler_reserve_full_isl: bool = True
    scheduling_policy: str = "fcfs"  # vLLM's --scheduling-policy: "priority" for the testbed's `vllm_priority`


def build_engine(settings: EngineSettings, log: SchedulerLog, scheduler_cls=None):
    """A vLLM LLMEngine whose scheduler is `scheduler_cls` (default: the recording one, writing to `log`)."""
    require_vllm()
    # an earlier in-process engine nobody holds any more is torn down now, not at some later GC pass:
    # its teardown destroys vLLM's global process groups, which would break the engine built here
    gc.collect()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform
    from vllm.v1.engine.llm_engine import LLMEngine

    args = EngineArgs(model=settings.model_dir, skip_tokenizer_init=True, dtype=settings.dtype,
                      enforce_eager=True, max_model_len=settings.max_model_len, max_num_seqs=settings.max_num_seqs,
                      max_num_batched_tokens=settings.max_num_batched_tokens,
                      enable_prefix_caching=settings.enable_prefix_caching,
                      enable_chunked_prefill=settings.enable_chunked_prefill,
                      long_prefill_token_threshold=settings.long_prefill_token_threshold,
                      scheduler_reserve_full_isl=settings.scheduler_reserve_full_isl,
                      scheduling_policy=settings.scheduling_policy,
                      num_gpu_blocks_override=settings.num_blocks,
                      # on a GPU vLLM sizes the cache from gpu_memory_utilization, as it always does
                      kv_cache_memory_bytes=settings.kv_cache_bytes if current_platform.is_cpu() else None,
                      scheduler_cls=scheduler_cls or scheduler_class(log), async_scheduling=False,
                      seed=settings.seed, disable_log_stats=True)
    return LLMEngine.from_engine_args(args)


def shutdown_engine(engine) -> None:
    """Tear an in-process engine down now. Its client's finalizer (`InprocClient`, vllm/v1/engine/
    core_client.py L383) otherwise runs whenever the GC collects it, and `EngineCore.shutdown` then calls
    `cleanup_dist_env_and_memory` (vllm/v1/engine/core.py L839), destroying the process-wide parallel
    groups: if another engine was built in between, its next step fails ("pipeline model parallel group
    is not initialized"). Idempotent: the finalizer runs once."""
    engine.engine_core.shutdown()


def check_model(head_dim: int, key: str) -> None:
    """Refuse, before anything is built, a head size vLLM's CPU attention has no kernel for
    (CPUAttentionBackend.get_supported_head_sizes, vllm/v1/attention/backends/cpu_attn.py):
    vLLM itself fails only at the first forward, deep in a custom op."""
    require_vllm()
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    sizes = CPUAttentionBackend.get_supported_head_sizes()
    if head_dim not in sizes:
        raise ValueError(f"{key}={head_dim}: vLLM's CPU attention supports head sizes {sizes} only "
                         f"(e.g. model=tiny_llama {key}=32)")
