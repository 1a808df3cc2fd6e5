"""Run the scenarios ported from vLLM's scheduler tests through REAL vLLM 0.32's Scheduler.

The ground truth for `tests/test_vllm_ported.py`. The scenario inputs are read from
`tests/vllm_ported_scenarios.py` (the same file the tests read). For each scenario this builds
vLLM's V1 `Scheduler` the way upstream's tests do (`tests/v1/core/utils.py::create_scheduler`:
a VllmConfig and a KVCacheConfig of one full-attention group, no model and no worker), adds
each request before its step, and steps `schedule()` / `update_from_output()` until every
request has finished, feeding back one sampled token for each request whose scheduled tokens
reach its known length (none for a partial prefill chunk), as upstream's tests do. Printed per
step: the tokens scheduled per request, the requests preempted, and the requests admitted with
the prefix-cache hit they were admitted with (tokens). A scenario with `policy: "priority"` builds
the Scheduler with `SchedulerConfig(policy="priority")` and gives each request its `priority` and
`arrival_time`; its steps are printed as ordered (request, tokens) pairs, vLLM's scheduling order.

Run it from the repository root with the Python that has vLLM (its own venv, main README "Real
vLLM"; nothing is downloaded: a tiny Llama config is written to a temporary folder, and the
tokenizer is never loaded):

    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 ~/venv-vllm/bin/python \
        experiments/vllm_referee/ported_scenarios_real.py > experiments/vllm_referee/ported_scenarios_real.txt

`--check` also compares each result with the one recorded in tests/test_vllm_ported.py
(`EXPECTED`, read with `ast`, so neither pytest nor the testbed is imported here).
"""
from __future__ import annotations

import ast
import importlib.util
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = Path(__file__).resolve().parents[2]
SAMPLED_TOKEN = 1000  # the token id every sampling step "generates" (upstream's tests use 1000 too)


def load_scenarios():
    spec = importlib.util.spec_from_file_location("vllm_ported_scenarios", ROOT / "tests" / "vllm_ported_scenarios.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def tiny_model_dir() -> str:
    from transformers import LlamaConfig

    folder = tempfile.mkdtemp(prefix="tiny-llama-")
    LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, head_dim=32, vocab_size=2048,
                intermediate_size=128, max_position_embeddings=8192).save_pretrained(folder)
    return folder


def make_scheduler(cfg: dict, model_dir: str, policy: str = "fcfs"):
    import torch
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    bs = cfg["block_size"]
    num_blocks = cfg["num_blocks"] + 1  # + the null block
    model_config = ModelConfig(model=model_dir, dtype="float32", seed=42, skip_tokenizer_init=True,
                               max_model_len=cfg["max_model_len"])
    scheduler_config = SchedulerConfig(
        max_num_seqs=cfg["max_num_seqs"],
        max_num_batched_tokens=cfg["max_num_batched_tokens"],
        max_model_len=cfg["max_model_len"],
        long_prefill_token_threshold=cfg["long_prefill_token_threshold"],
        enable_chunked_prefill=cfg["enable_chunked_prefill"],
        scheduler_reserve_full_isl=cfg["reserve_full_isl"],
        async_scheduling=cfg.get("async_scheduling", False),
        is_encoder_decoder=False,
        policy=policy,
    )
    cache_config = CacheConfig(block_size=bs, enable_prefix_caching=cfg["enable_prefix_caching"])
    vllm_config = VllmConfig(scheduler_config=scheduler_config, model_config=model_config,
                             cache_config=cache_config)
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer"], FullAttentionSpec(block_size=bs, num_kv_heads=1, head_size=1,
                                                                       dtype=torch.float32))],
    )
    cache_config.num_gpu_blocks = num_blocks
    cls = AsyncScheduler if cfg.get("async_scheduling") else Scheduler  # SchedulerConfig.get_scheduler_cls
    sched = cls(vllm_config=vllm_config, kv_cache_config=kv_cache_config,
                      structured_output_manager=StructuredOutputManager(vllm_config),
                      block_size=bs, hash_block_size=bs, log_stats=True)
    # what the scheduler actually runs with (a config post-init must not have changed them)
    sc = sched.scheduler_config
    assert sched.scheduler_reserve_full_isl == cfg["reserve_full_isl"]
    assert sc.long_prefill_token_threshold == cfg["long_prefill_token_threshold"]
    assert sc.enable_chunked_prefill == cfg["enable_chunked_prefill"]
    assert sc.max_num_batched_tokens == cfg["max_num_batched_tokens"] == sched.max_num_scheduled_tokens
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == cfg["num_blocks"]
    assert sched.policy.value == policy
    return sched


def run_scenario(sc: dict, model_dir: str, prompt_tokens) -> dict:
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    cfg = sc["config"]
    policy = sc.get("policy", "fcfs")
    prio = sc.get("priority", {})
    sched = make_scheduler(cfg, model_dir, policy)
    init_none_hash(sha256)
    hasher = get_request_block_hasher(cfg["block_size"], sha256)
    reqs = {}
    for rid, runs, max_tokens, _ in sc["requests"]:
        extra = dict(priority=prio[rid][0], arrival_time=prio[rid][1]) if rid in prio else {}
        reqs[rid] = Request(request_id=rid, prompt_token_ids=prompt_tokens(runs),
                            sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                            pooling_params=None, block_hasher=hasher, **extra)
    return drive(sc, sched, reqs, policy, batch_queue=2 if cfg.get("async_scheduling") else 1)


def drive(sc: dict, sched, reqs: dict, policy: str, batch_queue: int) -> dict:
    """Step the scheduler as EngineCore does: `batch_queue` = 1 is the synchronous loop (schedule, then that
    step's output, update_from_output); 2 is async scheduling, EngineCore.step_with_batch_queue
    (vllm/v1/engine/core.py L698-800), which schedules a batch while the previous one is in flight and only
    then takes that one's output. A request is added before the schedule() call numbered by its arrive_step;
    a call with nothing to schedule and nothing in flight is an empty step. The output samples a token for
    each request whose scheduled tokens reach its known ones (a step in flight's placeholder is computed,
    not known: vllm/v1/request.py num_tokens), none for a partial prefill chunk, as upstream's tests do."""
    from collections import deque

    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import RequestStatus

    waiting_status = (RequestStatus.WAITING, RequestStatus.PREEMPTED)
    steps, preempted, admitted = [], {}, {}
    queue = deque()
    last = max(r[3] for r in sc["requests"])
    step = 0
    while True:
        for rid, _, _, arrive in sc["requests"]:
            if arrive == step:
                sched.add_request(reqs[rid])
        if step > last and sched.get_num_unfinished_requests() == 0 and not queue:
            break
        if step > 500:
            raise RuntimeError("scenario does not finish")
        if sched.has_requests() or batch_queue == 1:
            running_before = {r.request_id for r in sched.running}
            waiting_before = {rid for rid, r in reqs.items() if r.status in waiting_status and rid in sched.requests}
            out = sched.schedule()
            n = dict(out.num_scheduled_tokens)
            # under the priority policy the order vLLM scheduled them in is recorded too
            steps.append(tuple(n.items()) if policy == "priority" else n)
            pre = sorted(rid for rid in running_before if reqs[rid].status == RequestStatus.PREEMPTED)
            if pre:
                preempted[step] = pre
            adm = {rid: reqs[rid].num_computed_tokens - n[rid] for rid in n if rid in waiting_before}
            if adm:
                admitted[step] = adm
            ids = list(n)
            sampled = [[SAMPLED_TOKEN] if reqs[rid].num_computed_tokens >= reqs[rid].num_tokens else [] for rid in ids]
            queue.appendleft((out, ids, sampled))
            step += 1
            if len(queue) < batch_queue and (out.total_num_scheduled_tokens > 0 or sched.has_requests()):
                continue
        elif not queue:
            steps.append(() if policy == "priority" else {})
            step += 1
            continue
        out, ids, sampled = queue.pop()
        sched.update_from_output(out, ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                                        sampled_token_ids=sampled, logprobs=None,
                                                        prompt_logprobs_dict={}, pooler_output=[]))
    while steps and not steps[-1]:  # async: the schedules that run while the last outputs drain decide nothing
        steps.pop()
    free = sched.kv_cache_manager.block_pool.get_num_free_blocks()
    return dict(steps=load_scenarios().rle(steps), preempted=preempted, admitted=admitted, free_blocks_at_end=free)


def recorded_expectations() -> dict:
    """EXPECTED from tests/test_vllm_ported.py, read as a literal."""
    tree = ast.parse((ROOT / "tests" / "test_vllm_ported.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "EXPECTED" for t in node.targets):
            return ast.literal_eval(node.value)
    raise SystemExit("no EXPECTED literal in tests/test_vllm_ported.py")


def main() -> None:
    import vllm

    check = "--check" in sys.argv
    only = [a for a in sys.argv[1:] if not a.startswith("--")]
    mod = load_scenarios()
    model_dir = tiny_model_dir()
    print(f"# REAL vLLM {vllm.__version__}: tests/vllm_ported_scenarios.py through vllm.v1.core.sched.scheduler.Scheduler")
    print("# per scenario: config; then one line per step (or run of equal steps): {request: tokens scheduled}"
          " [preempted: ...] [admitted: {request: prefix-cache hit tokens}]; on a run of steps these belong to its first step")
    results = {}
    for name, sc in mod.SCENARIOS.items():
        if only and name not in only:
            continue
        res = run_scenario(sc, model_dir, mod.prompt_tokens)
        results[name] = res
        print(f"\n## {name}")
        print("config:", json.dumps(sc["config"]))
        print("requests (id, prompt runs, max_tokens, arrive_step):", json.dumps(sc["requests"]))
        if "policy" in sc:
            print("policy:", sc["policy"], " priority (id: [priority, arrival_time]):", json.dumps(sc["priority"]))
        i = 0
        for repeat, n in res["steps"]:
            extra = ""
            if i in res["preempted"]:
                extra += f"  preempted: {res['preempted'][i]}"
            if i in res["admitted"]:
                extra += f"  admitted: {res['admitted'][i]}"
            label = f"step {i:3d}" if repeat == 1 else f"steps {i}-{i + repeat - 1}"
            print(f"{label}: {n}{extra}")
            i += repeat
        print("free blocks at the end:", res["free_blocks_at_end"], "of", sc["config"]["num_blocks"])
    print("\n# as a literal {scenario: (steps as [(repeat, {request: tokens})], {step: preempted}, {step: {admitted: hit}})}:")
    print("{")
    for name, res in results.items():
        print(f"    {name!r}: ({res['steps']!r}, {res['preempted']!r}, {res['admitted']!r}),")
    print("}")
    if check:
        expected = recorded_expectations()
        bad = [name for name, res in results.items()
               if expected.get(name) != (res["steps"], res["preempted"], res["admitted"])]
        print("\n# --check against tests/test_vllm_ported.py EXPECTED:", "all equal" if not bad else f"DIFFER: {bad}")
        if bad:
            sys.exit(1)


if __name__ == "__main__":
    main()
