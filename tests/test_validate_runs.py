"""testbed-validate: real runs read back, their workload rebuilt, the simulator scored and fitted.

The fixtures are written here in inference-perf's format (the calibration runs themselves may
not be copied into the project). The fit test makes its "real" runs with the simulator at known
overheads and checks that the fit finds them again from other starting values, on a model it
did not fit on (leave-one-model-out).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml
from hydra import compose, initialize_config_dir

from testbed.app.cli import CONF_DIR
from testbed.app.real_runs import RealRunError, load_run, load_runs
from testbed.app import validate_runs as V
from testbed.traces.shared_prefix import shared_prefix_requests

SMALL = {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 8, "num_attention_heads": 16,
         "num_key_value_heads": 4, "vocab_size": 32000, "max_position_embeddings": 4096}
SMALLER = dict(SMALL, hidden_size=768, num_hidden_layers=6, num_attention_heads=12, num_key_value_heads=12)


def write_run(root: Path, name: str, model_id: str, model_cfg: dict, stages: list[tuple[float, float]],
              measured: list[dict] | None = None, tp: int = 1) -> Path:
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
                          "prompt_len": {"mean": m.get("prompt_len", 420.0)},
                          "latency": {"time_to_first_token": {"mean": m.get("ttft", 0.02)},
                                      "request_latency": {"mean": m.get("e2e", 1.0)}}},
            "failures": {"count": m.get("failed", 0)}}))
    cfgdir = root / "model_configs" / model_id.rsplit("/", 1)[-1]
    cfgdir.mkdir(parents=True, exist_ok=True)
    (cfgdir / "config.json").write_text(json.dumps(model_cfg))
    return d


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
                  [{"ttft": s.sim["ttft"], "e2e": s.sim["e2e"], "prompt_len": 420.0} for s in made])
    cfg.validate.runs = str(tmp_path / "again")
    report = V.validate(cfg)
    assert report["fitted_on_all_models"]["hardware.step_overhead_s"] == pytest.approx(0.004, rel=0.05)
    for values in report["fitted_without_model"].values():
        assert values["hardware.step_overhead_s"] == pytest.approx(0.004, rel=0.05)
    errors = report["leave_one_model_out_median_abs_error"]
    assert max(errors.values()) < 0.03
    md = (tmp_path / "out" / "validate.md").read_text()
    assert "leave-one-model-out median absolute error" in md and "r-smaller" in md
    # from the wrong starting value, without a fit, the same runs are off by more
    cfg.validate.fit = []
    assert max(V.validate(cfg)["median_abs_error"].values()) > 0.02
