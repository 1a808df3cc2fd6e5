"""Runs and sweeps that survive interruption and failure: reruns redo what did not finish,
signals keep the finished requests' results, a stall says so, a killed sweep job loses only itself."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

TINY = ["trace.max_requests=50", "output.print_table=false"]


def command(args):
    """`python -m testbed ARGS` (the checkout's code, whatever console script is installed)."""
    return [sys.executable, "-m", "testbed", *args], {**os.environ, "HYDRA_FULL_ERROR": "0"}


def run_testbed(args, cwd):
    cmd, env = command(args)
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env=env, timeout=120)


def signal_when(args, cwd, marker: bytes, stream: str, sig):
    """Start the command, wait until `marker` shows on its stdout or stderr (the run is under
    way), send `sig`; the exit code and both outputs (no fixed delay: the machine may be slow)."""
    cmd, env = command(args)
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    seen = b""
    try:
        fd = getattr(proc, stream).fileno()
        while marker not in seen:
            chunk = os.read(fd, 4096)
            assert chunk, f"the run ended before {marker!r} showed: {seen.decode(errors='replace')[-2000:]}"
            seen += chunk
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    return proc.returncode, (seen if stream == "stdout" else b"") + out, (seen if stream == "stderr" else b"") + err


def assert_interrupted_results(out: Path, some_finished: bool = True):
    summary = json.loads((out / "summary.json").read_text())
    assert summary["interrupted"] is True
    table = pd.read_parquet(out / "requests.parquet")
    assert len(table) == summary["num_requests"]  # every trace row is accounted for
    assert summary["unfinished"] > 0 and (table.outcome == "unfinished").sum() == summary["unfinished"]
    assert set(table.reason[table.outcome == "unfinished"]) <= {"interrupted", "interrupted before it arrived"}
    if some_finished:
        assert summary["completed"] > 0 and table.e2el_ms[table.outcome == "finished"].notna().all()
    return summary


@pytest.mark.parametrize("state", ["interrupted", "stalled", "failed"])
def test_rerun_redoes_a_partial_run(tmp_path, state):
    out = tmp_path / "run"
    args = TINY + [f"output.dir={out}"]
    assert run_testbed(args, tmp_path).returncode == 0
    summary = out / "summary.json"
    if state == "failed":  # what a failed attempt over an earlier run's files leaves behind
        (out / "failed.json").write_text(json.dumps({"status": "failed", "reason": "JobKilled: killed by SIGKILL"}))
    else:  # what an interrupted (or stalled) run of this config leaves behind
        summary.write_text(json.dumps({**json.loads(summary.read_text()), state: True}))
    again = run_testbed(args, tmp_path)
    assert again.returncode == 0, again.stderr
    assert "skipped" not in again.stdout
    done = json.loads(summary.read_text())  # redone, complete
    assert not done["interrupted"] and not done["stalled"] and not (out / "failed.json").exists()
    if state == "interrupted":
        assert "skipped" in run_testbed(args, tmp_path).stdout  # a complete run is still skipped


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_keeps_the_simulators_finished_results(tmp_path, sig):
    """The whole Azure trace, stopped once the progress bar shows the simulation under way."""
    out = tmp_path / "run"
    code, _, err = signal_when(["output.write_steps=false", "output.print_table=false", "output.progress=true",
                                f"output.dir={out}"], tmp_path, b"requests=", "stderr", sig)
    assert code == 128 + sig, err.decode()[-3000:]
    assert f"interrupted by {signal.Signals(sig).name}" in err.decode()
    assert_interrupted_results(out)


def test_sigterm_keeps_the_engines_finished_results(tmp_path):
    pytest.importorskip("torch")
    out = tmp_path / "run"
    args = ["backend=engine", "model=tiny_llama", "trace.max_requests=200", "trace.rate_scale=5",
            "trace.max_prompt_len=64", "trace.max_output_len=16", "backend.device=cpu", "output.print_table=false",
            f"output.dir={out}"]
    code, stdout, err = signal_when(args, tmp_path, b"engine ready", "stdout", signal.SIGTERM)
    assert code == 143, (stdout + err).decode()[-3000:]
    assert_interrupted_results(out, some_finished=False)  # (signalled as it starts: it may have finished none)


@pytest.fixture
def stalling_policy(tmp_path, monkeypatch):
    """A policy plugin that never schedules anything, installed as a plugin is (an entry point in
    the `testbed.policies` group, a config on Hydra's search path): the arguments that select it."""
    site = tmp_path / "site"
    (site / "stall_plugin-0.dist-info").mkdir(parents=True)
    (site / "stall_plugin-0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: stall-plugin\nVersion: 0\n")
    (site / "stall_plugin-0.dist-info" / "entry_points.txt").write_text("[testbed.policies]\nnever = stall_plugin\n")
    (site / "stall_plugin.py").write_text(
        "from testbed import BasePolicy, Plan, register\n\n\n@register\nclass Never(BasePolicy):\n"
        "    name = 'never'\n\n    def schedule(self, view):\n        return Plan()\n")
    (site / "conf" / "policy").mkdir(parents=True)
    (site / "conf" / "policy" / "never.yaml").write_text("defaults:\n  - never_schema\nname: never\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([os.environ.get("PYTHONPATH", ""), str(site)]).strip(os.pathsep))
    return [f"hydra.searchpath=[file://{site / 'conf'}]", "policy=never"]


def test_a_stalled_run_says_so_and_exits_nonzero(tmp_path, stalling_policy):
    out = tmp_path / "run"
    proc = run_testbed(stalling_policy + ["trace.max_requests=20", f"output.dir={out}"], tmp_path)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "stalled: policy 'never' scheduled nothing while 20 requests" in proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stalled"] is True and summary["unfinished"] == 20


def test_steps_count_the_preemptions_of_preempt_only_plans():
    """A policy that, now and then, only preempts (and schedules in the plan it is asked for
    next): the per-step preemption column must add up to the requests' preemption count."""
    from conftest import make_loop, make_requests
    from testbed import BasePolicy, Plan
    from testbed.sim.simulation import Simulation

    class PreemptOnlyEveryFifthCall(BasePolicy):
        name = "preempt_only_test"

        def __init__(self):
            super().__init__()
            self.calls = 0

        def schedule(self, view):
            self.calls += 1
            plan = Plan()
            if self.calls % 5 == 0 and view.running:
                for s in view.running:
                    plan.preempt_request(s)
                return plan
            for s in list(view.running) + list(view.waiting):
                plan.schedule(s, view.num_new_tokens(s))
            return plan

    reqs = make_requests([(0.001 * i, 8, 6) for i in range(6)])
    loop = make_loop(PreemptOnlyEveryFifthCall(), budget=256)
    out = Simulation(reqs, lambda: loop, loop.cost_model, fast_forward=False).run()
    assert not out.stalled and all(s.status.value == "finished" for s in loop.states)
    preempted = sum(s.num_preemptions for s in loop.states)
    assert preempted > 0
    assert sum(loop.series.preemptions) == preempted


def _processes_using(folder: Path) -> set[int]:
    """Processes holding a file under `folder` open (Linux /proc)."""
    pids = set()
    for fd_dir in Path("/proc").glob("[0-9]*/fd"):
        try:
            if any(str(os.readlink(fd)).startswith(str(folder)) for fd in fd_dir.iterdir()):
                pids.add(int(fd_dir.parent.name))
        except OSError:  # gone, or not ours to read
            continue
    return pids


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


SWEEP = ["-m", "trace.max_requests=null,50,60", "output.write_steps=false", "output.print_table=false",
         "output.progress=true"]


def _start_sweep(tmp_path):
    """A sweep of three jobs on two workers: job 0 (the whole trace) runs long, job 1 beside it, job 2
    after. Returns the run once job 0's progress bar shows it a thousand requests in (only job 0 has
    that many), and job 0's process (the worker's forked child, holding job 0's log open as its worker does)."""
    from signalling import Run

    sweep = tmp_path / "sweep"
    run = Run([sys.executable, "-m", "testbed", *SWEEP, f"hydra.sweep.dir={sweep}", "hydra.sweep.subdir=${hydra.job.num}"],
              tmp_path)
    run.wait_for_output(b", requests=")
    pids = _processes_using(sweep / "0")
    forked = [p for p in pids if _parent(p) in pids]
    assert len(forked) == 1, (pids, run.text()[-2000:])
    return run, sweep, forked[0]


def _table(sweep: Path, out: str) -> pd.DataFrame:
    assert (sweep / "sweep_summary.csv").exists(), out[-3000:]
    table = pd.read_csv(sweep / "sweep_summary.csv").set_index("job")
    assert sorted(table.index) == [0, 1, 2], out[-3000:]
    return table


def _sweep_signalling_job0(tmp_path, sig, whom: str):
    """`sig` to job 0's own process ("job") or to the worker running it ("worker"), while it runs:
    the sweep's exit code, its table by job (jobs 1 and 2 finish), and its output."""
    run, sweep, job0 = _start_sweep(tmp_path)
    os.kill(_parent(job0) if whom == "worker" else job0, sig)
    code, out = run.finish()
    table = _table(sweep, out)
    assert list(table.status[[1, 2]]) == ["ok", "ok"] and list(table.completed[[1, 2]]) == [50, 60]
    return code, table, out


@pytest.mark.skipif(not Path("/proc/self/fd").exists(), reason="finds the job's process through /proc")
def test_a_killed_sweep_job_fails_alone_and_the_summary_lists_every_job(tmp_path):
    """SIGKILL, as the OOM killer sends it: that job fails, the others finish, all are listed."""
    code, table, out = _sweep_signalling_job0(tmp_path, signal.SIGKILL, "job")
    assert code != 0  # a job failed: the sweep says so
    assert table.status[0] == "failed: JobKilled: killed by SIGKILL", out
    assert "job 0 (" in out and "killed by SIGKILL" in out


@pytest.mark.skipif(not Path("/proc/self/fd").exists(), reason="finds the job's process through /proc")
def test_sigterm_to_a_sweep_worker_interrupts_its_job_cleanly(tmp_path):
    """SIGTERM to the worker running job 0 (as a kill of it would): the job writes its finished
    requests and is listed interrupted; the sweep goes on and exits non-zero."""
    code, table, out = _sweep_signalling_job0(tmp_path, signal.SIGTERM, "worker")
    assert code not in (0, 143) and table.status[0] == "interrupted", out  # (a job failed; the sweep was not stopped)
    assert table.completed[0] > 0 and table.unfinished[0] > 0 and "interrupted by SIGTERM" in out


@pytest.mark.skipif(not Path("/proc/self/fd").exists(), reason="finds the sweep's processes through /proc")
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_to_a_sweep_stops_it_whole_and_lists_every_job(tmp_path, sig):
    """SIGTERM to the sweep once left its workers running for minutes (holding its stdout: this
    test's pipe never reached EOF), wrote no sweep_summary.csv, and Ctrl-C exited 1. Now: job 0
    writes its finished requests, marked interrupted, every job is listed, the command exits 128 +
    the signal, and no process of the sweep outlives it."""
    run, sweep, job0 = _start_sweep(tmp_path)
    run.signal(sig)
    code, out = run.finish()  # (EOF of the pipe: every process holding it has ended)
    assert code == 128 + sig and "Traceback" not in out, out[-3000:]
    table = _table(sweep, out)
    assert table.status[0] == "interrupted" and table.completed[0] > 0 and table.unfinished[0] > 0, out[-3000:]
    for job in (1, 2):  # done before the signal, or stopped by it
        assert table.status[job] == "ok" or table.status[job].startswith("interrupted"), table.status[job]
    assert run.session_left() == []


@pytest.mark.skipif(not Path("/proc/self/fd").exists(), reason="finds the sweep's processes through /proc")
def test_a_sweep_killed_outright_leaves_no_job_running(tmp_path):
    """`kill -9` of the sweep: its workers and their jobs' children die with it (the running job
    once went on, unseen, and wrote its results afterwards)."""
    run, sweep, job0 = _start_sweep(tmp_path)
    run.proc.kill()
    code, out = run.finish()  # EOF: no process holds the sweep's stdout any more
    assert code == -signal.SIGKILL and run.session_left() == [], out[-2000:]
    assert not (sweep / "0" / "summary.json").exists()


def test_a_stalled_sweep_job_is_listed_as_stalled(tmp_path, stalling_policy):
    searchpath, _ = stalling_policy
    sweep = tmp_path / "sweep"
    proc = run_testbed(["-m", searchpath, "policy=never,vllm", "trace.max_requests=20", f"hydra.sweep.dir={sweep}",
                        "output.print_table=false"], tmp_path)
    assert proc.returncode != 0 and "stalled: policy 'never'" in proc.stdout + proc.stderr
    table = pd.read_csv(sweep / "sweep_summary.csv").set_index("policy")
    assert table.status.to_dict() == {"never": "stalled", "vllm": "ok"}
    assert not list(sweep.glob("*/failed.json"))  # its results are written: stalled, not failed
    from testbed.app.reports.report import build_report

    page = build_report(sweep).read_text()  # the report plots only the complete runs
    assert "1 jobs plotted; policies: vllm." in page and "stalled" in page  # listed under the jobs not plotted


def test_an_unwritable_output_folder_fails_before_the_run(tmp_path):
    """Checked at start, naming the key (it once failed only after the whole run, losing it)."""
    proc = run_testbed(["output.dir=/proc/no_such_dir/run", "trace.max_requests=5"], tmp_path)
    assert proc.returncode != 0
    assert "output.dir=/proc/no_such_dir/run: the results cannot be written there" in proc.stderr
    assert "simulated in" not in proc.stdout  # nothing ran


@pytest.mark.skipif(not Path("/proc/self/fd").exists(), reason="finds the sweep's processes through /proc")
def test_ctrl_c_while_the_workers_start_stops_the_sweep_without_a_traceback(tmp_path):
    """A terminal's Ctrl-C reaches the whole process group: loky's workers, still starting (seconds of
    imports), once took it as a KeyboardInterrupt, the pool broke and the worker's traceback was
    printed. Now they start deaf to it (app/entry/sweep_signals.py), and every job is listed as not started."""
    from signalling import Run

    sweep = tmp_path / "sweep"
    run = Run([sys.executable, "-m", "testbed", *SWEEP, f"hydra.sweep.dir={sweep}", "hydra.sweep.subdir=${hydra.job.num}"],
              tmp_path)
    run.wait_until(lambda: _booting_worker(run.proc.pid), "a loky worker starting")
    os.killpg(run.proc.pid, signal.SIGINT)  # as the terminal sends it
    code, out = run.finish()
    assert code == 130 and "Traceback" not in out, out[-3000:]
    table = _table(sweep, out)
    assert all(status.startswith("interrupted") for status in table.status), table.status
    assert run.session_left() == []


def _booting_worker(parent: int) -> bool:
    """Whether `parent` has a loky worker that has not taken its first job yet (it ignores no signal)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if _parent(int(stat.parent.name)) != parent:
                continue
            cmdline = (stat.parent / "cmdline").read_bytes()
            status = (stat.parent / "status").read_text()
        except (OSError, ValueError, IndexError):
            continue
        ignored = next(int(line.split()[1], 16) for line in status.splitlines() if line.startswith("SigIgn:"))
        if b"loky" in cmdline and not ignored & (1 << (signal.SIGTERM - 1)):
            return True
    return False
