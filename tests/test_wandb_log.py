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


def test_offline_round_trip(tmp_path):
    out = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in ("WANDB_API_KEY", "WANDB_MODE")}
    env.update(WANDB_SILENT="true", WANDB_DIR=str(tmp_path))
    proc = subprocess.run([sys.executable, "-m", "testbed", "logger=wandb", "trace.max_requests=200",
                           "logger.max_history_rows=50", "policy=static", f"output.dir={out}"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    files = list(out.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 1, "expected one offline run"
    config, summary, history, run = {}, {}, [], None
    for rec in wandb_records(files[0]):
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            run = rec.run
            config.update({u.key: json.loads(u.value_json) for u in rec.run.config.update})
        elif kind == "summary":
            summary.update({u.key: json.loads(u.value_json) for u in rec.summary.update if u.key})
        elif kind == "history":
            history.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item})
    assert run.job_type == "sim" and run.run_group == "single-runs"
    config = {k: v.get("value", v) if isinstance(v, dict) else v for k, v in config.items()}
    assert config["policy"]["name"] == "static" and config["trace"]["max_requests"] == 200
    expected = json.loads((out / "summary.json").read_text())
    assert summary["completed"] == expected["completed"] == 200
    assert abs(summary["p99_ttft_ms"] - expected["p99_ttft_ms"]) < 1e-9
    steps = [h for h in history if "batch_tokens" in h]
    assert 10 <= len(steps) <= 50 and all(h["kv_used_blocks"] >= 0 for h in steps)
    assert any("requests/nrows" in h and h["requests/nrows"] == 200 for h in history)
