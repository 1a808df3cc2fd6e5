"""BLIS (github.com/inference-sim/inference-sim, Go), run beside our cases in speed.py on the same workload.

Issue 27's target is a ratio against the fastest peer, and a ratio from two separate sessions on this
shared machine measures the load as much as the simulators; so speed.py runs each BLIS counterpart right
after our run of the same case (A B A B) and both are timed the same way (CPU seconds of the process
from os.wait4). Nothing here builds BLIS: the workspace's shared/tools/blis/ does (its README), and its
azure_to_tracev2.py writes BLIS's input from our own loader's reading of the bundled trace, so both
sides see the same 19,366 requests. That script is called where it lies, never copied into the project.

`--cache-signal-delay 0` throughout: BLIS's default (50 ms) copies every instance's prefix-cache map at
nearly every routing decision (86% of its CPU on the 1x trace, for routers that never read it); with 0
its per-request results are byte-identical for round robin, so it is the fair figure to race.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# our case name -> (rate scale of the trace BLIS replays, BLIS flags beyond the common ones)
COUNTERPARTS = {
    "main command": (1, []),
    "16 replicas, 16x load": (16, ["--num-instances", "16", "--routing-policy", "round-robin"]),
}
# shared/tools/blis/README.md: the model, hardware and engine limits matching our defaults
COMMON = ["--model", "meta-llama/llama-3.1-8b-instruct", "--hardware", "H100", "--tp", "1",
          "--latency-model", "trained-physics", "--max-num-batched-tokens", "8192", "--max-num-seqs", "256",
          "--max-model-len", "8192", "--cache-signal-delay", "0"]


def find_tools(given: str | None) -> Path | None:
    """The workspace's shared/tools/blis: given, or in a folder above the repository (a worktree sits
    deeper than the main checkout, so ../shared alone would miss it)."""
    cands = [Path(given)] if given else [up / "shared" / "tools" / "blis" for up in REPO.parents]
    return next((c for c in cands if (c / "azure_to_tracev2.py").is_file()), None)


def find_binary(given: str | None) -> Path | None:
    """The blis binary: given, $BLIS, or build_blis.sh's default workdir (${TMPDIR:-/tmp}/blis)."""
    cands = [given] if given else [os.environ.get("BLIS"),
                                   f"{os.environ.get('TMPDIR', '/tmp')}/blis/bin/blis", "/tmp/blis/bin/blis"]
    for c in cands:
        if c and Path(c).is_file() and os.access(c, os.X_OK):
            return Path(c)
    return None


class Blis:
    """One BLIS build and the traces it replays; `run(case)` times one replay of that case's workload."""

    def __init__(self, binary: Path, tools: Path, src: Path | None, tmp: str):
        self.binary, self.tools, self.tmp = binary, tools, tmp
        # BLIS reads defaults.yaml, hardware_config.json and model_configs/ from its working directory
        self.src = src or binary.parent.parent / "src" / "blis"
        if not (self.src / "defaults.yaml").is_file():
            raise SystemExit(f"BLIS source folder {self.src} has no defaults.yaml (give --blis-src)")
        self.traces: dict[float, str] = {}

    def trace(self, scale: float) -> str:
        """Write the TraceV2 pair once per rate scale, untimed: input preparation is no part of the race."""
        if scale not in self.traces:
            out = f"{self.tmp}/blis_trace_x{scale:g}"
            subprocess.run([sys.executable, str(self.tools / "azure_to_tracev2.py"), out,
                            "--rate-scale", str(scale)], check=True, stdout=subprocess.DEVNULL,
                           env={**os.environ, "PYTHONPATH": os.pathsep.join(
                               filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))})
            self.traces[scale] = out
        return self.traces[scale]

    def run(self, case: str, workdir: str) -> dict:
        scale, extra = COUNTERPARTS[case]
        prefix = self.trace(scale)
        os.makedirs(workdir, exist_ok=True)
        results = f"{workdir}/results.json"
        cmd = [str(self.binary), "replay", "--trace-header", prefix + ".yaml", "--trace-data", prefix + ".csv",
               *COMMON, *extra, "--results-path", results]
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=self.src, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        err = proc.stderr.read().decode(errors="replace")  # BLIS logs to stderr: drain it while it runs
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
        proc.stderr.close()
        if status != 0:
            raise SystemExit(f"{' '.join(cmd)} failed ({status}):\n{err[-3000:]}")
        done = json.loads(Path(results).read_text())  # one SimResult per finished request
        return {"finished": len(done), "e2e_ms": sum(d["e2e_us"] for d in done) / max(len(done), 1) / 1e3, "wall": wall, "cpu": usage.ru_utime + usage.ru_stime,
                "rss_mib": usage.ru_maxrss / 1024}
