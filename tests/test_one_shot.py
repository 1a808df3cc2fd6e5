"""A one-command process (app/entry/one_shot.py) ends as an ordinary exit would for everything one can
see: its exit code, its buffered output, its exit hooks, and a live thread's work; only the heap's
teardown is skipped. The GC is turned off only in such a process."""
from __future__ import annotations

import gc
import subprocess
import sys
import textwrap

from testbed.app.entry import one_shot


def _run(body: str) -> subprocess.CompletedProcess:
    code = "import sys\nfrom testbed.app.entry.one_shot import run_once, gc_off_for_good\n" + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_the_exit_code_the_buffered_output_and_the_exit_hooks_survive():
    done = _run("""
        import atexit
        atexit.register(lambda: print("hook ran", flush=True))
        def command():
            sys.stdout.write("unflushed")  # no newline: still in the buffer at the end
            return 3
        sys.exit(run_once(command))
        """)
    assert done.returncode == 3, done.stderr
    assert done.stdout == "unflushedhook ran\n"


def test_none_exits_zero():
    assert _run("sys.exit(run_once(lambda: None))").returncode == 0


def test_a_live_thread_is_waited_for_as_an_ordinary_exit_waits(tmp_path):
    marker = tmp_path / "written"
    done = _run(f"""
        import threading, time
        def late():
            time.sleep(0.5)
            open({str(marker)!r}, "w").write("done")
        def command():
            threading.Thread(target=late).start()
            return 0
        sys.exit(run_once(command))
        """)
    assert done.returncode == 0, done.stderr
    assert marker.read_text() == "done"


def test_the_gc_goes_off_only_in_a_one_command_process():
    assert gc.isenabled()
    one_shot.gc_off_for_good()  # a test process is no one-command process
    assert gc.isenabled()
    done = _run("""
        import gc
        def command():
            gc_off_for_good()
            print(gc.isenabled())
        sys.exit(run_once(command))
        """)
    assert done.stdout == "False\n", done.stderr
