"""Typed schemas for every Hydra config group, registered in Hydra's ConfigStore.

Each YAML file under `conf/` names its schema in its defaults list, so Hydra checks every
key and type before a run starts: a typo'd key or a string where a number belongs fails
with Hydra's own message naming the key. Policy knobs are each policy's own dataclass,
registered here automatically as `policy/<name>_schema`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

from testbed.engine.profile_config import ProfileConfig
from testbed.app.assembly.frontend import FrontendConfig
from testbed.app.analysis.metrics import SLO
from testbed.core.bounds import bounded
from testbed.core.specs import HardwareSpec, ModelSpec, ParallelSpec
from testbed.vllm_backend.native_sim import NATIVE_POLICY, VLLMNativeKnobs


@dataclass
class TraceConfig:
    """Where requests come from, and how the trace is transformed before replay.

    kind=file replays `path` (format azure, mooncake, qwen_bailian, csv, jsonl or parquet; or a
    published format by name: azure_2024, azure_multimodal_2025, burstgpt (testbed.traces.formats); a
    .parquet suffix reads Parquet, a .gz/.zst/.zstd one decompresses); kind=poisson or
    gamma generates arrivals at `rate` (gamma with burstiness `cv`), with lengths fixed
    (`prompt_len`, `output_len`) or sampled from the trace at `lengths_from` (in
    `lengths_format`; vidur: a length-only set, num_prefill_tokens,num_decode_tokens); kind=servegen
    generates a workload from the ServeGen data folder at `path` (testbed.traces.servegen).
    """

    name: str = MISSING
    kind: str = "file"
    path: Optional[str] = None
    format: str = "azure"
    columns: dict[str, str] = field(default_factory=dict)
    time_unit: str = "s"
    lenient: bool = False
    # format=burstgpt only: keep the rows with these values, e.g. {Model: GPT-4, Log Type: Conversation log}
    row_filter: dict[str, str] = field(default_factory=dict)
    # generators
    rate: float = bounded(1.0, gt=0)
    cv: float = bounded(1.0, gt=0)
    num_requests: Optional[int] = bounded(None, ge=1)
    duration_s: Optional[float] = bounded(None, gt=0)
    prompt_len: Optional[int] = bounded(None, ge=1)
    output_len: Optional[int] = bounded(None, ge=1)
    lengths_from: Optional[str] = None
    lengths_format: str = "azure"
    # transforms, applied in this order: window, first N, rate scale, length caps. Under lenient
    # loading only the rejected rows inside the window / first N count (traces.rejected_in_selection)
    start_s: Optional[float] = bounded(None, ge=0)
    end_s: Optional[float] = bounded(None, ge=0)
    max_requests: Optional[int] = bounded(None, ge=1)
    rate_scale: float = bounded(1.0, gt=0)
    max_prompt_len: Optional[int] = bounded(None, ge=1)
    max_output_len: Optional[int] = bounded(None, ge=1)
    # coarse timestamps (traces.spread_arrivals, applied first, before the window): none, uniform or
    # poisson spreads the requests sharing a time over [t, t + spread_bucket_s) (null: the detected
    # width), seeded by the run's seed; the summary says so (trace_spread, trace_spread_bucket_s)
    spread: str = "none"
    spread_bucket_s: Optional[float] = bounded(None, gt=0)
    # kind=servegen: every client's rate multiplied by this (ServeGen's rate_fn), windows kept
    servegen_rate_scale: float = bounded(1.0, gt=0)
    # multi-turn sessions (requests with a parent, e.g. format=qwen_bailian): "open" = every turn arrives at
    # its timestamp; "closed" = a turn arrives when its parent finished plus its think time (testbed/sim/sessions.py)
    session_replay: str = field(default="open", metadata={
        "sim_only": "the engine replays arrivals at their timestamps; closed-loop release is the simulator's"})
    # closed loop: the pause between a parent's answer and its next turn when the trace records none
    # (null: the trace's gap between the two timestamps, which includes the recorded answer time)
    think_time_s: Optional[float] = bounded(None, ge=0)


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int = bounded(8192, ge=1)
    max_num_seqs: int = bounded(256, ge=1)
    max_model_len: Optional[int] = bounded(None, ge=1)  # null: the model's context length


@dataclass
class KVConfig:
    block_size: int = bounded(16, ge=1)
    memory_utilization: float = bounded(0.9, gt=0, le=1)  # fraction of device memory for weights + KV, as vLLM's gpu_memory_utilization
    activation_reserve_gb: float = bounded(1.0, ge=0)  # left for activations (the engine's CUDA graphs reserve their own)
    num_blocks: Optional[int] = bounded(None, ge=1)  # set to override the capacity derived from memory
    # the KV cache's dtype, vLLM's --kv-cache-dtype (CacheDType in vllm/config/cache.py): auto (the model's
    # dtype), bfloat16 (bf16), float16, fp8 (= fp8_e4m3; fp8_e5m2): bytes per cached token, hence KV blocks and
    # the KV read of attention. conf/config.yaml hands it to the model spec (model.kv_cache_dtype). Simulator only
    cache_dtype: str = "auto"
    enable_prefix_caching: bool = True
    # when a request's decode tokens enter the prefix cache: "scheduled" (vLLM: every full block,
    # when scheduled) or "finished" (SGLang's radix cache: prefilled tokens after their chunk, decode
    # tokens when the request finishes; a retracted request's decode tokens are freed uncached)
    cache_decode_tokens: str = "scheduled"
    swap_space_gb: float = bounded(0.0, ge=0)  # host memory for swap preemption
    # host memory for a KV tier behind the prefix cache (vLLM's --kv-offloading-size, SGLang's
    # --hicache-size): evicted prefix blocks are kept there and loaded back on a hit; 0: off.
    # Per GPU, as swap_space_gb (each GPU keeps its share of every block). Simulator only (testbed.core.kv_offload)
    offload_gb: float = bounded(0.0, ge=0)
    # when a prefix block is stored to the host tier: "write_through" (when cached: vLLM, SGLang's
    # default) or "write_back" (when its last device copy is evicted: SGLang's write_back)
    offload_write_policy: str = "write_through"
    # backend=engine on a CPU, kv.num_blocks null: the most host memory the KV cache takes (as vLLM's
    # VLLM_CPU_KVCACHE_SPACE); null: what kv.memory_utilization leaves. Never more than max_num_seqs can fill.
    cpu_kv_cache_gb: Optional[float] = bounded(4.0, gt=0)


@dataclass
class CostModelConfig:
    name: str = "roofline"
    profile: Optional[str] = None  # a profile file, for fitted cost models
    # cost_model=kernels only (testbed/sim/kernel_cost.py): measured kernel tables of aiconfigurator-core for
    # hardware.kernel_db_gpu, as timed in `framework` (vllm, sglang or trtllm) at `framework_version` (null: per op,
    # the version nearest to `version_near`, the release the simulated server runs, or the newest when that is null);
    # data_dir: a folder laid out as aiconfigurator-core's systems/data (null: the package's)
    framework: str = "vllm"
    framework_version: Optional[str] = None
    version_near: Optional[str] = None
    # the token-to-expert routing whose fused-MoE timings are read: balanced, power_law_1.01 or power_law_1.2
    # (conf/cost_model/kernels.yaml: what power_law_1.2 did to the real Mixtral runs)
    moe_distribution: str = "balanced"
    data_dir: Optional[str] = None
    # cost_model=kernels: what prices the steps when the measured tables cannot (no tables for the GPU, framework,
    # model dtype, head size or op: testbed.sim.cost_models.kernel_model): "roofline" (a warning, and the summary
    # says cost_model=roofline with cost_model_fallback naming why) or null (the run fails, naming what is missing)
    fallback: Optional[str] = None
    # the terms the kernel sum misses, fitted on end-to-end runs: per step (scheduler, sampling, launch gaps), per
    # layer per step (norms, rotary, activation kernels the tables lack), per sequence in the step (input
    # preparation, sampling per row), per tensor-parallel all-reduce (each is a barrier across the GPUs);
    # kernel_scale multiplies the kernel sum
    step_overhead_s: float = bounded(0.0, ge=0, le=1)
    layer_overhead_s: float = bounded(0.0, ge=0, le=0.01)
    seq_overhead_s: float = bounded(0.0, ge=0, le=0.01)
    allreduce_overhead_s: float = bounded(0.0, ge=0, le=0.01)  # per tensor-parallel all-reduce: the barrier's wait
    kernel_scale: float = bounded(1.0, gt=0, le=10)
    # vLLM's sampler after the LM head (testbed/sim/sampler_cost.py; its path from `sampling`): each eager
    # kernel's GPU floor and the measured rate of the whole-vocabulary sort of top-p, in bytes per logit at
    # hardware.mem_bandwidth (both measured on an H100: vLLM PRs #42191, #33538, #32558)
    sampler: bool = True
    # vLLM's engine-core host work per step (scheduler, input preparation, output bookkeeping), measured with
    # vLLM 0.15.1's own code on a 2.45 GHz Zen 3 core (experiments/host_overhead/): a step takes max(GPU, host)
    # under async scheduling, GPU + host without it
    host_step_s: float = bounded(0.0, ge=0, le=1)
    host_seq_s: float = bounded(0.0, ge=0, le=0.01)
    sampler_kernel_s: float = bounded(6.5e-6, ge=0, le=0.001)
    sampler_sort_bytes_per_logit: float = bounded(364.0, ge=0, le=100000)


@dataclass
class SamplingConfig:
    """What the workload's requests set of the sampling parameters (null: not set, as a load generator that
    sends none), resolved as vLLM's API server does (testbed.core.sampling.resolve): the request's value,
    else the model's generation_config.json default (`generation_config: auto`, vLLM's default; `vllm`:
    vLLM's neutral defaults), else the neutral value. It decides which sampler path every step runs, which
    cost_model=kernels prices (testbed/sim/sampler_cost.py)."""

    generation_config: str = "auto"
    temperature: Optional[float] = bounded(None, ge=0)
    top_p: Optional[float] = bounded(None, gt=0, le=1)
    top_k: Optional[int] = bounded(None, ge=-1)
    min_p: Optional[float] = bounded(None, ge=0, le=1)
    repetition_penalty: Optional[float] = bounded(None, gt=0)
    frequency_penalty: Optional[float] = bounded(None, ge=-2, le=2)
    presence_penalty: Optional[float] = bounded(None, ge=-2, le=2)


@dataclass
class BackendConfig:
    """Which backend replays the trace. Keys marked `sim_only` (with the reason) mean nothing to the
    engine, which serves one replica on one device and runs every step: backend=engine refuses
    them at any value but their default rather than ignore them (`testbed.app.assembly.validate`); so does
    backend=vllm (real vLLM, in-process: `testbed.vllm_backend`)."""

    name: str = "sim"
    replicas: int = bounded(1, ge=1, sim_only="the engine serves one replica")
    horizon_s: Optional[float] = bounded(None, gt=0)
    # merge steady decode steps into one event (exact; see StepLoop.extend_decode_run)
    fast_forward: bool = field(default=True, metadata={"sim_only": "the engine runs every step on the wall clock"})
    # the memory a simulation may hold (GB); null: what the machine has (MemAvailable, or the cgroup's limit). A run
    # estimated past it is refused at start, naming the key that sets the most (testbed/app/assembly/memory_budget.py)
    memory_budget_gb: Optional[float] = bounded(None, gt=0, sim_only="the engine holds one replica")
    # vLLM's async scheduling: step N+1 is planned while step N runs, so an arrival during a step waits one more
    # step (testbed/sim/simulation.py). null: vLLM's own default (SchedulerConfig.async_scheduling = None, resolved
    # by VllmConfig, vllm/config/vllm.py L589-622 of 0.15.1): on, but off with ngram or draft-model speculative
    # decoding; off too where the simulator does not model it (disaggregated pools). testbed.app.assembly.run_setup.async_scheduling
    # resolves it; the summary records the value used
    async_scheduling: Optional[bool] = field(default=None, metadata={
        "sim_only": "the engine plans each step after the previous one's outputs; backend=vllm runs vLLM's own setting"})
    # backend=engine only
    device: str = "auto"  # auto (cuda when available), cuda, cuda:N or cpu
    dtype: Optional[str] = None  # null: the model's dtype
    cuda_graphs: bool = True  # on a GPU, decode-only steps replay CUDA graphs (engine/decode_graphs.py)
    cuda_graph_max_tokens: int = bounded(262_144, ge=1)  # largest batch x gathered context given a graph; larger steps run eagerly
    # on a CPU, torch's threads (torch.set_num_threads); null: engine/setup.py cpu_threads picks (see there why)
    threads: Optional[int] = bounded(None, ge=1)
    # backend=vllm only: "native" (vLLM's own V1 scheduler decides, the testbed records) or "policy"
    # (the testbed's policy decides, applied through vLLM's KV primitives)
    scheduler: str = "native"


_SPEC_SIM_ONLY = "speculative decoding is modelled in the simulator's loop and cost model only"


@dataclass
class SpecDecodeConfig:
    """Speculative decoding (testbed/core/spec_decode.py, testbed/sim/spec_cost.py): each decode verifies
    `num_speculative_tokens` draft tokens (vLLM's name) in one target pass and emits the accepted ones
    plus one. method: none (off), ngram (prompt lookup: no draft model, `ngram_host_s` of host time per
    step), draft (`draft_model`, a conf/model preset, runs k decode passes per step, priced by the run's
    cost model kind on the same hardware and parallelism). Each draft token is accepted with probability
    `acceptance_rate` until the first rejection; acceptance_dist=beta draws each request's rate from a
    Beta of that mean and `acceptance_concentration` (seeded by the run's seed and the request id)."""

    method: str = field(default="none", metadata={"sim_only": _SPEC_SIM_ONLY})
    num_speculative_tokens: int = bounded(3, ge=1, le=64, sim_only=_SPEC_SIM_ONLY)
    acceptance_rate: float = bounded(0.7, ge=0, le=1, sim_only=_SPEC_SIM_ONLY)
    acceptance_dist: str = field(default="fixed", metadata={"sim_only": _SPEC_SIM_ONLY})
    acceptance_concentration: float = bounded(10.0, gt=0, le=1e6, sim_only=_SPEC_SIM_ONLY)
    draft_model: str = field(default="llama3_2_1b", metadata={"sim_only": _SPEC_SIM_ONLY})
    ngram_host_s: float = bounded(1e-4, ge=0, le=0.1, sim_only=_SPEC_SIM_ONLY)


@dataclass
class OutputConfig:
    dir: str = "${hydra:runtime.output_dir}"
    record_token_times: bool = False  # per-token times in requests.parquet (large)
    write_steps: bool = True  # the per-step time series, steps.parquet
    print_table: bool = True  # a single run's table (a sweep prints one line per job, and its table at the end)
    skip_done: bool = True  # a folder already holding this exact config's results, of the same input files, is not run again
    progress: Optional[bool] = None  # a run's progress bar; null: only on a terminal, never in CI or sweep workers (a sweep's bar over its jobs: unless false)


@dataclass
class LoggerConfig:
    name: str = "none"  # none or wandb
    project: str = "llm-sched-testbed"
    entity: Optional[str] = None
    group: Optional[str] = None  # null: the experiment's name, else the policy and trace not swept (wandb_log.run_identity)
    mode: Optional[str] = None  # null: offline unless WANDB_API_KEY is set (or WANDB_MODE)
    max_history_rows: int = bounded(2000, ge=1)
    log_requests_table: bool = True


@dataclass
class CapacityConfig:
    """`testbed-capacity`: bisection over trace.rate_scale for the highest load meeting the SLO."""

    lo: float = bounded(0.25, gt=0)
    hi: float = bounded(8.0, gt=0)
    rel_tol: float = bounded(0.02, gt=0, lt=1)
    max_evals: int = bounded(16, ge=1)


@dataclass
class FidelityConfig:
    """`testbed-fidelity`: how often the real replay is repeated, to set the simulator's error beside
    the real run's own run-to-run spread (the machine's noise)."""

    repeats: int = bounded(1, ge=1)


REFEREE_REFERENCES = ("vllm", NATIVE_POLICY)


@dataclass
class RefereeConfig:
    """`testbed-referee`: what the `vllm` policy is checked against. `vllm`: real vLLM executing a (tiny) model on
    the wall clock, its own scheduler deciding; `vllm_native`: vLLM's own scheduler in the simulator (the run
    `policy=vllm_native` makes), at the config's GPU scale: whole traces, caches of tens of thousands of blocks."""

    reference: str = "vllm"


@dataclass
class ValidateConfig:
    """`testbed-validate`: real runs replayed in the simulator (testbed/app/analysis/validate_runs.py)."""

    # a folder of run folders in inference-perf's format (testbed/app/analysis/real_runs.py), or a list of such folders
    runs: Any = None
    fit: list[str] = field(default_factory=list)  # numeric config keys to fit to the runs (least squares)
    leave_one_model_out: bool = True  # with fit: score each model with the keys fitted on the others
    fit_step: float = bounded(0.1, gt=0, le=1)  # finite-difference step, relative to each key's value (start keys > 0)
    # steps tried (each: one replay of every run; plus len(fit) replays of every run per Jacobian taken)
    fit_iterations: int = bounded(2, ge=1)
    # broyden: one finite-difference Jacobian, updated from each step (a fresh one when a step fails);
    # newton: a fresh Jacobian before every step (Gauss-Newton)
    fit_method: str = "broyden"
    fit_tolerance: float = bounded(1e-3, gt=0)  # stop when no key would move by this much of its starting value
    jobs: Optional[int] = bounded(None, ge=1)  # runs simulated in parallel (null: one per CPU)
    stage_gap_s: float = bounded(60.0, gt=0)  # idle time between stages (the load generator waits for a stage to drain)
    drain_s: float = bounded(300.0, gt=0)  # the clock stops this long after the last stage (overloaded runs never drain)


@dataclass
class DisaggPoolConfig:
    """One pool of a disaggregated run: its replica count, and what differs from the run's replica
    (null: the run's own `hardware`, `parallel.tensor_parallel_size`, `policy`, `scheduler.*`, `kv.num_blocks`)."""

    replicas: int = bounded(1, ge=1, le=1024)
    hardware: Optional[str] = None  # a preset of testbed/conf/hardware (h100, h200, a100, b200, l40s)
    tensor_parallel_size: Optional[int] = bounded(None, ge=1, le=64)
    policy: Optional[str] = None  # a registered policy, at its default knobs
    max_num_batched_tokens: Optional[int] = bounded(None, ge=1)
    max_num_seqs: Optional[int] = bounded(None, ge=1)
    num_blocks: Optional[int] = bounded(None, ge=1)  # the pool's KV capacity per replica, in blocks


@dataclass
class KVLinkConfig:
    """The link a prefill replica sends a prompt's KV over to a decode replica (testbed/sim/kv_link.py):
    a preset (nvlink, infiniband, roce) or its bandwidth / latency overridden."""

    name: str = "infiniband"
    bandwidth_GBps: Optional[float] = bounded(None, gt=0)  # per GPU, one direction, in GB/s (bytes); null: the preset's
    latency_us: Optional[float] = bounded(None, ge=0)  # per transfer; null: the preset's
    efficiency: float = bounded(0.8, gt=0, le=1)  # the share of the bandwidth a KV transfer achieves
    # transfers into one decode replica queue one after another (its NICs are shared); false: they overlap
    serialize: bool = True


@dataclass
class DisaggConfig:
    """Disaggregated prefill/decode (simulator only; testbed/sim/disaggregated.py): a prefill pool and a
    decode pool of replicas, the KV of each prefill sent over `link`. Off: the co-located run."""

    enabled: bool = field(default=False, metadata={
        "sim_only": "the engine and vLLM backends serve one co-located replica"})
    prefill: DisaggPoolConfig = field(default_factory=DisaggPoolConfig)
    decode: DisaggPoolConfig = field(default_factory=DisaggPoolConfig)
    link: KVLinkConfig = field(default_factory=KVLinkConfig)
    # testbed-disagg-search: the replicas split between the pools (null: prefill.replicas + decode.replicas)
    search_total_replicas: Optional[int] = bounded(None, ge=2, le=1024)
    search_rate_scales: list[float] = bounded(factory=list, gt=0)  # testbed-disagg-search: also run these loads


@dataclass
class TestbedConfig:
    trace: TraceConfig = MISSING
    policy: Any = MISSING
    router: Any = MISSING  # which replica each arrival joins (testbed/routers/); backend.replicas > 1 only
    model: ModelSpec = MISSING
    hardware: HardwareSpec = MISSING
    cost_model: CostModelConfig = MISSING
    slo: SLO = MISSING
    backend: BackendConfig = MISSING
    logger: LoggerConfig = MISSING
    frontend: FrontendConfig = MISSING  # the HTTP/API front end's delays (simulator only; none: the engine's own times)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    kv: KVConfig = field(default_factory=KVConfig)
    parallel: ParallelSpec = field(default_factory=ParallelSpec)  # tensor / pipeline parallel GPUs per replica
    output: OutputConfig = field(default_factory=OutputConfig)
    spec_decode: SpecDecodeConfig = field(default_factory=SpecDecodeConfig)  # speculative decoding (simulator only)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)  # the requests' sampling parameters
    capacity: CapacityConfig = field(default_factory=CapacityConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)  # testbed-profile's grid
    fidelity: FidelityConfig = field(default_factory=FidelityConfig)  # testbed-fidelity's repeats
    validate: ValidateConfig = field(default_factory=ValidateConfig)  # testbed-validate's real runs
    referee: RefereeConfig = field(default_factory=RefereeConfig)  # testbed-referee's reference
    disagg: DisaggConfig = field(default_factory=DisaggConfig)  # disaggregated prefill/decode pools (simulator)
    seed: int = bounded(0, ge=0)  # numpy and torch seeds are non-negative


def trace_name(default: str, path: Optional[str], default_path: Optional[str]) -> str:
    """The `trace_name` resolver: a trace group's own name while its path is the group's, else
    the stem of the file the user pointed it at (``trace.path=/data/day1.csv.gz`` -> ``day1``).

    Why: ``trace.kind=file trace.path=my.csv`` keeps every other key of the default group,
    its name included, and the summary, the table title and the output folder would all say
    the run replayed ``azure_conv``. A ``trace.name=...`` override still wins (it replaces
    the interpolation).
    """
    from testbed.traces.loaders import trace_stem

    if path is None or path == default_path:
        return default
    return trace_stem(path)


def register_configs() -> None:
    from testbed.app.assembly.plugins import load_policies, load_routers

    from testbed.app.entry.job_dirs import safe_dirname

    OmegaConf.register_new_resolver("trace_name", trace_name, replace=True)
    # a sweep job's folder from its overrides (conf/config.yaml: hydra.sweep.subdir); registered here, where every
    # process that runs a job registers it: the launchers' workers import the task function's module (testbed.app.entry.cli)
    OmegaConf.register_new_resolver("safe_dirname", safe_dirname, replace=True)
    from testbed.app.entry.command_help import template

    OmegaConf.register_new_resolver("testbed_help", template, replace=True)  # conf/config.yaml hydra.help
    cs = ConfigStore.instance()
    cs.store(name="testbed_schema", node=TestbedConfig)
    cs.store(group="trace", name="trace_schema", node=TraceConfig)
    cs.store(group="model", name="model_schema", node=ModelSpec)
    cs.store(group="hardware", name="hardware_schema", node=HardwareSpec)
    cs.store(group="cost_model", name="cost_model_schema", node=CostModelConfig)
    cs.store(group="slo", name="slo_schema", node=SLO)
    cs.store(group="backend", name="backend_schema", node=BackendConfig)
    cs.store(group="logger", name="logger_schema", node=LoggerConfig)
    cs.store(group="frontend", name="frontend_schema", node=FrontendConfig)
    for name, cls in load_policies().items():
        cs.store(group="policy", name=f"{name}_schema", node=cls.Knobs)
    cs.store(group="policy", name=f"{NATIVE_POLICY}_schema", node=VLLMNativeKnobs)  # vLLM's own scheduler
    for name, cls in load_routers().items():
        cs.store(group="router", name=f"{name}_schema", node=cls.Knobs)
