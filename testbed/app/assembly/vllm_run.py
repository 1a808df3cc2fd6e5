"""backend=vllm: the configured trace replayed on real vLLM, written as every other backend's run.

The model preset is built with its seeded random weights and saved to a temporary folder
(vLLM loads models from disk; nothing is downloaded), or a local checkpoint is handed over
as it is. Prompts are `PromptTokens`, as on the engine, so prefix sharing is real. vLLM is
checked first (`require_vllm`): without it, or outside the supported versions, the run stops
before anything is built, saying how to install it.
"""
from __future__ import annotations

import logging
import tempfile
import time
from typing import Callable

from omegaconf import DictConfig

from testbed.vllm_backend import require_vllm

log = logging.getLogger("testbed")


# the policies that model vLLM's own scheduler: native vLLM takes its settings from their knobs, and
# testbed-referee checks them against it
NATIVE_POLICIES = ("vllm", "vllm_priority")


def native_settings(policy: str, knobs: dict) -> dict:
    """vLLM's own scheduler settings from the `vllm` (or `vllm_priority`: `--scheduling-policy priority`)
    policy's knobs, so that `policy.*` configures native vLLM as it configures the testbed's model of it;
    vLLM's defaults for any other policy."""
    if policy not in NATIVE_POLICIES:
        return {}
    return {"enable_chunked_prefill": knobs.get("chunked_prefill", True),
            "long_prefill_token_threshold": knobs.get("long_prefill_token_threshold", 0),
            "scheduler_reserve_full_isl": knobs.get("reserve_full_isl", True),
            "scheduling_policy": "priority" if policy == "vllm_priority" else "fcfs"}


def replay_on_vllm(cfg: DictConfig, stop: Callable[[], bool] | None = None,
                   on_done: Callable[..., None] | None = None):
    """Replay the trace in real time on an in-process vLLM engine (`backend.scheduler` decides who schedules).
    `on_done(setup, replay)` sees the replay before the engine is released (the referee reads its log)."""
    version = require_vllm()
    from testbed.app.assembly.run_setup import finish, prepare, resolve_model_spec
    from testbed.engine.models import build_model, checkpoint_folder
    from testbed.engine.prompts import PromptTokens
    from testbed.vllm_backend.engine import EngineSettings, build_engine, check_model, shutdown_engine
    from testbed.vllm_backend.recording import SchedulerLog
    from testbed.app.assembly.plugins import make_policy
    from testbed.core.kv import BlockManager
    from testbed.core.loop import StepLoop
    from testbed.vllm_backend.policy import PolicyBridge, swap_knob_problem
    from testbed.vllm_backend.policy import scheduler_class as policy_scheduler
    from testbed.vllm_backend.policy_replay import PolicyReplay
    from testbed.vllm_backend.replay import VLLMReplay

    t0 = time.perf_counter()
    mode = cfg.backend.scheduler
    spec = resolve_model_spec(cfg.model)
    dtype = cfg.backend.dtype or spec.dtype
    check_model(spec.head_dim, "model.head_dim")
    setup = prepare(cfg, model=spec)
    if mode == "policy" and (problem := swap_knob_problem(setup.knobs, cfg.policy.name)):
        raise ValueError(problem)
    max_len = cfg.scheduler.max_model_len or spec.max_model_len
    kc = cfg.kv
    with tempfile.TemporaryDirectory(prefix="testbed-vllm-model-") as folder:
        if spec.checkpoint and not spec.random_weights:
            folder = str(checkpoint_folder(spec.checkpoint))
        else:
            build_model(spec, dtype, "cpu", seed=cfg.seed).save_pretrained(folder)
        settings = EngineSettings(folder, dtype=dtype, max_model_len=max_len,
                                  max_num_seqs=cfg.scheduler.max_num_seqs,
                                  max_num_batched_tokens=cfg.scheduler.max_num_batched_tokens,
                                  enable_prefix_caching=kc.enable_prefix_caching,
                                  num_blocks=kc.num_blocks,
                                  kv_cache_bytes=int(kc.cpu_kv_cache_gb * 1e9) if kc.cpu_kv_cache_gb else None,
                                  seed=cfg.seed,
                                  **(native_settings(cfg.policy.name, setup.knobs) if mode == "native" else {}))
        prompts = PromptTokens(spec.vocab_size, cfg.seed)
        slog, bridge = SchedulerLog(), PolicyBridge()
        # the folder outlives the run: vLLM may read it again
        engine = build_engine(settings, slog, policy_scheduler(bridge) if mode == "policy" else None)
        blocks, block_size = (slog.num_blocks, slog.block_size) if mode == "native" else (bridge.num_blocks,
                                                                                          bridge.block_size)
        log.info("vLLM %s ready (%s scheduler, %d KV blocks of %d tokens): replaying %d requests on the wall clock",
                 version, mode, blocks, block_size, len(setup.requests))
        if mode == "native":
            replay = VLLMReplay(engine, slog, setup.requests, prompts, max_len, cfg.backend.horizon_s,
                                cfg.output.record_token_times)
        else:  # the testbed's loop, on a BlockManager shaped as vLLM's cache, decides each step
            bridge.loop = StepLoop(make_policy(cfg.policy.name, **setup.knobs),
                                   BlockManager(blocks, block_size, kc.enable_prefix_caching, 0), setup.limits, setup.cost,
                                   record_token_times=cfg.output.record_token_times)
            replay = PolicyReplay(engine, bridge, setup.requests, prompts, cfg.backend.horizon_s)
        try:
            result = finish(cfg, setup, replay.run(stop), "vllm", t0)
            if on_done is not None:
                on_done(setup, replay)
        finally:
            shutdown_engine(engine)
    result.summary.update(block_size=block_size, vllm_version=version, vllm_scheduler=mode,
                          device=engine_device(), dtype=dtype)
    return result


def engine_device() -> str:
    from vllm.platforms import current_platform

    return "cpu" if current_platform.is_cpu() else str(getattr(current_platform, "device_name", "gpu"))
