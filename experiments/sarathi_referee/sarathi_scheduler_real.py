"""Drive Sarathi-Serve's REAL scheduler (microsoft/sarathi-serve, commit 96f9911) step by step,
with no model, on every scenario of scenarios.json; write real_steps.jsonl (or diff against it).

    python experiments/sarathi_referee/sarathi_scheduler_real.py --src /work/src/sarathi          # rewrite
    python experiments/sarathi_referee/sarathi_scheduler_real.py --src /work/src/sarathi --check  # re-run, diff
    python experiments/sarathi_referee/sarathi_scheduler_real.py --scenario NAME                  # one, printed

`--src` (default $SARATHI_SRC) is a checkout of the repository (the folder holding `sarathi/`).
Nothing of Sarathi-Serve is copied here. Real (imported from --src and run unchanged):
SarathiScheduler (core/scheduler/sarathi_scheduler.py), BaseScheduler (base_scheduler.py), the
FCFS policy (core/policy.py), SarathiBlockSpaceManager / VLLMBlockSpaceManager /
BaseBlockSpaceManager / BlockAllocator (core/block_space_manager/), Sequence, SequenceStatus,
SequenceScheduleMetadata, SamplerOutput, SchedulerOutputs, SamplingParams (core/datatypes/),
BaseSequenceManager's on_schedule / on_step_completed (core/sequence_manager/
base_sequence_manager.py), CacheConfig, ParallelConfig, SarathiSchedulerConfig (config/config.py).
Stubs (see README): the `sarathi` and `sarathi.utils` package __init__s are not run, the metrics
store module, the ModelConfig (only max_model_len is read), and the two abstract methods of the
sequence manager that only serve the model (block table for workers, detokenization).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import types

HERE = os.path.dirname(os.path.abspath(__file__))
SAMPLED = 1000  # the token every "sampling" returns (ignore_eos is on, so its value never matters)
MAX_MODEL_LEN = 100_000  # prompt limit (base_scheduler.py:44, 124-132): never binding here


def bootstrap(src: str) -> None:
    """Make sarathi's scheduling modules importable without the engine, GPU or metrics stack."""
    pkg = os.path.join(src, "sarathi")
    assert os.path.isdir(os.path.join(pkg, "core", "scheduler")), f"no sarathi/ package under {src}"
    sys.path.insert(0, src)

    def package(name, path):  # a package whose __init__ is not run (its submodules are real)
        mod = types.ModuleType(name)
        mod.__path__ = [path]
        sys.modules[name] = mod
        return mod

    # sarathi/__init__.py imports the engine (zmq, workers, model executor): not run
    package("sarathi", pkg)
    # sarathi/utils/__init__.py imports psutil for GPU/host helpers: not run; the submodules
    # the scheduler reaches (base_registry, threading_utils, hf_utils) are the real ones
    package("sarathi.utils", os.path.join(pkg, "utils"))
    # metrics store (pandas, plotly, wandb): BaseScheduler only keeps the instance (base_scheduler.py:26)
    metrics = package("sarathi.metrics", os.path.join(pkg, "metrics"))
    store = types.ModuleType("sarathi.metrics.metrics_store")

    class MetricsStore:  # stub
        @classmethod
        def get_instance(cls):
            return None

    store.MetricsStore = MetricsStore
    sys.modules["sarathi.metrics.metrics_store"] = store
    metrics.metrics_store = store


class Driver:
    """One scenario: the real scheduler and sequence manager, stepped as LLMEngine.step does."""

    def __init__(self, sc: dict):
        from sarathi.config import CacheConfig, ParallelConfig, SarathiSchedulerConfig
        from sarathi.core.datatypes.sequence import SamplerOutput, Sequence
        from sarathi.core.datatypes.sampling_params import SamplingParams
        from sarathi.core.scheduler.sarathi_scheduler import SarathiScheduler
        from sarathi.core.sequence_manager.base_sequence_manager import BaseSequenceManager

        assert sc.get("watermark", 0.01) == 0.01, "Sarathi-Serve never passes a watermark (base_scheduler.py:38-43)"

        class SeqManager(BaseSequenceManager):
            """The engine's EngineSequenceManager less what serves the model only: block tables
            are for workers, _on_append_token detokenizes (engine_sequence_manager.py:21-45)."""

            def _get_block_table(self, seq):
                return []

            def _on_append_token(self, seq):
                pass

        self.SamplerOutput, self.Sequence, self.SamplingParams = SamplerOutput, Sequence, SamplingParams
        self.sc = sc
        model = types.SimpleNamespace(max_model_len=MAX_MODEL_LEN)  # stub ModelConfig (no HF config load)
        cache = CacheConfig(block_size=sc["block_size"], num_gpu_blocks=sc["num_blocks"])
        parallel = ParallelConfig(pipeline_parallel_size=1, tensor_parallel_size=1)
        sched = SarathiSchedulerConfig(max_num_seqs=sc["max_num_seqs"], chunk_size=sc["chunk_size"])
        self.scheduler = SarathiScheduler(model, sched, cache, parallel)
        assert self.scheduler.block_manager.get_num_free_gpu_blocks() == sc["num_blocks"]
        self.seq_manager = SeqManager(None)
        self.seqs = {}

    def add(self, r: dict) -> None:
        # LLMEngine.add_request (engine/base_llm_engine.py:292-346): a Sequence to both the
        # sequence manager and the scheduler's waiting queue; ignore_eos so max_tokens decides
        seq = self.Sequence(str(r["id"]), None, [7] * r["prompt_len"], self.sc["block_size"], -1,
                            float(r["arrival_step"]),
                            self.SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=r["output_len"]))
        seq.ref_prompt_len, seq.ref_output_len = r["prompt_len"], r["output_len"]
        self.seqs[seq.seq_id] = seq
        self.seq_manager.add_seq(seq)
        self.scheduler.add_seq(seq)

    def step(self):
        """LLMEngine.step (engine/base_llm_engine.py:368-406) with the model's part replaced by
        one sampled token per scheduled sequence (the sequence manager drops it for a partial
        prefill chunk, base_sequence_manager.py:100-101)."""
        out = self.scheduler.schedule()
        tokens = {m.seq_id: max(m.prompt_chunk_len, 1) for m in out.scheduled_seq_metadata_list}
        preempted = list(out.preempted_seq_ids)
        if out.is_empty():  # base_llm_engine.py:381-382: no on_schedule, no on_step_completed
            return tokens, preempted, out
        self.seq_manager.on_schedule(out)  # preempted -> reset_for_recompute (bsm:70-71)
        for sid in preempted:
            # GLUE (the stop rule): Sarathi counts max_tokens from the reset (sequence.py:181-182,
            # 195), so a recomputed request would generate output_len tokens more; the testbed's
            # requests stop at output_len tokens in all, so the rest is what it may still make
            seq = self.seqs[sid]
            seq.sampling_params.max_tokens = seq.ref_output_len - (seq.get_len() - seq.ref_prompt_len)
        samples = [self.SamplerOutput(m.seq_id, SAMPLED) for m in out.scheduled_seq_metadata_list]
        self.seq_manager.on_step_completed(out, samples)  # base_llm_engine.py:270-273
        self.scheduler.on_step_completed()  # base_llm_engine.py:274: frees finished sequences
        return tokens, preempted, out


def run(sc: dict, max_steps: int = 3000) -> dict:
    d = Driver(sc)
    pending = sorted(sc["requests"], key=lambda r: (r["arrival_step"], r["id"]))
    steps, step, hang = [], 0, None
    last_arrival = max(r["arrival_step"] for r in pending)
    while pending or d.scheduler.has_unfinished_seqs():
        while pending and pending[0]["arrival_step"] <= step:
            d.add(pending.pop(0))
        tokens, preempted, out = d.step()
        if tokens or preempted:
            steps.append({"step": step, "tokens": tokens, "preempted": preempted,
                          "free_blocks": d.scheduler.block_manager.get_num_free_gpu_blocks(),
                          "waiting": [s.seq_id for s in d.scheduler.waiting],
                          "finished": sorted(s.seq_id for s in d.seqs.values() if s.is_finished())})
        elif step >= last_arrival and d.scheduler.has_unfinished_seqs():
            # nothing scheduled and nothing will arrive: Sarathi-Serve schedules nothing again
            # (the scheduler's state does not change between empty steps)
            hang = {"step": step, "running": [s.seq_id for s in d.scheduler.running],
                    "waiting": [s.seq_id for s in d.scheduler.waiting]}
            break
        step += 1
        assert step < max_steps, f"{sc['name']}: not finished after {max_steps} steps"
    return {"name": sc["name"], "hang": hang, "steps": steps}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--src", default=os.environ.get("SARATHI_SRC"),
                    help="checkout of microsoft/sarathi-serve at 96f9911 (default $SARATHI_SRC)")
    ap.add_argument("--check", action="store_true", help="re-run and diff against real_steps.jsonl")
    ap.add_argument("--scenario", help="run one scenario and print its steps")
    args = ap.parse_args()
    if not args.src:
        ap.error("give --src or set SARATHI_SRC")
    bootstrap(args.src)
    with open(os.path.join(HERE, "scenarios.json")) as f:
        scenarios = json.load(f)
    if args.scenario:
        res = run(next(s for s in scenarios if s["name"] == args.scenario))
        for s in res["steps"]:
            print(json.dumps(s))
        print("hang:", res["hang"])
        return
    results = [run(sc) for sc in scenarios]
    lines = [json.dumps(r, separators=(",", ":")) for r in results]
    path = os.path.join(HERE, "real_steps.jsonl")
    n_steps = sum(len(r["steps"]) for r in results)
    n_pre = sum(len(s["preempted"]) for r in results for s in r["steps"])
    summary = f"{len(results)} scenarios, {n_steps} non-idle steps, {n_pre} preemptions, " \
              f"{sum(1 for r in results if r['hang'])} hang"
    if args.check:
        with open(path) as f:
            old = [line.rstrip("\n") for line in f if line.strip()]
        bad = [r["name"] for r, a, b in zip(results, lines, old) if a != b]
        if bad or len(old) != len(lines):
            print("DIFFERENT:", bad, f"({len(old)} recorded, {len(lines)} now)")
            sys.exit(1)
        print("identical to real_steps.jsonl:", summary)
        return
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("wrote", path, ":", summary)


if __name__ == "__main__":
    main()
