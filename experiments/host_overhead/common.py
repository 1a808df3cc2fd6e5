"""What every host-overhead measurement here shares: the quiet lock, the machine's description,
robust statistics and the a + b*B fit.

Run with the Python that has vLLM (its own venv): nothing here imports the testbed, so the same
scripts run under vLLM 0.15.1 (the version of the calibration runs) and under the project's 0.32.

Timing windows take `/tmp/quiet.lock` exclusively (the workplace's rule for wall-time figures on
this shared 2-core machine) only around the timed loops, not around setup (model building, the
prefill of B x L tokens), so an exclusive hold lasts seconds, and the load average is recorded at
the start and end of each hold.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import platform
import statistics
import time

LOCK = "/tmp/quiet.lock"
BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def loadavg() -> float:
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


class Quiet:
    """`with QUIET():` holds the exclusive quiet lock around a timed window and remembers the 1-minute
    load average at each acquisition and release.

    The lock is shared by several agents whose jobs take it shared (`flock -s`), and a waiting
    exclusive request does not stop new shared holders, so it can starve: after `HOST_OVERHEAD_LOCK_WAIT`
    seconds (default 120) without the lock the window runs unlocked and is counted as such.
    `HOST_OVERHEAD_LOCK=0` never takes it. Every figure is therefore also measured as the thread's CPU
    time (CLOCK_THREAD_CPUTIME_ID), which excludes the time the thread was not running."""

    def __init__(self) -> None:
        self.loads: list[float] = []
        self.locked = 0
        self.unlocked = 0
        self.use = os.environ.get("HOST_OVERHEAD_LOCK", "1") != "0"
        self.wait = float(os.environ.get("HOST_OVERHEAD_LOCK_WAIT", "60"))
        self.budget = float(os.environ.get("HOST_OVERHEAD_LOCK_BUDGET", "240"))

    def _acquire(self, fd) -> bool:
        start = time.monotonic()
        deadline = start + min(self.wait, self.budget)
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    return True
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        return False
                    time.sleep(0.05)
        finally:
            self.budget = max(0.0, self.budget - (time.monotonic() - start))

    @contextlib.contextmanager
    def __call__(self):
        fd = os.open(LOCK, os.O_RDWR | os.O_CREAT, 0o666) if self.use else None
        got = False
        try:
            if fd is not None:
                got = self._acquire(fd)
            self.locked += got
            self.unlocked += not got
            self.loads.append(loadavg())
            yield
            self.loads.append(loadavg())
        finally:
            if fd is not None:
                if got:
                    fcntl.flock(fd, fcntl.LOCK_UN)
                os.close(fd)

    def summary(self) -> str:
        if not self.loads:
            return "no timed window"
        return (f"1-min load average over the timed windows: min {min(self.loads):.2f}, max {max(self.loads):.2f}; "
                f"windows under the exclusive lock: {self.locked} of {self.locked + self.unlocked}")


QUIET = Quiet()


def cpu_model() -> tuple[str, float]:
    """(model name, current MHz of cpu0) from /proc/cpuinfo."""
    name, mhz = platform.processor() or "?", float("nan")
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name") and name in ("?", ""):
                name = line.split(":", 1)[1].strip()
            elif line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
            if line.startswith("cpu MHz"):
                mhz = float(line.split(":", 1)[1])
                break
    return name, mhz


def machine() -> dict:
    import torch
    import vllm

    name, mhz = cpu_model()
    return dict(cpu=name, cpu_mhz=mhz, cores=os.cpu_count(), python=platform.python_version(),
                vllm=vllm.__version__, torch=torch.__version__, omp_threads=os.environ.get("OMP_NUM_THREADS"),
                load_at_start=loadavg(), time=time.strftime("%Y-%m-%d %H:%M:%S"))


def stats_us(samples_ns: list[int], cpu_ns: list[int] | None = None) -> dict:
    """Median, mean, 10th and 90th percentile of wall-time samples given in ns, in microseconds; with
    `cpu_ns` (the same calls' thread CPU time) its median and percentiles beside them."""
    us = sorted(s / 1e3 for s in samples_ns)
    n = len(us)
    q = statistics.quantiles(us, n=10) if n >= 2 else [us[0]] * 9
    out = dict(n=n, median_us=round(statistics.median(us), 2), mean_us=round(statistics.fmean(us), 2),
               p10_us=round(q[0], 2), p90_us=round(q[8], 2))
    if cpu_ns is not None:
        c = sorted(s / 1e3 for s in cpu_ns)
        qc = statistics.quantiles(c, n=10) if n >= 2 else [c[0]] * 9
        out.update(cpu_median_us=round(statistics.median(c), 2), cpu_mean_us=round(statistics.fmean(c), 2),
                   cpu_p10_us=round(qc[0], 2), cpu_p90_us=round(qc[8], 2))
    return out


def fit_line(xs, ys) -> tuple[float, float, float]:
    """a + b*x fitted to minimise the squared RELATIVE residuals (batch sizes span 1..256, so a plain
    least-squares fit would leave the per-step term to the largest batches); returns (a, b, the largest
    relative residual)."""
    import numpy as np

    x, y = np.asarray(xs, float), np.asarray(ys, float)
    w = 1.0 / np.maximum(y, 1e-9)
    A = np.stack([np.ones_like(x), x], axis=1) * w[:, None]
    (a, b), *_ = np.linalg.lstsq(A, y * w, rcond=None)
    resid = np.abs(a + b * x - y) * w
    return float(a), float(b), float(resid.max())


def write_csv(path: str, rows: list[dict]) -> None:
    import csv

    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def write_meta(path: str, meta: dict) -> None:
    with open(path, "w") as f:
        json.dump(meta, f, indent=1)
        f.write("\n")


def version_tag() -> str:
    import vllm

    return "v" + vllm.__version__.split("+")[0].replace(".", "")


def tiny_model_dir(vocab_size: int = 32000, weights: bool = True) -> str:
    """A tiny Llama (2 layers, hidden 64, 2 heads of 32, 1 KV head) saved to a temporary folder, with
    seeded random weights when `weights` (vLLM 0.15.1's ModelConfig otherwise retries a hub lookup of
    the safetensors for seconds). Nothing is downloaded."""
    import tempfile

    from transformers import LlamaConfig

    folder = tempfile.mkdtemp(prefix="tiny-llama-")
    cfg = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                      head_dim=32, vocab_size=vocab_size, intermediate_size=128, max_position_embeddings=8192,
                      tie_word_embeddings=False)
    if weights:
        import torch
        from transformers import LlamaForCausalLM

        torch.manual_seed(0)
        LlamaForCausalLM(cfg).save_pretrained(folder)
    else:
        cfg.save_pretrained(folder)
    return folder
