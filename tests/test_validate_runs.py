"""testbed-validate: real runs read back, their workload rebuilt, the simulator scored and fitted.

The fixtures are written here in inference-perf's format (the calibration runs themselves may
not be copied into the project). The fit test makes its "real" runs with the simulator at known
overheads and checks that the fit finds them again from other starting values, on a model it
did not fit on (leave-one-model-out).
"""
from __future__ import annotations

import contextlib

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from testbed.app.entry.cli import CONF_DIR
from testbed.app.analysis.real_runs import MEASURED, RealRunError, load_run, load_run_sets, load_runs
from testbed.app.analysis import validate_fit
from testbed.app.analysis import validate_runs as V
from testbed.app.analysis.inference_perf import client_figures, messages_per_token, pooled_percentiles
from testbed.app.analysis.validate_replay import RunReplay, StageResult
from testbed.app.analysis.validate_report import by_model
from testbed.traces.shared_prefix import shared_prefix_requests

SMALL = {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 8, "num_attention_heads": 16,
         "num_key_value_heads": 4, "vocab_size": 32000, "max_position_embeddings": 4096}
SMALLER = dict(SMALL, hidden_size=768, num_hidden_layers=6, num_attention_heads=12, num_key_value_heads=12)


def write_run(root: Path, name: str, model_id: str, model_cfg: dict, stages: list[tuple[float, float]],
              measured: list[dict] | None = None, tp: int = 1, whole: dict | None = None) -> Path:
    d = root / name
    (d / "results").mkdir(parents=True)
    (d / "exp-config.yaml").write_text(yaml.safe_dump(
        {"model": model_id, "tensor_parallelism": tp, "max_model_len": 4096, "max_num_batched_tokens": 2048,
         "max_num_seqs": 64}))
    (d / "results" / "config.yaml").write_text(yaml.safe_dump(
        {"data": {"type": "shared_prefix", "shared_prefix": {"num_groups": 4, "num_prompts_per_group": 5,
                                                             "system_prompt_len": 100, "question_len": 300,
                                                             "output_len": 60}},
         "load": {"stages": [{"rate": r, "duration": t} for r, t in stages]}}))
    for i, (rate, dur) in enumerate(stages):
        m = (measured or [{}] * len(stages))[i]
        n = round(rate * dur)
        (d / "results" / f"stage_{i}_lifecycle_metrics.json").write_text(json.dumps({
            "load_summary": {"count": n, "achieved_rate": rate},
            "successes": {"count": n, "throughput": {"requests_per_sec": rate},
                          "prompt_len": {"mean": m.get("prompt_len", 420.0)}, "latency": latency(m)},
            "failures": {"count": m.get("failed", 0)}}))
    if whole is not None:
        (d / "results" / "summary_lifecycle_metrics.json").write_text(json.dumps({
            "load_summary": {"count": 1}, "successes": {"count": 1, "latency": latency(whole)}}))
    cfgdir = root / "model_configs" / model_id.rsplit("/", 1)[-1]
    cfgdir.mkdir(parents=True, exist_ok=True)
    (cfgdir / "config.json").write_text(json.dumps(model_cfg))
    return d


def latency(m: dict) -> dict:
    """A lifecycle file's `successes.latency` from figures named as `real_runs.MEASURED` names them."""
    out = {"time_to_first_token": {"mean": m.get("ttft", 0.02)}, "request_latency": {"mean": m.get("e2e", 1.0)}}
    for name, (kind, stat) in MEASURED.items():
        if name in m and name not in ("ttft", "e2e"):
            out.setdefault(kind, {})[stat] = m[name]
    return out


def config(*overrides: str):
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def test_a_run_folder_reads_back(tmp_path):
    write_run(tmp_path, "r1", "org/Small-1b", SMALL, [(4.0, 20.0), (8.0, 10.0)],
              [{"ttft": 0.03, "e2e": 1.5}, {"ttft": 0.05, "e2e": 2.0, "failed": 3}])
    run, = load_runs(tmp_path)
    assert run.model_name == "Small-1b" and run.model_config == tmp_path / "model_configs/Small-1b/config.json"
    assert [s.rate for s in run.stages] == [4.0, 8.0] and run.workload.output_len == 60
    assert run.stages[0].mean_e2e_s == 1.5 and not run.stages[0].overloaded
    assert run.stages[1].overloaded  # requests failed


def test_a_missing_key_names_the_file_and_the_key(tmp_path):
    d = write_run(tmp_path, "r1", "org/Small-1b", SMALL, [(4.0, 20.0)])
    f = d / "results" / "stage_0_lifecycle_metrics.json"
    good = f.read_text()
    data = json.loads(good)
    del data["successes"]["latency"]["time_to_first_token"]
    f.write_text(json.dumps(data))
    with pytest.raises(RealRunError, match="stage_0_lifecycle_metrics.json.*time_to_first_token"):
        load_run(d)
    f.write_text(good)
    (d / "exp-config.yaml").write_text("model: org/Small-1b\n")
    with pytest.raises(RealRunError, match="exp-config.yaml: missing key 'max_model_len'"):
        load_run(d)


def test_text_where_a_number_belongs_names_the_file_the_key_and_the_value(tmp_path):
    """It once said only "could not convert string to float"."""
    d = write_run(tmp_path, "r1", "org/Small-1b", SMALL, [(4.0, 20.0)])
    f = d / "results" / "stage_0_lifecycle_metrics.json"
    good = f.read_text()
    data = json.loads(good)
    data["successes"]["latency"]["request_latency"]["mean"] = "fast"
    f.write_text(json.dumps(data))
    with pytest.raises(RealRunError, match=r"stage_0_lifecycle_metrics.json: key 'successes.latency.request_latency.mean': "
                                           r"expected a number, got 'fast'"):
        load_run(d)
    f.write_text(good)
    exp = d / "exp-config.yaml"
    exp.write_text(exp.read_text().replace("max_num_seqs:", "max_num_seqs: lots #"))
    with pytest.raises(RealRunError, match=r"exp-config.yaml: key 'max_num_seqs': expected an integer, got 'lots'"):
        load_run(d)


def test_the_shared_prefix_workload_is_rebuilt():
    reqs, starts = shared_prefix_requests(num_groups=3, prompts_per_group=4, system_prompt_len=100, question_len=250,
                                          output_len=50, stages=[(5.0, 10.0), (10.0, 10.0)], prompt_scale=1.04,
                                          stage_gap_s=30.0)
    assert starts == [0, 50] and len(reqs) == 150
    assert all(r.prompt_len == 104 + 260 and r.output_len == 50 for r in reqs)
    first, second = reqs[:50], reqs[50:]
    assert max(r.arrival for r in first) < 10.0 <= min(r.arrival for r in second) - 30.0
    assert reqs[3].prefix_hashes == reqs[15].prefix_hashes  # prompt i mod 12, the whole text again
    by_group: dict[int, set] = {}
    for r in reqs[:12]:
        by_group.setdefault(r.prefix_hashes[0], set()).add(r.prefix_hashes[1:])
    assert len(by_group) == 3 and all(len(qs) == 4 for qs in by_group.values())  # 3 system prompts, 4 questions each


def test_validate_fits_known_overheads_and_scores_a_model_it_did_not_see(tmp_path):
    """'Real' runs made by the simulator at a known step overhead are replayed from another
    starting value: the fit must find the overhead, and each model's held-out error must vanish."""
    truth = {"hardware.step_overhead_s": 0.004}
    specs = [("r-small", "org/Small-1b", SMALL), ("r-smaller", "org/Smaller-1b", SMALLER)]
    for name, mid, mc in specs:
        write_run(tmp_path, name, mid, mc, [(4.0, 20.0), (12.0, 10.0)])
    cfg = config("cost_model=roofline", f"validate.runs={tmp_path}", f"output.dir={tmp_path / 'out'}", "validate.jobs=1",
                 "validate.stage_gap_s=20", "validate.drain_s=60",
                 "validate.fit=[hardware.step_overhead_s]", "hardware.step_overhead_s=0.001")
    for (name, mid, mc), run in zip(specs, load_runs(tmp_path)):
        made = V.simulate_run(cfg, run, truth)
        write_run(tmp_path / "again", name, mid, mc, [(4.0, 20.0), (12.0, 10.0)],
                  [{"ttft": s.sim["ttft"], "e2e": s.sim["e2e"], "prompt_len": 420.0} for s in made.stages])
    cfg.validate.runs = str(tmp_path / "again")
    report = V.validate(cfg)
    assert report["fitted_on_all_models"]["hardware.step_overhead_s"] == pytest.approx(0.004, rel=0.05)
    for values in report["fitted_without_model"].values():
        assert values["hardware.step_overhead_s"] == pytest.approx(0.004, rel=0.05)
    errors = report["leave_one_model_out_median_abs_error"]
    assert max(errors[m] for m in ("ttft", "e2e", "tpot")) < 0.03
    md = (tmp_path / "out" / "validate.md").read_text()
    assert "leave-one-model-out median absolute error" in md and "r-smaller" in md
    # from the wrong starting value, without a fit, the same runs are off by more
    cfg.validate.fit = []
    assert max(V.validate(cfg)["median_abs_error"][m] for m in ("ttft", "e2e", "tpot")) > 0.02


def test_the_fit_in_parallel_gives_the_values_of_the_fit_in_one_process(tmp_path):
    """The replays run in a pool, each fit advancing as soon as its own are done (`run_fits`): the
    order they finish in may differ from one process's, the fitted values and the scores may not."""
    for name, mid, mc, ttft in [("r-a", "org/A-1b", SMALL, 0.05), ("r-b", "org/A-1b", SMALL, 0.08),
                                ("r-c", "org/B-1b", SMALLER, 0.03), ("r-d", "org/C-1b", SMALLER, 0.04)]:
        write_run(tmp_path / "runs", name, mid, mc, [(4.0, 10.0), (8.0, 5.0)],
                  [{"ttft": ttft, "e2e": 0.9, "prompt_len": 420.0}, {"ttft": 2 * ttft, "e2e": 1.1, "prompt_len": 420.0}])
    out = {}
    for jobs in (1, 2):
        cfg = config("cost_model=roofline", f"validate.runs={tmp_path / 'runs'}", f"output.dir={tmp_path / str(jobs)}",
                     f"validate.jobs={jobs}", "validate.stage_gap_s=10", "validate.drain_s=30",
                     "validate.fit=[hardware.step_overhead_s,frontend.request_s]", "validate.fit_iterations=2",
                     "hardware.step_overhead_s=0.001", "frontend.request_s=0.01")
        out[jobs] = V.validate(cfg), pd.read_csv(tmp_path / str(jobs) / "validate.csv")
    (one, csv_one), (two, csv_two) = out[1], out[2]
    assert set(two["fitted_without_model"]) == {"A-1b", "B-1b", "C-1b"}
    for key in ("fitted_on_all_models", "fitted_without_model", "fit", "replays"):
        assert two[key] == one[key], key  # exactly: the same replays, sent to each fit in the same order
    assert one["fitted_on_all_models"] != {"hardware.step_overhead_s": 0.001, "frontend.request_s": 0.01}  # it moved
    pd.testing.assert_frame_equal(csv_two, csv_one, check_exact=True)


# --- the load generator's figures (testbed/app/analysis/inference_perf.py) ------------------------------------------

def literal_figures(arrival: list[float], ttft: list[float], e2e: list[float], token_times: list[list[float]],
                    per_token: int) -> dict:
    """inference-perf's own arithmetic on the stamps a client would take (reportgen/base.py:279-294): each
    token stamped `per_token` times at its delivery, then the usage message and [DONE] at the response's end."""
    itl, tpot = [], []
    for a, t0, e, times in zip(arrival, ttft, e2e, token_times):
        first = a + t0
        stamps = [first + (t - times[0]) for t in times for _ in range(per_token)] + [a + e] * 2
        tpot.append((stamps[-1] - stamps[0]) / (len(stamps) - 1))
        itl += [b - a for a, b in zip(stamps, stamps[1:])]
    return {"itl": np.mean(itl), "itl_p90": np.percentile(itl, 90), "itl_p99": np.percentile(itl, 99),
            "stream_tpot": np.mean(tpot), "ttft": np.mean(ttft), "e2e": np.mean(e2e),
            "ttft_p99": np.percentile(ttft, 99), "e2e_p90": np.percentile(e2e, 90)}


def test_client_figures_are_the_load_generators_arithmetic_on_stamped_messages():
    rng = np.random.default_rng(1)
    token_times, ttft, e2e, arrival, n_out = [], [], [], [], []
    for i in range(40):
        n = int(rng.integers(2, 30))
        times = np.cumsum(rng.uniform(0.005, 0.02, n)) + i * 0.3
        token_times.append(times.tolist())
        arrival.append(i * 0.3 - 0.05)
        ttft.append(times[0] - arrival[-1] + 0.001)  # delivered 1 ms after the engine made it
        e2e.append(ttft[-1] + times[-1] - times[0] + (0.002 if i % 3 == 0 else 0.0))  # some with a completion gap
        n_out.append(n)
    rows = pd.DataFrame({"ttft_ms": np.array(ttft) * 1e3, "e2el_ms": np.array(e2e) * 1e3, "output_len": n_out})
    rows["token_times"] = pd.Series(token_times, dtype=object)
    for per_token in (1, 2, 3):
        got = client_figures(rows, per_token)
        want = literal_figures(arrival, ttft, e2e, token_times, per_token)
        for key, v in want.items():
            assert got[key] == pytest.approx(v, rel=1e-9, abs=1e-12), (per_token, key)
    assert "itl" not in client_figures(rows, None)  # without the stamp count, no per-token figure
    assert client_figures(rows.drop(columns="token_times"), 2).keys() >= {"itl", "stream_tpot"}


def test_pooled_percentiles_equal_numpys_on_the_pooled_array():
    rng = np.random.default_rng(2)
    for zeros in (0, 3, 50, 400):
        values = rng.exponential(1.0, 100)
        qs = (0, 10, 50, 89.5, 90, 99, 100)
        pooled = np.concatenate([values, np.zeros(zeros)])
        assert pooled_percentiles(values, zeros, qs) == pytest.approx(np.percentile(pooled, qs), rel=1e-12, abs=1e-15)
    assert all(np.isnan(pooled_percentiles(np.array([]), 0, (50,))))


def test_messages_per_token_read_off_a_stages_means():
    # Llama-2-7B codegen stage 0 of the H100 runs: E2E 1.8103 s, TTFT 25.04 ms, time_per_output_token 3.6027 ms,
    # 247 tokens: 496 stamps per request = 2 per token + the usage message and [DONE]
    assert messages_per_token({"e2e": 1.8103224, "ttft": 0.0250366, "stream_tpot": 0.0036027}, 247) == 2
    assert messages_per_token({"e2e": 1.0, "ttft": 0.02, "stream_tpot": 0.98 / 60}, 60) == 1
    assert messages_per_token({"e2e": 1.0, "ttft": 0.02}, 60) is None  # the run reports no time_per_output_token


# --- reading tails, ITL and whole runs; several folders ---------------------------------------------------

def test_a_run_reads_its_tails_its_itl_and_its_whole_run(tmp_path):
    stage = {"ttft": 0.03, "ttft_p90": 0.04, "ttft_p99": 0.05, "e2e": 1.5, "e2e_p99": 1.9, "itl": 0.004,
             "itl_p90": 0.009, "itl_p99": 0.011, "stream_tpot": 0.004}
    write_run(tmp_path / "a", "r1", "org/Small-1b", SMALL, [(4.0, 20.0)], [stage], whole=dict(stage, e2e=1.6))
    write_run(tmp_path / "b", "r2", "org/Small-1b", SMALL, [(4.0, 20.0)])
    r1, r2 = load_run_sets([tmp_path / "a", tmp_path / "b"])
    assert dict(r1.stages[0].measured) == stage
    assert r1.whole["e2e"] == 1.6 and r1.whole["itl_p99"] == 0.011
    assert r2.whole is None and set(r2.stages[0].measured) == {"ttft", "e2e"}  # only what the file has
    assert [r.name for r in load_run_sets(str(tmp_path / "a"))] == ["r1"]
    write_run(tmp_path / "c", "r1", "org/Small-1b", SMALL, [(4.0, 20.0)])
    with pytest.raises(RealRunError, match="two runs named 'r1'"):
        load_run_sets([tmp_path / "a", tmp_path / "c"])
    f = tmp_path / "a" / "r1" / "results" / "summary_lifecycle_metrics.json"
    data = json.loads(f.read_text())
    del data["successes"]["latency"]["request_latency"]["mean"]
    f.write_text(json.dumps(data))
    with pytest.raises(RealRunError, match="summary_lifecycle_metrics.json: missing key 'mean'"):
        load_run(tmp_path / "a" / "r1")


def test_validate_scores_tails_itl_and_whole_runs_from_several_folders(tmp_path):
    """'Real' runs made by the simulator itself: every figure, per stage and whole run, comes back with
    no error; a run without a summary says its whole run is not available; two folders in one command."""
    stages = [(4.0, 20.0), (12.0, 10.0)]
    cfg = config(f"output.dir={tmp_path / 'out'}", "validate.jobs=1", "validate.stage_gap_s=20",
                 "validate.drain_s=60")
    # the stamp count is read off the real means: 2 per token (+ 2), as on the H100 runs
    first = [{"ttft": 0.02, "e2e": 1.0, "stream_tpot": 0.98 / (2 * 60 + 1)}] * 2
    write_run(tmp_path / "seed", "r-small", "org/Small-1b", SMALL, stages, first,
              whole={"ttft": 0.02, "e2e": 1.0, "stream_tpot": 0.98 / (2 * 60 + 1)})
    made = V.simulate_run(cfg, load_run(tmp_path / "seed" / "r-small"))
    assert [s.messages_per_token for s in made.stages] == [2, 2] and made.whole.messages_per_token == 2
    keep = ("ttft", "ttft_p50", "ttft_p90", "ttft_p99", "e2e", "e2e_p50", "e2e_p90", "e2e_p99", "itl", "itl_p90",
            "itl_p99", "stream_tpot")
    figures = [dict({k: s.sim[k] for k in keep}, prompt_len=420.0) for s in made.stages]
    write_run(tmp_path / "one", "r-small", "org/Small-1b", SMALL, stages, figures,
              whole={k: made.whole.sim[k] for k in keep})
    write_run(tmp_path / "two", "r-smaller", "org/Smaller-1b", SMALLER, stages)
    cfg.validate.runs = [str(tmp_path / "one"), str(tmp_path / "two")]
    report = V.validate(cfg)
    small = {m: v for m, v in report["by_model"]["per_model"]["Small-1b"].items()}
    assert max(small.values()) < 1e-9  # every metric, tails and ITL included
    assert max(report["whole_run_median_abs_error"].values()) < 1e-9 and report["whole_runs_scored"] == 1
    assert report["whole_runs_missing"] == ["r-smaller"]
    assert np.isnan(report["by_model"]["per_model"]["Smaller-1b"]["itl"])  # that run reports no ITL
    md = (tmp_path / "out" / "validate.md").read_text()
    for heading in ("the client's p50, p90 and p99", "inter-token latency as the load generator defines it",
                    "Whole runs", "not available (no summary_lifecycle_metrics.json): r-smaller",
                    "median of models", "worst model"):
        assert heading in md
    csv = pd.read_csv(tmp_path / "out" / "validate.csv")
    assert len(csv) == 5 and csv["stage"].isna().sum() == 1  # 4 stages and one whole run


def test_by_model_gives_each_models_median_and_the_median_and_worst_model():
    def res(model: str, err: float, overloaded: bool = False) -> StageResult:
        real = {"ttft": 1.0, "e2e": 1.0, "tpot": 1.0, "e2e_p99": 1.0}
        return StageResult("run", model, 0, 1.0, overloaded, False, real, {k: 1.0 + err for k in real})
    results = [res("a", 0.01), res("a", 0.03), res("a", 0.5, overloaded=True), res("b", -0.10), res("c", 0.02)]
    bm = by_model(results)
    assert bm["per_model"]["a"]["e2e"] == pytest.approx(0.02)  # its overloaded stage is not scored
    assert bm["median_of_models"]["e2e_p99"] == pytest.approx(0.02)  # of 0.02, 0.10, 0.02
    assert bm["worst_model"]["ttft"] == {"error": pytest.approx(0.10), "model": "b"}
    assert np.isnan(bm["median_of_models"]["itl"]) and bm["worst_model"]["itl"]["model"] is None


# --- the fit: replays shared across fits, Broyden's updates against Gauss-Newton ----------------------------

TRUTH = {"hardware.step_overhead_s": 0.004, "frontend.request_s": 0.010}


def fake_replay(calls: list):
    """A stand-in for `simulate_run` whose relative errors are known smooth (non-linear) functions of the
    two keys, different per run and metric, zero at TRUTH; it records every (run, values) it is asked."""
    def simulate(cfg, run, values=None, stop=None):
        calls.append((run.name, tuple(sorted((values or {}).items()))))
        v = {**{k: float(OmegaConf.select(cfg, k)) for k in TRUTH}, **(values or {})}
        a = (v["hardware.step_overhead_s"] - TRUTH["hardware.step_overhead_s"]) / TRUTH["hardware.step_overhead_s"]
        b = (v["frontend.request_s"] - TRUTH["frontend.request_s"]) / TRUTH["frontend.request_s"]
        j = 1 + int(run.name[-1])
        err = {"ttft": 0.1 * j * a + 0.3 * b + 0.05 * a * a, "e2e": 0.2 * a + 0.02 * j * b + 0.03 * a * b,
               "tpot": 0.25 * a + 0.01 * b * b}
        stages = []
        for k, st in enumerate(run.stages):
            real = {"ttft": st.mean_ttft_s, "e2e": st.mean_e2e_s, "tpot": 1.0}
            stages.append(StageResult(run.name, run.model_name, k, st.rate, st.overloaded, False, real,
                                      {m: real[m] * (1 + err[m] * (1 + 0.1 * k)) for m in real}))
        return RunReplay(stages, None)
    return simulate


def fit_fixture(tmp_path: Path) -> list:
    for i, (mid, mc) in enumerate([("org/A-1b", SMALL), ("org/A-1b", SMALL), ("org/B-1b", SMALLER),
                                   ("org/C-1b", SMALLER)]):
        write_run(tmp_path, f"run{i}", mid, mc, [(4.0, 20.0), (8.0, 10.0)])
    return load_runs(tmp_path)


@pytest.mark.parametrize("method", ["broyden", "newton"])
def test_the_fit_finds_known_values_from_elsewhere(tmp_path, monkeypatch, method):
    calls: list = []
    monkeypatch.setattr(validate_fit, "simulate_run", fake_replay(calls))
    runs = fit_fixture(tmp_path)
    cfg = config("validate.jobs=1", f"validate.fit_method={method}", "validate.fit_iterations=8",
                 "hardware.step_overhead_s=0.006", "frontend.request_s=0.004")
    replays = validate_fit.Replays(cfg)
    done = validate_fit.fit(cfg, replays, runs, list(TRUTH))
    for k, v in TRUTH.items():
        assert done.values[k] == pytest.approx(v, rel=1e-3)
    assert done.cost < 1e-6 * done.start_cost
    assert len(calls) == len(set(calls)) == replays.simulated  # no (run, values) simulated twice


def test_broyden_needs_fewer_replays_than_gauss_newton_for_the_same_fit(tmp_path, monkeypatch):
    runs = fit_fixture(tmp_path)
    out = {}
    for method in ("broyden", "newton"):
        calls: list = []
        monkeypatch.setattr(validate_fit, "simulate_run", fake_replay(calls))
        cfg = config("validate.jobs=1", f"validate.fit_method={method}", "validate.fit_iterations=3",
                     "hardware.step_overhead_s=0.006", "frontend.request_s=0.004")
        replays = validate_fit.Replays(cfg)
        out[method] = (validate_fit.fit(cfg, replays, runs, list(TRUTH)), replays.simulated)
    (broyden, n_b), (newton, n_n) = out["broyden"], out["newton"]
    assert n_b < n_n  # 4 runs x (1 + 2 keys + 3 steps) against 4 x (1 + 3 x 2 keys + 3 steps)
    assert broyden.jacobians == 1 and newton.jacobians == 3
    for k in TRUTH:
        assert broyden.values[k] == pytest.approx(newton.values[k], rel=0.02)


def test_leave_one_model_out_fits_share_every_replay_they_have_in_common(tmp_path, monkeypatch):
    """All fits start at the config's values and step alike there: the start and its Jacobian are
    simulated once per run for the fit on all models and the three fits without one."""
    calls: list = []
    monkeypatch.setattr(validate_fit, "simulate_run", fake_replay(calls))
    fit_fixture(tmp_path)
    cfg = config(f"validate.runs={tmp_path}", f"output.dir={tmp_path / 'out'}", "validate.jobs=1",
                 "validate.fit=[hardware.step_overhead_s,frontend.request_s]", "validate.fit_iterations=3",
                 "hardware.step_overhead_s=0.006", "frontend.request_s=0.004")
    report = V.validate(cfg)
    assert len(calls) == len(set(calls)) == report["replays"]["simulated"] < report["replays"]["asked"]
    start = (("frontend.request_s", 0.004), ("hardware.step_overhead_s", 0.006))
    assert sum(values == start for _, values in calls) == 4  # each run's start: once, for four fits
    moved = [values for _, values in calls if values != start and
             sum(a != b for (_, a), (_, b) in zip(values, start)) == 1 and
             any(abs(a - b * 1.1) < 1e-15 for (_, a), (_, b) in zip(values, start))]
    assert len(moved) == 4 * 2  # the finite differences at the start: once per run and key
    for m in ("ttft", "e2e", "tpot"):
        assert report["leave_one_model_out_median_abs_error"][m] < 1e-3
    assert set(report["fitted_without_model"]) == {"A-1b", "B-1b", "C-1b"}


class CurveReplays(validate_fit.Replays):
    """`Replays` of one run whose TTFT and E2E errors follow a saturating curve of one key `k`
    (zero at k = 1): far from 1 a linearisation overshoots, and the slope changes along a step."""

    def __init__(self):
        super().__init__(OmegaConf.create({"validate": {"jobs": 1}}))

    def _simulate(self, run, values):
        e = np.arctan(3 * (values["k"] - 1))
        real = {"ttft": 1.0, "e2e": 1.0, "tpot": 1.0}
        return RunReplay([StageResult("r", "m", 0, 1.0, False, False, real,
                                      {"ttft": 1 + e, "e2e": 1 + 0.5 * e, "tpot": 1.0})], None)


@pytest.mark.parametrize("start", [0.2, 5.0])
def test_an_overshooting_step_is_shortened_and_a_stale_jacobian_refreshed(tmp_path, start):
    run, = fit_fixture(tmp_path)[:1]
    cfg = OmegaConf.create({"k": start, "validate": {"fit_method": "broyden", "fit_iterations": 12,
                                                     "fit_step": 0.1, "fit_tolerance": 1e-6}})
    done = validate_fit.run_fits(CurveReplays(), [validate_fit.fit_steps(cfg, [run], ["k"])])[0]
    assert done.values["k"] == pytest.approx(1.0, abs=1e-6)
    best, refused = done.start_cost, 0
    for _, cost in done.history:
        refused += cost >= best
        best = min(best, cost)
    assert refused >= 1  # a step that did not lower the error was refused on the way
    if start == 5.0:  # the first step lands near 0, where the start's slope no longer holds
        assert done.jacobians >= 2


def test_a_stop_scores_and_writes_the_runs_replayed_so_far(tmp_path, monkeypatch):
    """A signal once ended testbed-validate with nothing written, however many runs it had replayed."""
    calls: list = []
    fake = fake_replay(calls)
    looks = []

    def stop() -> bool:  # the flag a signal raises (app/entry/stop.py): up once two runs are replayed
        looks.append(1)
        return len(calls) >= 2

    monkeypatch.setattr(validate_fit, "simulate_run", fake)
    monkeypatch.setattr(V, "stop_on_signals", lambda: contextlib.nullcontext(stop))
    fit_fixture(tmp_path)
    cfg = config(f"validate.runs={tmp_path}", f"output.dir={tmp_path / 'out'}", "validate.jobs=1")
    report = V.validate(cfg)
    assert report["interrupted"] == "stopped after 2 of 4 runs: those are scored"
    assert report["replays"] == {"asked": 4, "simulated": 2} and len(calls) == 2
    written = json.loads((tmp_path / "out" / "validate.json").read_text())
    assert written["interrupted"] == report["interrupted"]
    assert set(pd.read_csv(tmp_path / "out" / "validate.csv")["run"]) == {name for name, _ in calls}
    assert (tmp_path / "out" / "validate.md").read_text().startswith("**interrupted**")

    calls.clear()  # a fit stopped part way fits nothing, and says how far it came
    cfg = config(f"validate.runs={tmp_path}", f"output.dir={tmp_path / 'fit'}", "validate.jobs=1",
                 "validate.fit=[hardware.step_overhead_s]")
    report = V.validate(cfg)
    assert report["interrupted"].startswith("stopped during the fit after 2 replays") and "fitted_on_all_models" not in report
    assert (tmp_path / "fit" / "validate.json").exists()


# --- replays the fit does without: none of them could change a fitted value or a score ----------------------

def test_the_start_and_its_jacobian_are_asked_in_one_round(tmp_path):
    """The Jacobian's points at the start do not depend on the start's residuals: asked with them, no core
    waits for the start's slowest replay before differencing."""
    runs = fit_fixture(tmp_path)
    cfg = config("hardware.step_overhead_s=0.006", "frontend.request_s=0.004")
    first = next(validate_fit.fit_steps(cfg, runs, list(TRUTH)))
    assert len(first) == len(runs) * (1 + len(TRUTH))
    assert len({(run.name, tuple(sorted(values.items()))) for run, values in first}) == len(first)


def test_a_step_refused_on_the_last_iteration_takes_no_jacobian(tmp_path):
    """From k = 5 the first step (to ~0) is taken and the second refused: with no iteration left, a fresh
    Jacobian would be simulated and never used."""
    run, = fit_fixture(tmp_path)[:1]
    cfg = OmegaConf.create({"k": 5.0, "validate": {"fit_method": "broyden", "fit_iterations": 2, "fit_step": 0.1,
                                                   "fit_tolerance": 1e-6}})
    replays = CurveReplays()
    done = validate_fit.run_fits(replays, [validate_fit.fit_steps(cfg, [run], ["k"])])[0]
    assert done.steps == 1 and len(done.history) == 2 and done.history[1][1] > done.cost  # the second refused
    assert done.jacobians == 1 and replays.simulated == 1 + 1 + 2  # start, its difference, two steps


def test_a_key_a_run_cannot_read_is_replayed_once_for_all_its_values(tmp_path, monkeypatch):
    """The all-reduce overhead prices nothing on one GPU: a TP 1 run's replay at a moved value is its
    replay at the config's (here the start's, so its finite difference costs no replay)."""
    calls: list = []
    monkeypatch.setattr(validate_fit, "simulate_run", fake_replay(calls))
    write_run(tmp_path, "run0", "org/A-1b", SMALL, [(4.0, 20.0)], tp=1)
    write_run(tmp_path, "run1", "org/B-1b", SMALL, [(4.0, 20.0)], tp=2)
    runs = load_runs(tmp_path)
    ar = "cost_model.allreduce_overhead_s"
    cfg = config("validate.jobs=1", "validate.fit_iterations=1", "hardware.step_overhead_s=0.006",
                 "frontend.request_s=0.004", f"{ar}=5e-6")
    replays = validate_fit.Replays(cfg)
    validate_fit.fit(cfg, replays, runs, [*TRUTH, ar])
    values = {name: [dict(v) for n, v in calls if n == name] for name in ("run0", "run1")}
    assert {v[ar] for v in values["run0"]} == {5e-6}  # never moved on one GPU
    assert len({v[ar] for v in values["run1"]}) == 2  # start and its difference (the step leaves it: no slope)
    assert replays.simulated == len(calls) == 2 * (1 + 3 + 1) - 1


def test_the_all_reduce_overhead_prices_nothing_on_one_gpu():
    """What `inert_keys` relies on: at TP 1 a step costs the same whatever cost_model.allreduce_overhead_s."""
    from testbed.core.cost import BatchShape, add_work
    from testbed.core.specs import HardwareSpec, ModelSpec, ParallelSpec
    from testbed.sim.kernel_cost import KernelCostModel
    from testbed.sim.kernel_db import KernelDB

    db = KernelDB("h100_sxm", "vllm")
    model = ModelSpec(name="llama2-7b", hidden_size=4096, intermediate_size=11008, num_layers=32, num_heads=32,
                      num_kv_heads=32, head_dim=128, vocab_size=32000)
    shapes = []
    for work in ([(799, 1, True)] * 8, [(0, 512, False), (300, 1, True)]):
        s = BatchShape()
        add_work(s, work)
        shapes.append(s)

    def times(tp: int, overhead: float) -> list[float]:
        cost = KernelCostModel(model, HardwareSpec(kernel_db_gpu="h100_sxm"), ParallelSpec(tp, 1), db,
                               max_tokens=4096, allreduce_overhead_s=overhead)
        return [cost.step_time(s) for s in shapes]

    assert times(1, 0.0) == times(1, 1e-3)  # exactly
    assert all(b > a for a, b in zip(times(2, 0.0), times(2, 1e-3)))


def test_a_held_out_runs_without_a_scored_stage_are_not_replayed_at_the_fit_on_all(tmp_path, monkeypatch):
    """With models held out, the fit on all is scored in-sample, over scored stages only: an overloaded
    run's replay there would be read by nothing. It is replayed once, at its model's own fit."""
    calls: list = []
    monkeypatch.setattr(validate_fit, "simulate_run", fake_replay(calls))
    fit_fixture(tmp_path)
    write_run(tmp_path, "run4", "org/A-1b", SMALL, [(4.0, 20.0)], [{"failed": 3}])
    cfg = config(f"validate.runs={tmp_path}", f"output.dir={tmp_path / 'out'}", "validate.jobs=1",
                 "validate.fit=[hardware.step_overhead_s,frontend.request_s]", "validate.fit_iterations=1",
                 "hardware.step_overhead_s=0.006", "frontend.request_s=0.004")
    report = V.validate(cfg)
    without_a = tuple(sorted(report["fitted_without_model"]["A-1b"].items()))
    assert [values for name, values in calls if name == "run4"] == [without_a]
    assert without_a != tuple(sorted(report["fitted_on_all_models"].items()))
    assert "run4" in set(pd.read_csv(tmp_path / "out" / "validate.csv")["run"])
    assert report["overloaded_stages"] == 1
