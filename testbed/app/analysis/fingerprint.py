"""A run's results as three content hashes, so that a change meant only to make the simulator
faster can be shown to leave every result bit-identical (`tests/test_bit_identity.py` on small
configurations, `experiments/benchmarks/bit_identity.py` on the large ones).

What is hashed is what a researcher reads: the summary, the per-request table and the per-step
table, every float by its exact bits. Left out, because they measure the simulator's own work and
not the simulated system: the summary's `num_events` (the SimPy events the run took, which event
cutting changes on purpose); and the provenance keys (`testbed.app.assembly.provenance`: which cost model,
tables and features produced the numbers), which the configuration fixes and which were added after
the references were recorded. The per-step table is compared in its coalesced form: a run of plain
decode steps is one row with `steps` > 1 when the simulator fast-forwarded it and several rows when
it planned each step, and both say the same thing; consecutive all-decode rows of one replica with the
same batch (running, waiting, decode tokens, no preemption, back to back) are merged into one row
that keeps the first row's start and KV blocks and the last row's end.
"""
from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

import numpy as np
import pandas as pd

from testbed.app.assembly.provenance import PROVENANCE_KEYS
from testbed.vllm_backend.native_sim import NATIVE_POLICY

NOT_RESULTS = ("num_events", *PROVENANCE_KEYS)


def summary_hash(summary: dict) -> str:
    kept = {k: v for k, v in summary.items() if k not in NOT_RESULTS}
    return _sha(json.dumps(kept, sort_keys=True, default=repr).encode())


def frame_hash(df: pd.DataFrame) -> str:
    """Column names, dtypes and every cell's bits (pandas' per-row hash, which is exact for floats)."""
    head = json.dumps([[str(c), str(t)] for c, t in df.dtypes.items()]).encode()
    rows = pd.util.hash_pandas_object(df, index=False).to_numpy()
    return _sha(head + rows.tobytes())


def coalesced_steps(steps: pd.DataFrame) -> pd.DataFrame:
    """The per-step table with back-to-back identical all-decode rows of one replica merged (see the
    module docstring); `end` replaces `duration`, exactly as the clock had it (start + duration)."""
    if steps.empty:
        return steps.assign(end=pd.Series(dtype=float)).drop(columns=["duration"])
    s = steps.reset_index(drop=True)
    end = (s["start"] + s["duration"]).to_numpy()
    decode = ((s["prefill_tokens"] == 0) & (s["preemptions"] == 0)).to_numpy()
    same = np.zeros(len(s), dtype=bool)
    cols = [c for c in ("replica", "running", "waiting", "decode_tokens") if c in s]
    same[1:] = (decode[1:] & decode[:-1] & (s["start"].to_numpy()[1:] == end[:-1])
                & np.all([s[c].to_numpy()[1:] == s[c].to_numpy()[:-1] for c in cols], axis=0))
    group = np.cumsum(~same)
    out = s.groupby(group, sort=False).agg(
        {**{c: "first" for c in s.columns if c not in ("duration", "steps")}, "steps": "sum"})
    out["end"] = pd.Series(end).groupby(group, sort=False).last().to_numpy()
    return out.reset_index(drop=True)


def result_hashes(summary: dict, requests: pd.DataFrame, steps: pd.DataFrame) -> dict[str, str]:
    return {"summary": summary_hash(summary), "requests": frame_hash(requests),
            "steps": frame_hash(coalesced_steps(steps))}


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def identity_configs(workdir, max_requests: int | None = None) -> dict[str, list[str]]:
    """The configurations a speed change must leave bit-identical, by name: every policy at 1x and 4x
    load, sixteen replicas at 16x under two routers, Mooncake with prefix ids (co-located and on four
    replicas by prefix affinity), closed-loop sessions, disaggregation, speculative decoding, async
    scheduling and the kernel cost model. `max_requests` cuts each trace (the test's small runs); the
    closed-loop sessions' trace is written into `workdir`."""
    from testbed.app.entry.cli import CONF_DIR

    cut = [] if max_requests is None else [f"trace.max_requests={max_requests}"]
    configs = {}
    # every policy but vllm_native, whose decisions are the installed vLLM's (its referee checks them)
    for policy in sorted(p.stem for p in (CONF_DIR / "policy").glob("*.yaml") if p.stem != NATIVE_POLICY):
        for load in (1, 4):
            configs[f"{policy}_{load}x"] = [f"policy={policy}", f"trace.rate_scale={load}"]
    mooncake = ["trace=mooncake", "model=llama3_1_8b"]
    configs.update({
        "replicas16_round_robin_16x": ["backend.replicas=16", "router=round_robin", "trace.rate_scale=16"],
        "replicas16_least_outstanding_16x": ["backend.replicas=16", "router=least_outstanding", "trace.rate_scale=16"],
        "mooncake_vllm": mooncake,
        "mooncake_sglang": [*mooncake, "policy=sglang"],
        "mooncake_replicas4_prefix_affinity": [*mooncake, "backend.replicas=4", "router=prefix_affinity",
                                               "trace.rate_scale=3"],
        "sessions_closed": ["trace=qwen_bailian", f"trace.path={write_session_trace(Path(workdir) / 'sessions.jsonl')}",
                            "trace.session_replay=closed", "backend.replicas=2", "router=session_affinity"],
        "disagg_70b": ["model=llama3_1_70b", "parallel.tensor_parallel_size=4", "disagg.enabled=true",
                       "disagg.prefill.replicas=2", "disagg.decode.replicas=2", "trace.rate_scale=4"],
        "spec_decode_draft": ["spec_decode.method=draft", "spec_decode.acceptance_rate=0.7"],
        "async_scheduling_2x": ["backend.async_scheduling=true", "trace.rate_scale=2"],
        "kernels_70b_tp4": ["cost_model=kernels", "model=llama3_1_70b", "parallel.tensor_parallel_size=4",
                            *KERNELS_AS_RECORDED],
    })
    return {name: [*_pinned(overrides), *cut] for name, overrides in configs.items()}


# The references were recorded under the defaults of their time: the roofline, Llama-3-8B, no front end, no async
# scheduling. The defaults have since become the validated configuration (conf/config.yaml); each configuration
# names the old ones it does not set itself, so its reference stays what it checks. kernels_70b_tp4 likewise names
# the kernel model's overhead values it was recorded with (cost_model/kernels.yaml is refitted from time to time).
OLD_DEFAULTS = {"model": "llama3_8b", "cost_model": "roofline", "frontend": "none", "backend.async_scheduling": "false"}
KERNELS_AS_RECORDED = ["cost_model.kernel_scale=1.006", "cost_model.step_overhead_s=0.0",
                       "cost_model.layer_overhead_s=2e-06", "cost_model.seq_overhead_s=2e-06",
                       "cost_model.allreduce_overhead_s=9.5e-06",
                       # recorded before the sampler and host-work terms (testbed/sim/sampler_cost.py, issue 23)
                       "cost_model.sampler=false", "cost_model.host_step_s=0", "cost_model.host_seq_s=0",
                       "cost_model.version_near=null"]  # the newest tables, as then


def _pinned(overrides: list[str]) -> list[str]:
    """`overrides` after the old defaults it does not set itself."""
    own = {o.split("=", 1)[0] for o in overrides}
    return [f"{k}={v}" for k, v in OLD_DEFAULTS.items() if k not in own] + overrides


def write_session_trace(path: Path, sessions: int = 400, turns: int = 4, seed: int = 0) -> Path:
    """A Qwen-Bailian session file (seeded): each turn's prompt is its parent's prompt and answer plus a
    new message, its hash ids extending the parent's, sessions starting 1.5 s apart, turns 20 s apart."""
    rng, rows, next_id = random.Random(seed), [], 0
    for s in range(sessions):
        parent, total, ids = -1, 0, []
        for k in range(turns):
            prompt = rng.randint(100, 800) if k == 0 else total + rng.randint(20, 200)
            out = rng.randint(20, 400)
            new = -(-prompt // 16) - len(ids[:total // 16])
            ids = ids[:total // 16] + list(range(next_id, next_id + new))
            next_id += new
            cid = s * turns + k
            rows.append({"chat_id": cid, "parent_chat_id": parent, "timestamp": round(s * 1.5 + k * 20.0, 3),
                         "input_length": prompt, "output_length": out, "type": "text", "turn": k + 1,
                         "hash_ids": ids})
            parent, total = cid, prompt + out
    rows.sort(key=lambda r: r["timestamp"])
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
