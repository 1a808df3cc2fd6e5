"""logger=wandb writes an offline run whose config, summary and history read back."""
from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path


def wandb_records(path: Path):
    """Records of a .wandb file: a 7-byte header, then LevelDB-log framing of protobuf Records."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", "not a W&B run file"
    pos, block, buf = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + n], pos + 7 + n
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(buf + chunk if kind == 4 else chunk)
            yield rec
        elif kind == 2:
            buf = chunk
        elif kind == 3:
            buf += chunk


def read_run(path: Path) -> dict:
    """A .wandb file's run record, config, summary, history rows and defined metrics."""
    config, summary, history, metrics, run = {}, {}, [], {}, None
    for rec in wandb_records(path):
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            run = rec.run
            config.update({u.key: json.loads(u.value_json) for u in rec.run.config.update})
        elif kind == "summary":
            summary.update({u.key: json.loads(u.value_json) for u in rec.summary.update if u.key})
        elif kind == "history":
            history.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item})
        elif kind == "metric" and rec.metric.name:
            metrics[rec.metric.name] = rec.metric.step_metric
    config = {k: v.get("value", v) if isinstance(v, dict) else v for k, v in config.items()}
    return {"run": run, "config": config, "summary": summary, "history": history, "metrics": metrics}


def _env(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("WANDB_API_KEY", "WANDB_MODE")}
    env.update(WANDB_SILENT="true", WANDB_DIR=str(tmp_path))
    return env


def test_offline_round_trip(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "testbed", "logger=wandb", "trace.max_requests=200",
                           "logger.max_history_rows=50", "policy=static", f"output.dir={out}"],
                          cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    files = list(out.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 1, "expected one offline run"
    got = read_run(files[0])
    run, config, summary, history = got["run"], got["config"], got["summary"], got["history"]
    assert run.job_type == "sim" and run.run_group == "static-azure_conv" and run.display_name == "static-azure_conv"
    assert config["policy"]["name"] == "static" and config["trace"]["max_requests"] == 200
    expected = json.loads((out / "summary.json").read_text())
    assert summary["completed"] == expected["completed"] == 200
    assert abs(summary["p99_ttft_ms"] - expected["p99_ttft_ms"]) < 1e-9
    steps = [h for h in history if "batch_tokens" in h]
    assert 10 <= len(steps) <= 50 and all(h["kv_used_blocks"] >= 0 for h in steps)
    assert any("requests/nrows" in h and h["requests/nrows"] == 200 for h in history)
    # the step series are plotted against simulated time, not W&B's own step counter
    assert got["metrics"]["batch_tokens"] == got["metrics"]["kv_used_blocks"] == "sim_time_s"
    times = [h["sim_time_s"] for h in steps]
    assert times == sorted(times) and times[-1] > times[0] > -1
    # and the command says where the run is, and how to upload it
    hint = [line for line in proc.stdout.splitlines() if line.startswith("W&B: ")]
    assert hint == [f"W&B: offline run in {files[0].parent}; upload with: wandb sync {files[0].parent}"]


def test_a_sweeps_runs_share_a_group_and_are_named_by_their_swept_values(tmp_path):
    sweep = tmp_path / "sweep"
    proc = subprocess.run([sys.executable, "-m", "testbed", "-m", "hydra/launcher=basic", "logger=wandb",
                           "policy=vllm,static", "trace.max_requests=40", "logger.log_requests_table=false",
                           f"hydra.sweep.dir={sweep}"],
                          cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    runs = {}
    for path in sweep.glob("*/wandb/offline-run-*/run-*.wandb"):
        run = read_run(path)["run"]
        runs[run.display_name] = run.run_group
    # the group: the trace both policies ran (not the sweep folder's clock time); the name: the swept value only
    assert runs == {"policy=vllm": "azure_conv", "policy=static": "azure_conv"}
    hint = [line for line in proc.stdout.splitlines() if line.startswith("W&B: ")]
    assert hint == [f"W&B: 2 offline runs under {sweep}; upload with: wandb sync {sweep}/*/wandb/offline-run-*"]


def test_an_experiments_runs_are_grouped_by_its_name(monkeypatch):
    """run_identity in a sweep job of `+experiment=...` (HydraConfig patched: the experiment's own sweep is
    hundreds of jobs)."""
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    import hydra.core.hydra_config as hc_module
    from testbed.app.reports.wandb_log import run_identity

    hc = SimpleNamespace(runtime=SimpleNamespace(choices={"experiment": "policies_vs_load", "policy": "sjf"}),
                         mode=SimpleNamespace(name="MULTIRUN"), sweep=SimpleNamespace(dir="/nonexistent/sweep"),
                         overrides=SimpleNamespace(task=["+experiment=policies_vs_load", "policy=sjf",
                                                         "trace.rate_scale=2", "logger=wandb"]))
    monkeypatch.setattr(hc_module.HydraConfig, "initialized", staticmethod(lambda: True))
    monkeypatch.setattr(hc_module.HydraConfig, "get", staticmethod(lambda: hc))
    cfg = OmegaConf.create({"policy": {"name": "sjf"}, "trace": {"name": "azure_conv"}})
    group, name = run_identity(cfg)  # no plan file: every override but the logger's and the experiment's is taken as swept
    assert group == "policies_vs_load"
    assert name == "policy=sjf,trace.rate_scale=2"
